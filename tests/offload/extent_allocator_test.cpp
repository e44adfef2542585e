#include "strata/offload/extent_allocator.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "strata/core/error.h"

namespace strata::offload {
namespace {

TEST(ExtentAllocator, FirstFitAcrossFilesAndCoalescing) {
  ExtentAllocator a({4 * 4096, 2 * 4096}, 4096);
  EXPECT_EQ(a.capacity(), 6u * 4096);
  auto x = a.allocate(2 * 4096), y = a.allocate(2 * 4096), z = a.allocate(2 * 4096);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(x->file, 0);
  EXPECT_EQ(y->offset, 2u * 4096);
  EXPECT_EQ(z->file, 1) << "spills into the next file";
  EXPECT_FALSE(a.allocate(4096));
  a.free(*x);
  a.free(*y);
  EXPECT_EQ(a.free_extents(), 1u) << "neighbours coalesce";
  EXPECT_EQ(a.largest_free(), 4u * 4096);
  EXPECT_THROW(a.free(*x), Error) << "double free";
  EXPECT_TRUE(a.allocate(4 * 4096));
}

TEST(ExtentAllocator, RandomChurnNeverOverlaps) {
  ExtentAllocator a({256 * 4096, 128 * 4096}, 4096);
  std::mt19937 rng(3);
  std::vector<Extent> live;
  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || rng() % 2) {
      if (auto e = a.allocate((1 + rng() % 16) * 4096)) live.push_back(*e);
    } else {
      const size_t i = rng() % live.size();
      a.free(live[i]);
      live.erase(live.begin() + i);
    }
    uint64_t used = 0;
    for (size_t i = 0; i < live.size(); ++i) {
      used += live[i].bytes;
      for (size_t j = i + 1; j < live.size(); ++j) {
        if (live[i].file != live[j].file) continue;
        const bool disjoint = live[i].offset + live[i].bytes <= live[j].offset ||
                              live[j].offset + live[j].bytes <= live[i].offset;
        ASSERT_TRUE(disjoint) << "step " << step;
      }
    }
    ASSERT_EQ(a.used(), used);
  }
  for (const Extent& e : live) a.free(e);
  EXPECT_EQ(a.free_extents(), 2u);
  EXPECT_EQ(a.used(), 0u);
}

}  // namespace
}  // namespace strata::offload
