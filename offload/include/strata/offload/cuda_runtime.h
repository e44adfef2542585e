#pragma once
// The CUDA runtime as the rest of strata sees it: a plain C++ interface with no
// CUDA headers, so that everything above builds without the toolkit. A build
// without CUDA links cuda/cuda_runtime_none.cpp, which reports "not compiled".

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/offload/device_event.h"

namespace strata::offload::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

struct RuntimeInfo {
  bool compiled = false;     // strata was built with the CUDA toolkit
  int runtime_version = 0;   // e.g. 13000, from cudaRuntimeGetVersion
  int driver_version = 0;    // 0 when no driver is installed
  std::string error;         // why no device is usable, when devices is empty
  std::vector<DeviceInfo> devices;
};

/// Queries the runtime once. Never throws: a missing driver or device is
/// reported in `error` and leaves `devices` empty.
RuntimeInfo probe();

/// Formats 13000 as "13.0", 22703 (NCCL) as "2.27.3".
std::string format_cuda_version(int version);
std::string format_nccl_version(int version);

/// Page-locks [ptr, ptr+bytes) for the device (cudaHostRegister). Returns false
/// when there is no usable device or the runtime refuses; never throws.
bool host_register(void* ptr, size_t bytes) noexcept;
void host_unregister(void* ptr) noexcept;

/// Device memory on `device` (the device arena's segments). device_malloc
/// throws strata::Error with the decoded CUDA error.
void* device_malloc(int device, size_t bytes);
void device_free(int device, void* ptr) noexcept;
/// A copy on `device`'s copy stream of its direction (one per direction and
/// device, non-blocking), after `after` (cudaStreamWaitEvent); the event
/// completes with the copy (Note [Copy streams and events]).
DeviceEvent copy_async(int device, void* dst, const void* src, size_t bytes, bool to_device, const DeviceEvent& after);
/// An event recorded now on the compute stream (the legacy default stream).
DeviceEvent record_compute(int device);
/// The compute stream waits for `event` without blocking the host.
void compute_wait(int device, const DeviceEvent& event);
/// Zeroes device memory on the host-to-device copy stream, waited for.
void device_memset_zero(int device, void* ptr, size_t bytes);

}  // namespace strata::offload::cuda
