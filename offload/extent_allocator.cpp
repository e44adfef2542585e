#include "strata/offload/extent_allocator.h"

#include <algorithm>

#include "strata/core/error.h"

namespace strata::offload {

ExtentAllocator::ExtentAllocator(const std::vector<uint64_t>& file_bytes, uint64_t alignment)
    : alignment_(alignment), free_(file_bytes.size()) {
  STRATA_ASSERT(alignment_ > 0, "zero alignment");
  for (size_t f = 0; f < file_bytes.size(); ++f) {
    STRATA_ASSERT(file_bytes[f] % alignment_ == 0, "file size ", file_bytes[f], " not aligned");
    if (file_bytes[f] > 0) free_[f][0] = file_bytes[f];
    capacity_ += file_bytes[f];
  }
}

std::optional<Extent> ExtentAllocator::allocate(uint64_t bytes) {
  STRATA_ASSERT(bytes > 0 && bytes % alignment_ == 0, "extent request ", bytes, " not a positive multiple of ",
                alignment_);
  for (size_t f = 0; f < free_.size(); ++f) {
    for (auto it = free_[f].begin(); it != free_[f].end(); ++it) {
      if (it->second < bytes) continue;
      Extent e{static_cast<int>(f), it->first, bytes};
      const uint64_t rest = it->second - bytes;
      const uint64_t rest_offset = it->first + bytes;
      free_[f].erase(it);
      if (rest > 0) free_[f][rest_offset] = rest;
      used_ += bytes;
      return e;
    }
  }
  return std::nullopt;
}

void ExtentAllocator::free(const Extent& e) {
  STRATA_ASSERT(e.file >= 0 && static_cast<size_t>(e.file) < free_.size() && e.bytes > 0, "bad extent");
  auto& map = free_[e.file];
  auto next = map.lower_bound(e.offset);
  STRATA_ASSERT(next == map.end() || next->first >= e.offset + e.bytes, "double free or overlap at file ", e.file,
                " offset ", e.offset);
  uint64_t offset = e.offset, bytes = e.bytes;
  if (next != map.begin()) {
    auto prev = std::prev(next);
    STRATA_ASSERT(prev->first + prev->second <= e.offset, "double free or overlap at file ", e.file, " offset ",
                  e.offset);
    if (prev->first + prev->second == e.offset) {
      offset = prev->first;
      bytes += prev->second;
      map.erase(prev);
    }
  }
  if (next != map.end() && next->first == e.offset + e.bytes) {
    bytes += next->second;
    map.erase(next);
  }
  map[offset] = bytes;
  used_ -= e.bytes;
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& map : free_) {
    for (const auto& [off, bytes] : map) best = std::max(best, bytes);
  }
  return best;
}

size_t ExtentAllocator::free_extents() const {
  size_t n = 0;
  for (const auto& map : free_) n += map.size();
  return n;
}

}  // namespace strata::offload
