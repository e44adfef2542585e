#pragma once
// DeviceMemory: the memory of the `device` tier.
//
// With a usable CUDA device it is that GPU's memory (cudaMalloc). Without one,
// the device is emulated by a HostArena of its own that is not pinned: every
// code path of the runtime (budgets, eviction, copies in and out) runs and is
// tested on a CPU-only machine, with memcpy standing in for the DMA engines.
// STRATA_DEVICE=emulated forces emulation on a GPU machine; STRATA_DEVICE=cuda:N
// picks a GPU.

#include <cstddef>
#include <memory>
#include <string>

namespace strata::offload {

enum class DeviceKind : int {
  kEmulated = 0,  // host memory playing the device
  kCuda = 1,      // a CUDA GPU
};

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  virtual DeviceKind kind() const noexcept = 0;
  /// "cuda:0 (NVIDIA H200)" or "emulated in host memory".
  virtual std::string name() const = 0;
  /// The CUDA device ordinal; 0 when emulated.
  virtual int index() const noexcept { return 0; }
  /// Guaranteed alignment of allocate()'s result.
  virtual size_t alignment() const noexcept = 0;

  /// Uninitialised device memory. Throws strata::Error when the device refuses.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr) noexcept = 0;

  virtual void copy_from_host(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* device_src, size_t bytes) = 0;
  virtual void fill_zero(void* device_ptr, size_t bytes) = 0;
  /// Whether host code may dereference device pointers (true when emulated).
  virtual bool host_accessible() const noexcept = 0;
};

/// Chooses the device from STRATA_DEVICE, else the first CUDA device, else emulation.
std::unique_ptr<DeviceMemory> make_device_memory();
std::unique_ptr<DeviceMemory> make_emulated_device_memory();
/// Throws strata::Error when CUDA or device `index` is unavailable.
std::unique_ptr<DeviceMemory> make_cuda_device_memory(int index);

}  // namespace strata::offload
