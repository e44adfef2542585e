// The CUDA-runtime half of cuda_runtime.h; compiled only when the toolkit is found.
#include "strata/offload/cuda_runtime.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#if defined(STRATA_HAVE_NCCL)
#include <nccl.h>
#endif

#include "strata/core/cuda_check.h"
#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::offload::cuda {

RuntimeInfo probe() {
  RuntimeInfo info;
  info.compiled = true;
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
#if defined(STRATA_HAVE_NCCL)
  info.nccl_compiled = true;
  if (ncclGetVersion(&info.nccl_version) != ncclSuccess) info.nccl_version = NCCL_VERSION_CODE;
#endif
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls are not poisoned
    return info;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    DeviceInfo dev;
    dev.index = i;
    dev.name = prop.name;
    dev.total_bytes = prop.totalGlobalMem;
    dev.compute_major = prop.major;
    dev.compute_minor = prop.minor;
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      dev.free_bytes = free_b;
    }
    info.devices.push_back(dev);
  }
  if (info.devices.empty()) info.error = "no CUDA device";
  return info;
}

bool host_register(void* ptr, size_t bytes) noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    STRATA_LOG(kWarn, "cudaHostRegister({} bytes) failed: {}; host memory stays pageable", bytes,
               cudaGetErrorString(err));
    cudaGetLastError();
    return false;
  }
  return true;
}

void host_unregister(void* ptr) noexcept {
  const cudaError_t err = cudaHostUnregister(ptr);
  if (err != cudaSuccess) {
    STRATA_LOG(kWarn, "cudaHostUnregister failed: {}", cudaGetErrorString(err));
    cudaGetLastError();
  }
}

void* device_malloc(int device, size_t bytes) {
  STRATA_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  void* ptr = nullptr;
  STRATA_CUDA_CHECK(cudaMalloc(&ptr, bytes), "allocating ", bytes, " bytes on cuda:", device);
  return ptr;
}

void device_free(int device, void* ptr) noexcept {
  if (ptr == nullptr) return;
  cudaSetDevice(device);
  const cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) {
    STRATA_LOG(kError, "cudaFree on cuda:{} failed: {}", device, cudaGetErrorString(err));
    cudaGetLastError();
  }
}

namespace {

// One stream per direction and device, so uploads and downloads overlap; each
// copy waits on an event of its own, so several threads can share a stream.
cudaStream_t direction_stream(int device, bool to_device) {
  static std::mutex mu;
  static std::map<std::pair<int, bool>, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  cudaStream_t& s = streams[{device, to_device}];
  if (s == nullptr) {
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "creating a copy stream on cuda:", device);
  }
  return s;
}

void copy_on_stream(int device, void* dst, const void* src, size_t bytes, bool to_device) {
  STRATA_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  cudaStream_t stream = direction_stream(device, to_device);
  cudaEvent_t done = nullptr;
  STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "creating a copy event");
  const cudaError_t copy = cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                           stream);
  const cudaError_t record = copy == cudaSuccess ? cudaEventRecord(done, stream) : copy;
  const cudaError_t sync = record == cudaSuccess ? cudaEventSynchronize(done) : record;
  cudaEventDestroy(done);
  STRATA_CUDA_CHECK(sync, "copying ", bytes, to_device ? " bytes host -> cuda:" : " bytes cuda:", device,
                    to_device ? "" : " -> host");
}

}  // namespace

void copy_host_to_device(int device, void* dst, const void* src, size_t bytes) {
  copy_on_stream(device, dst, src, bytes, true);
}

void copy_device_to_host(int device, void* dst, const void* src, size_t bytes) {
  copy_on_stream(device, dst, src, bytes, false);
}

void device_memset_zero(int device, void* ptr, size_t bytes) {
  STRATA_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  STRATA_CUDA_CHECK(cudaMemset(ptr, 0, bytes), "zeroing ", bytes, " bytes on cuda:", device);
}

}  // namespace strata::offload::cuda
