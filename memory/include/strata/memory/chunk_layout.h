#pragma once
// How tensors are laid out in chunks, and how the chunk size is chosen.
//
// Note [Chunk packing]
// Tensors are packed in registration order: a tensor goes at the end of the
// open chunk if it fits, otherwise the open chunk is closed (its tail is
// padding) and a new one is opened. A tensor larger than the chunk size gets a
// dedicated chunk of exactly its size (rounded to the shard multiple) and does
// not close the open chunk. Every chunk of a packing has the chunk size as its
// capacity, the last one included: equal-sized chunks are interchangeable
// buffers for eviction and pooling, so the open chunk's tail counts as waste.
// The capacity is a multiple of the world size so that each of N ranks owns
// an equal contiguous shard (ZeRO), see ShardLayout.
//
// Note [Chunk size search]
// Like Colossal-AI's search_chunk_configuration: every candidate size in
// [min, max] by step is packed, and the one with the least padding wins; ties
// go to the smaller size, which moves at a finer grain.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace strata::memory {

/// The shard each rank owns of a chunk: elements [rank * shard_elems, (rank + 1) * shard_elems).
struct ShardLayout {
  int world_size = 1;
  int64_t shard_elems = 0;

  std::pair<int64_t, int64_t> range(int rank) const;
};

/// One tensor's place in a chunk, in elements.
struct TensorSlot {
  int64_t tensor_index = 0;  // position in the registered list
  int64_t offset = 0;
  int64_t numel = 0;
};

struct ChunkLayout {
  int64_t capacity_elems = 0;
  int64_t used_elems = 0;  // end of the last slot
  bool dedicated = false;  // holds one tensor larger than the chunk size
  std::vector<TensorSlot> slots;
  ShardLayout shards;

  /// The part of slot `slot` that lies in `rank`'s shard, as [begin, end)
  /// element offsets within the chunk; begin == end when they do not overlap.
  std::pair<int64_t, int64_t> slot_in_shard(size_t slot, int rank) const;
};

struct ChunkSizePlan {
  int64_t chunk_elems = 0;
  int64_t num_chunks = 0;
  int64_t dedicated_chunks = 0;
  int64_t payload_elems = 0;    // sum of tensor sizes
  int64_t allocated_elems = 0;  // sum of chunk capacities

  int64_t waste_elems() const { return allocated_elems - payload_elems; }
  double waste_percent() const;
};

/// Packs `numels` (registration order) into chunks of `chunk_elems` elements,
/// see Note [Chunk packing]. Throws strata::Error on a negative size or a
/// non-positive chunk size or world size.
std::vector<ChunkLayout> pack_tensors(const std::vector<int64_t>& numels, int64_t chunk_elems, int world_size = 1);

ChunkSizePlan summarize_packing(const std::vector<ChunkLayout>& chunks, int64_t chunk_elems);

ChunkSizePlan evaluate_chunk_size(const std::vector<int64_t>& numels, int64_t chunk_elems, int world_size = 1);

struct ChunkSizeSearch {
  int64_t min_elems = 1 << 20;
  int64_t max_elems = 64 << 20;
  int64_t step_elems = 1 << 20;
  int world_size = 1;
};

/// The candidate chunk size with the least padding, see Note [Chunk size search].
ChunkSizePlan search_chunk_size(const std::vector<int64_t>& numels, const ChunkSizeSearch& search);

}  // namespace strata::memory
