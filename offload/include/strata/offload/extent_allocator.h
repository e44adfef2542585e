#pragma once
// ExtentAllocator: first-fit allocation of aligned extents inside a fixed set
// of preallocated files, with freed extents coalesced with their neighbours
// and reused. The NVMe store keeps every chunk in one extent; there is no
// file per tensor.

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace strata::offload {

struct Extent {
  int file = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class ExtentAllocator {
 public:
  /// `file_bytes[i]` is the size of file i; every size and request is a multiple of `alignment`.
  ExtentAllocator(const std::vector<uint64_t>& file_bytes, uint64_t alignment);

  /// The lowest-addressed free extent that fits, or nullopt when none does
  /// (the space may be free but fragmented).
  std::optional<Extent> allocate(uint64_t bytes);
  /// Returns an extent; throws strata::Error (an internal assertion) on a double free or overlap.
  void free(const Extent& extent);

  uint64_t capacity() const noexcept { return capacity_; }
  uint64_t used() const noexcept { return used_; }
  uint64_t largest_free() const;
  size_t free_extents() const;
  /// File `file`'s free extents, offset -> bytes, neighbours merged.
  const std::map<uint64_t, uint64_t>& free_in(int file) const { return free_.at(static_cast<size_t>(file)); }

 private:
  uint64_t alignment_;
  uint64_t capacity_ = 0;
  uint64_t used_ = 0;
  std::vector<std::map<uint64_t, uint64_t>> free_;  // per file: offset -> bytes
};

}  // namespace strata::offload
