// Built when strata is compiled without the CUDA toolkit.
#include "strata/offload/cuda_runtime.h"

#include "strata/core/error.h"

namespace strata::offload::cuda {

RuntimeInfo probe() {
  RuntimeInfo info;
  info.error = "strata was built without the CUDA toolkit";
  return info;
}

bool host_register(void*, size_t) noexcept { return false; }
void host_unregister(void*) noexcept {}

void* device_malloc(int, size_t) { STRATA_FAIL("CUDA device memory requested, but strata was built without CUDA"); }
void device_free(int, void*) noexcept {}
DeviceEvent copy_async(int, void*, const void*, size_t, bool, const DeviceEvent&) {
  STRATA_FAIL("strata was built without CUDA");
}
DeviceEvent record_compute(int) { STRATA_FAIL("strata was built without CUDA"); }
void compute_wait(int, const DeviceEvent&) { STRATA_FAIL("strata was built without CUDA"); }
void device_memset_zero(int, void*, size_t) { STRATA_FAIL("strata was built without CUDA"); }

}  // namespace strata::offload::cuda
