#include "strata/memory/chunk_layout.h"

#include <gtest/gtest.h>

#include "strata/core/error.h"

namespace strata::memory {
namespace {

// Worked by hand in the comments: tensors {6, 5, 4, 3, 10}, 28 elements.
const std::vector<int64_t> kSizes{6, 5, 4, 3, 10};

TEST(ChunkPacking, HandCheckedLayoutAndWaste) {
  // Chunk 10: [6] closes (pad 4); [5,4] closes (pad 1); [3] closes (pad 7); [10].
  const auto chunks = pack_tensors(kSizes, 10);
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].slots.size(), 1u);
  ASSERT_EQ(chunks[1].slots.size(), 2u);
  EXPECT_EQ(chunks[1].slots[1].tensor_index, 2);
  EXPECT_EQ(chunks[1].slots[1].offset, 5);
  EXPECT_EQ(chunks[3].slots[0].tensor_index, 4);
  EXPECT_FALSE(chunks[3].dedicated) << "10 fits a 10-element chunk exactly";
  const ChunkSizePlan plan = summarize_packing(chunks, 10);
  EXPECT_EQ(plan.payload_elems, 28);
  EXPECT_EQ(plan.allocated_elems, 40);
  EXPECT_EQ(plan.waste_elems(), 12);
  EXPECT_DOUBLE_EQ(plan.waste_percent(), 30.0);
}

TEST(ChunkPacking, OversizedTensorGetsADedicatedChunkAndKeepsTheOpenOneOpen) {
  // Chunk 9: [6] closes (pad 3); [5,4]; [3] stays open while 10 goes to its
  // own 10-element chunk; the open chunk ends with pad 6. 37 allocated, 9 waste.
  const auto chunks = pack_tensors(kSizes, 9);
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_TRUE(chunks[3].dedicated);
  EXPECT_EQ(chunks[3].capacity_elems, 10);
  EXPECT_EQ(chunks[2].slots.size(), 1u);
  const ChunkSizePlan plan = summarize_packing(chunks, 9);
  EXPECT_EQ(plan.allocated_elems, 37);
  EXPECT_EQ(plan.waste_elems(), 9);
  EXPECT_EQ(plan.dedicated_chunks, 1);
}

TEST(ChunkSizeSearch, PicksLeastPaddingHandChecked) {
  // Waste by size: 8 -> 6/34, 9 -> 9/37, 10 -> 12/40, 11 -> 5/33, 12 -> 8/36.
  EXPECT_EQ(evaluate_chunk_size(kSizes, 8).waste_elems(), 6);
  EXPECT_EQ(evaluate_chunk_size(kSizes, 11).waste_elems(), 5);
  EXPECT_EQ(evaluate_chunk_size(kSizes, 12).waste_elems(), 8);
  const ChunkSizePlan best = search_chunk_size(kSizes, ChunkSizeSearch{8, 12, 1, 1});
  EXPECT_EQ(best.chunk_elems, 11);
  EXPECT_EQ(best.allocated_elems, 33);
  EXPECT_NEAR(best.waste_percent(), 100.0 * 5 / 33, 1e-9);
}

TEST(ChunkSizeSearch, TiesGoToTheSmallerSize) {
  // Four tensors of 4: sizes 8 and 16 both pack with zero waste.
  const ChunkSizePlan best = search_chunk_size({4, 4, 4, 4}, ChunkSizeSearch{8, 16, 8, 1});
  EXPECT_EQ(best.chunk_elems, 8);
  EXPECT_EQ(best.waste_elems(), 0);
}

TEST(ChunkSizeSearch, RejectsEmptyRanges) {
  EXPECT_THROW(search_chunk_size(kSizes, ChunkSizeSearch{10, 5, 1, 1}), Error);
  EXPECT_THROW(search_chunk_size(kSizes, ChunkSizeSearch{0, 5, 1, 1}), Error);
  EXPECT_THROW(search_chunk_size(kSizes, ChunkSizeSearch{1, 5, 0, 1}), Error);
  EXPECT_THROW(pack_tensors({3, -1}, 10), Error);
}

TEST(Sharding, CapacityIsAMultipleOfTheWorldAndShardsTileTheChunk) {
  const auto chunks = pack_tensors(kSizes, 10, /*world_size=*/4);
  for (const ChunkLayout& c : chunks) {
    EXPECT_EQ(c.capacity_elems % 4, 0);
    EXPECT_EQ(c.shards.shard_elems * 4, c.capacity_elems);
    int64_t covered = 0;
    for (size_t s = 0; s < c.slots.size(); ++s) {
      for (int r = 0; r < 4; ++r) {
        const auto [b, e] = c.slot_in_shard(s, r);
        covered += e - b;
        const auto [sb, se] = c.shards.range(r);
        EXPECT_GE(b, sb);
        EXPECT_LE(e, se);
      }
    }
    int64_t payload = 0;
    for (const auto& s : c.slots) payload += s.numel;
    EXPECT_EQ(covered, payload) << "every element of every tensor is in exactly one shard";
  }
  // Chunk size 10 rounds up to 12 with 4 ranks: [6,5] fits, then [4,3], then [10].
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].capacity_elems, 12);
  const auto [b, e] = chunks[0].slot_in_shard(1, 2);  // tensor of 5 at [6,11), shard 2 = [6,9)
  EXPECT_EQ(b, 6);
  EXPECT_EQ(e, 9);
}

TEST(ChunkPacking, ZeroSizedTensorsTakeNoSpace) {
  const auto chunks = pack_tensors({0, 4, 0}, 4);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].slots.size(), 3u);
  EXPECT_EQ(summarize_packing(chunks, 4).waste_elems(), 0);
}

}  // namespace
}  // namespace strata::memory
