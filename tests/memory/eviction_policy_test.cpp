#include "strata/memory/eviction_policy.h"

#include <gtest/gtest.h>

namespace strata::memory {
namespace {

TEST(LruPolicy, EvictsLeastRecentlyUsedAmongCandidates) {
  LruPolicy lru;
  lru.on_access(1, Tier::kDevice);
  lru.on_access(2, Tier::kDevice);
  lru.on_access(3, Tier::kDevice);
  lru.on_access(1, Tier::kDevice);
  EXPECT_EQ(lru.choose_victim(Tier::kDevice, {1, 2, 3}), 2);
  EXPECT_EQ(lru.choose_victim(Tier::kDevice, {1, 3}), 3);
  // Never-accessed chunks are the oldest; ties go to the lower id.
  EXPECT_EQ(lru.choose_victim(Tier::kDevice, {9, 1, 7}), 7);
}

}  // namespace
}  // namespace strata::memory
