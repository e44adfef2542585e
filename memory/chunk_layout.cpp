#include "strata/memory/chunk_layout.h"

#include <algorithm>

#include "strata/core/bytes.h"
#include "strata/core/error.h"

namespace strata::memory {

std::pair<int64_t, int64_t> ShardLayout::range(int rank) const {
  STRATA_ASSERT(rank >= 0 && rank < world_size, "rank ", rank, " outside world of ", world_size);
  return {rank * shard_elems, (rank + 1) * shard_elems};
}

std::pair<int64_t, int64_t> ChunkLayout::slot_in_shard(size_t slot, int rank) const {
  STRATA_ASSERT(slot < slots.size(), "slot ", slot, " out of ", slots.size());
  const auto [shard_begin, shard_end] = shards.range(rank);
  const int64_t begin = std::max(slots[slot].offset, shard_begin);
  const int64_t end = std::min(slots[slot].offset + slots[slot].numel, shard_end);
  if (begin >= end) return {std::min(begin, shard_end), std::min(begin, shard_end)};
  return {begin, end};
}

double ChunkSizePlan::waste_percent() const {
  return allocated_elems == 0 ? 0.0 : 100.0 * static_cast<double>(waste_elems()) / static_cast<double>(allocated_elems);
}

namespace {
ChunkLayout new_chunk(int64_t capacity, int world_size, bool dedicated) {
  ChunkLayout c;
  c.capacity_elems = capacity;
  c.dedicated = dedicated;
  c.shards = ShardLayout{world_size, capacity / world_size};
  return c;
}
}  // namespace

std::vector<ChunkLayout> pack_tensors(const std::vector<int64_t>& numels, int64_t chunk_elems, int world_size) {
  STRATA_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  STRATA_CHECK(chunk_elems > 0, "chunk size must be positive, got ", chunk_elems, " elements");
  const int64_t capacity = static_cast<int64_t>(round_up(static_cast<uint64_t>(chunk_elems), world_size));
  std::vector<ChunkLayout> chunks;
  int open = -1;  // index of the open chunk in `chunks`
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    STRATA_CHECK(n >= 0, "tensor ", i, " has negative size ", n);
    if (n > capacity) {
      const int64_t own = static_cast<int64_t>(round_up(static_cast<uint64_t>(n), world_size));
      ChunkLayout c = new_chunk(own, world_size, /*dedicated=*/true);
      c.slots.push_back({static_cast<int64_t>(i), 0, n});
      c.used_elems = n;
      chunks.push_back(std::move(c));
      continue;
    }
    if (open < 0 || chunks[open].used_elems + n > capacity) {
      chunks.push_back(new_chunk(capacity, world_size, /*dedicated=*/false));
      open = static_cast<int>(chunks.size()) - 1;
    }
    ChunkLayout& c = chunks[open];
    c.slots.push_back({static_cast<int64_t>(i), c.used_elems, n});
    c.used_elems += n;
  }
  return chunks;
}

ChunkSizePlan summarize_packing(const std::vector<ChunkLayout>& chunks, int64_t chunk_elems) {
  ChunkSizePlan plan;
  plan.chunk_elems = chunk_elems;
  plan.num_chunks = static_cast<int64_t>(chunks.size());
  for (const ChunkLayout& c : chunks) {
    plan.dedicated_chunks += c.dedicated ? 1 : 0;
    plan.allocated_elems += c.capacity_elems;
    for (const TensorSlot& s : c.slots) plan.payload_elems += s.numel;
  }
  return plan;
}

ChunkSizePlan evaluate_chunk_size(const std::vector<int64_t>& numels, int64_t chunk_elems, int world_size) {
  return summarize_packing(pack_tensors(numels, chunk_elems, world_size), chunk_elems);
}

ChunkSizePlan search_chunk_size(const std::vector<int64_t>& numels, const ChunkSizeSearch& search) {
  STRATA_CHECK(search.min_elems > 0 && search.max_elems >= search.min_elems && search.step_elems > 0,
               "chunk size search range [", search.min_elems, ", ", search.max_elems, "] step ",
               search.step_elems, " is empty; need 0 < min <= max and step > 0");
  const int64_t candidates = (search.max_elems - search.min_elems) / search.step_elems + 1;
  STRATA_CHECK(candidates <= 100000, "chunk size search would try ", candidates,
               " sizes; raise the step so that at most 100000 are tried");
  ChunkSizePlan best;
  bool have = false;
  for (int64_t size = search.min_elems; size <= search.max_elems; size += search.step_elems) {
    const ChunkSizePlan plan = evaluate_chunk_size(numels, size, search.world_size);
    if (!have || plan.waste_elems() < best.waste_elems()) {  // same payload: less waste = lower ratio
      best = plan;
      have = true;
    }
  }
  return best;
}

}  // namespace strata::memory
