#include "strata/offload/device_arena.h"

#include <algorithm>
#include <cstdio>

#include "strata/core/bytes.h"
#include "strata/core/error.h"

namespace strata::offload {

DeviceArena::DeviceArena(Backing backing, size_t alignment, uint64_t capacity)
    : backing_(std::move(backing)), alignment_(alignment), capacity_(capacity) {
  STRATA_CHECK(alignment_ > 0 && (alignment_ & (alignment_ - 1)) == 0, "device arena alignment ", alignment_,
               " is not a power of two");
  STRATA_CHECK(backing_.reserve && backing_.release, "the device arena needs a way to reserve and release memory");
}

DeviceArena::~DeviceArena() {
  Lock lock(mu_);
  while (!pending_.empty()) reap_locked(/*wait_oldest=*/true);
  for (auto& [base, seg] : segments_) backing_.release(reinterpret_cast<void*>(base), seg.bytes);
  segments_.clear();
}

void* DeviceArena::allocate(size_t bytes) {
  const uint64_t want = round_up(std::max<uint64_t>(bytes, 1), alignment_);
  Lock lock(mu_);
  reap_locked(false);
  for (;;) {
    // Pending frees count against the capacity until their memory is back.
    if (live_ + want <= capacity_) {
      if (void* p = place_locked(want)) return p;
    }
    // Nothing fits: wait for the oldest free still in flight, then try again.
    if (!reap_locked(/*wait_oldest=*/true)) break;
  }
  STRATA_FAIL("the device arena cannot hold ", format_bytes(want), ": ", format_bytes(live_), " of its ",
              format_bytes(capacity_), " capacity (the device budget) are allocated; raise the device budget or lower "
              "the chunk size");
}

// First fit in the segments, lowest address first; else a new segment if the
// capacity allows. nullptr when neither works.
void* DeviceArena::place_locked(uint64_t want) {
  for (auto& [base, seg] : segments_) {
    if (auto e = seg.extents->allocate(want)) return note_live(base, *e);
  }
  const uint64_t reserved = reserved_locked();
  const bool within = reserved + want <= capacity_;
  if (!within && live_ + want > capacity_) return nullptr;
  // Within the capacity: a segment of up to kMaxSegment. Past it, with the
  // payloads still within it (fragmentation): one of exactly the request,
  // released as soon as it empties (Note [The device arena]).
  uint64_t seg_bytes = want;
  if (within) {
    const uint64_t room = capacity_ == kUnlimited ? kUnboundedSegment : (capacity_ - reserved) / alignment_ * alignment_;
    seg_bytes = std::max(want, std::min(room, kMaxSegment));
  }
  void* base = backing_.reserve(seg_bytes);
  STRATA_ASSERT(reinterpret_cast<uintptr_t>(base) % alignment_ == 0, "device segment at ", base, " is not ",
                alignment_, "-byte aligned");
  Segment seg;
  seg.bytes = seg_bytes;
  seg.overflow = !within;
  seg.extents = std::make_unique<ExtentAllocator>(std::vector<uint64_t>{seg_bytes}, alignment_);
  const auto e = seg.extents->allocate(want);
  STRATA_ASSERT(e.has_value(), "a new device segment cannot hold the request it was made for");
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  segments_.emplace(b, std::move(seg));
  peak_reserved_ = std::max(peak_reserved_, reserved + seg_bytes);
  return note_live(b, *e);
}

void* DeviceArena::note_live(uintptr_t base, const Extent& e) {
  void* p = reinterpret_cast<void*>(base + e.offset);
  live_extents_[p] = Live{base, e};
  live_ += e.bytes;
  return p;
}

void DeviceArena::deallocate(void* ptr, const DeviceEvent& after) noexcept {
  if (ptr == nullptr) return;
  Lock lock(mu_);
  const auto it = live_extents_.find(ptr);
  if (it == live_extents_.end()) {
    std::fprintf(stderr, "[strata error] device arena: %p was not allocated here (double free?)\n", ptr);
    return;
  }
  if (after.query()) {
    free_locked(ptr);
    return;
  }
  pending_.push(ptr, after);
}

void DeviceArena::free_locked(void* ptr) {
  const auto it = live_extents_.find(ptr);
  STRATA_ASSERT(it != live_extents_.end(), "device arena: freeing ", ptr, ", which is not allocated");
  const auto seg = segments_.find(it->second.base);
  seg->second.extents->free(it->second.extent);
  live_ -= it->second.extent.bytes;
  live_extents_.erase(it);
  if (seg->second.overflow && seg->second.extents->used() == 0) {
    backing_.release(reinterpret_cast<void*>(seg->first), seg->second.bytes);
    segments_.erase(seg);
  }
}

// Frees the pending extents whose events completed; with `wait_oldest`, waits
// for the oldest first. Returns whether anything was freed.
bool DeviceArena::reap_locked(bool wait_oldest) {
  if (pending_.empty()) return false;
  if (wait_oldest) {
    try {
      pending_.oldest().synchronize();
    } catch (const std::exception& e) {
      // The work that used the memory failed; it no longer uses it either way.
      std::fprintf(stderr, "[strata warning] device arena: the work before a free failed: %s\n", e.what());
    }
  }
  return pending_.release_completed([&](void* ptr) { free_locked(ptr); });
}

void DeviceArena::release_empty_locked(uint64_t until_reserved) {
  uint64_t reserved = reserved_locked();
  for (auto it = segments_.end(); it != segments_.begin() && reserved > until_reserved;) {  // highest first
    --it;
    if (it->second.extents->used() != 0) continue;
    reserved -= it->second.bytes;
    backing_.release(reinterpret_cast<void*>(it->first), it->second.bytes);
    it = segments_.erase(it);
  }
}

uint64_t DeviceArena::set_capacity(uint64_t capacity) {
  Lock lock(mu_);
  if (capacity < reserved_locked()) {
    while (!pending_.empty()) reap_locked(true);
    release_empty_locked(capacity);
  }
  capacity_ = std::max(capacity, reserved_locked());
  return capacity_;
}

void DeviceArena::trim(uint64_t keep) {
  Lock lock(mu_);
  reap_locked(/*wait_oldest=*/false);  // never waits: the engine trims before operators
  release_empty_locked(keep);
}

uint64_t DeviceArena::reserved_locked() const {
  uint64_t r = 0;
  for (const auto& [base, seg] : segments_) r += seg.bytes;
  return r;
}

DeviceArenaStats DeviceArena::stats() const {
  Lock lock(mu_);
  DeviceArenaStats s;
  s.capacity = capacity_;
  s.reserved = reserved_locked();
  s.live = live_;
  pending_.for_each([&](void* ptr) { s.pending += live_extents_.at(ptr).extent.bytes; });
  s.peak_reserved = peak_reserved_;
  s.segments = segments_.size();
  for (const auto& [base, seg] : segments_) s.largest_free = std::max(s.largest_free, seg.extents->largest_free());
  return s;
}

}  // namespace strata::offload
