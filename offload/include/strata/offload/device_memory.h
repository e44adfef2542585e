#pragma once
// DeviceMemory: the memory of the `device` tier, its copy streams and events.
//
// With a usable CUDA device it is that GPU's memory (cudaMalloc). Without one,
// the device is emulated by a HostArena of its own that is not pinned: every
// code path of the runtime (budgets, eviction, copies in and out) runs and is
// tested on a CPU-only machine, with memcpy standing in for the DMA engines.
// Both serve payloads from a DeviceArena (Note [The device arena]) and copy
// on two streams ordered by events (Note [Copy streams and events]): CUDA
// streams, or on the emulated device copy-engine worker threads.
// STRATA_DEVICE=emulated forces emulation on a GPU machine; STRATA_DEVICE=cuda:N
// picks a GPU.

#include <cstddef>
#include <memory>
#include <string>

#include "strata/offload/device_arena.h"
#include "strata/offload/device_event.h"

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

  /// Uninitialised device memory from the device arena (Note [The device
  /// arena]). Throws strata::Error when the capacity or the device refuses.
  virtual void* allocate(size_t bytes) = 0;
  /// Gives `ptr` back, reusable once `after` completed (the last work using it).
  virtual void deallocate(void* ptr, const DeviceEvent& after) noexcept = 0;
  void deallocate(void* ptr) noexcept { deallocate(ptr, DeviceEvent()); }
  /// The most the payloads may add up to: the device budget (unlimited until set).
  virtual void set_capacity(uint64_t bytes) = 0;
  /// Gives empty reservations back to the device while more than `keep`
  /// bytes are reserved (Note [The device arena]); never waits.
  virtual void trim(uint64_t keep = 0) = 0;
  virtual DeviceArenaStats arena_stats() const = 0;

  /// Copies on the copy stream of their direction, after `after` (Note [Copy
  /// streams and events]); the returned event completes with the copy. The
  /// host side must stay valid until then.
  virtual DeviceEvent copy_from_host_async(void* device_dst, const void* host_src, size_t bytes,
                                           const DeviceEvent& after = {}) = 0;
  virtual DeviceEvent copy_to_host_async(void* host_dst, const void* device_src, size_t bytes,
                                         const DeviceEvent& after = {}) = 0;
  /// The same, waited for on the calling thread; a failed copy throws.
  void copy_from_host(void* device_dst, const void* host_src, size_t bytes, const DeviceEvent& after = {});
  void copy_to_host(void* host_dst, const void* device_src, size_t bytes, const DeviceEvent& after = {});
  virtual void fill_zero(void* device_ptr, size_t bytes) = 0;
  /// An event on the compute stream now: it completes when the work
  /// operators queued so far has run (at once on the emulated device).
  virtual DeviceEvent compute_event() = 0;
  /// Makes the compute stream's later work wait for `event` (on the emulated
  /// device, the calling thread waits: it is the compute stream).
  virtual void compute_wait(const DeviceEvent& event) = 0;
  /// Whether host code may dereference device pointers (true when emulated).
  virtual bool host_accessible() const noexcept = 0;
};

/// Chooses the device from STRATA_DEVICE, else the first CUDA device, else emulation.
std::unique_ptr<DeviceMemory> make_device_memory();
std::unique_ptr<DeviceMemory> make_emulated_device_memory();
/// Throws strata::Error when CUDA or device `index` is unavailable.
std::unique_ptr<DeviceMemory> make_cuda_device_memory(int index);

}  // namespace strata::offload
