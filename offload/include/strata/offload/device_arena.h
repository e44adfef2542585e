#pragma once
// DeviceArena: the device tier's chunk payloads, carved out of a few large
// reservations of device memory.
//
// Note [The device arena]
// cudaMalloc and cudaFree per chunk move are slow (cudaFree synchronises the
// whole device) and fragment the memory LibTorch's caching allocator wants
// for activations. The arena instead reserves segments of device memory
// (cudaMalloc on a GPU, anonymous mappings on the emulated device) and serves
// each payload as an extent of one, first fit, freed extents coalescing with
// their neighbours: the extent allocator of the NVMe store (ExtentAllocator),
// over memory instead of files.
//  - Capacity: the device budget. The payloads never add up to more, so the
//    budget is enforced here too, whatever the accounting above says: a
//    request that does not fit is a strata::Error naming the sizes.
//  - Segments: min(capacity, 1 GiB) each, or the request if larger: one
//    reservation for a budget up to 1 GiB. trim() gives empty segments back
//    (the engine calls it when activations need the room: the
//    device-capacity rule), and the caching allocator can take the memory.
//  - Fragmentation: when the payloads fit the capacity but no free extent
//    does, the request gets a segment of exactly its size past the
//    capacity, released as soon as it empties. The payloads (stats().live)
//    never exceed the capacity; the reservations may, by that much, and
//    stats() shows it. Training never fails on fragmentation alone.
//  - Deferred frees (Note [Copy streams and events]): deallocate(ptr, after)
//    returns the extent to the free list only once `after` completed (the
//    last compute or copy that uses the memory). allocate() takes back what
//    completed, and waits for the oldest pending free only when nothing
//    else fits.
// Thread-safe.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "strata/offload/device_event.h"
#include "strata/offload/extent_allocator.h"

namespace strata::offload {

struct DeviceArenaStats {
  uint64_t capacity = 0;   // the most the segments may add up to
  uint64_t reserved = 0;   // bytes of segments held now
  uint64_t live = 0;       // bytes of extents allocated and not freed
  uint64_t pending = 0;    // bytes freed, waiting for their event
  uint64_t peak_reserved = 0;
  size_t segments = 0;
  uint64_t largest_free = 0;  // the largest extent allocate() could serve without a new segment
};

class DeviceArena {
 public:
  /// How segments of device memory are obtained and given back.
  struct Backing {
    std::function<void*(size_t bytes)> reserve;  // throws strata::Error when the device refuses
    std::function<void(void* base, size_t bytes)> release;
  };
  static constexpr uint64_t kUnlimited = ~uint64_t{0};
  static constexpr uint64_t kMaxSegment = uint64_t{1} << 30;
  static constexpr uint64_t kUnboundedSegment = uint64_t{64} << 20;  // segments without a capacity

  /// `alignment`: of every payload (and of the segments' sizes); a power of two.
  DeviceArena(Backing backing, size_t alignment, uint64_t capacity = kUnlimited);
  /// Waits for the pending frees, then releases every segment.
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  /// An extent of at least `bytes` (rounded up to the alignment). Throws
  /// strata::Error when the capacity cannot hold it, or it cannot be placed
  /// in the segments the capacity allows (fragmentation).
  void* allocate(size_t bytes);
  /// Gives back `ptr`, reusable once `after` completed. Never throws.
  void deallocate(void* ptr, const DeviceEvent& after = {}) noexcept;
  /// Sets the capacity; lowering it below what is reserved releases empty
  /// segments until it fits, if they allow it. Returns the capacity in effect
  /// (at least the bytes reserved).
  uint64_t set_capacity(uint64_t capacity);
  /// Releases segments with nothing allocated (frees still pending keep
  /// theirs) while more than `keep` bytes are reserved, highest first. Never
  /// waits for the device.
  void trim(uint64_t keep = 0);
  DeviceArenaStats stats() const;
  size_t alignment() const noexcept { return alignment_; }

 private:
  struct Segment {
    uint64_t bytes = 0;
    bool overflow = false;  // past the capacity, for one payload (fragmentation)
    std::unique_ptr<ExtentAllocator> extents;  // one "file": the segment
  };
  struct Live {
    uintptr_t base;  // of its segment
    Extent extent;
  };
  using Lock = std::unique_lock<std::mutex>;

  void* place_locked(uint64_t bytes);
  void* note_live(uintptr_t base, const Extent& e);
  void free_locked(void* ptr);
  bool reap_locked(bool wait_oldest);
  void release_empty_locked(uint64_t until_reserved);
  uint64_t reserved_locked() const;

  Backing backing_;
  size_t alignment_;
  mutable std::mutex mu_;
  uint64_t capacity_;
  uint64_t live_ = 0;
  uint64_t peak_reserved_ = 0;
  std::map<uintptr_t, Segment> segments_;  // by base address
  std::unordered_map<void*, Live> live_extents_;
  EventGated<void*> pending_;  // freed, waiting for their events
};

}  // namespace strata::offload
