#include "strata/memory/eviction_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>

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

// ChunkManager::demote: a demoted chunk leaves before any other, the last
// demoted first, until it is used again.
TEST(LruPolicy, DemotedChunksLeaveFirstTheLastDemotedFirst) {
  LruPolicy lru;
  for (ChunkId c : {1, 2, 3, 4}) lru.on_access(c, Tier::kHost);
  lru.on_demote(3, Tier::kHost, Demotion::kLastFirst);
  lru.on_demote(2, Tier::kHost, Demotion::kLastFirst);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 3, 4, 9}), 2) << "before a never-accessed chunk too";
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 3, 4}), 3);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 4}), 1) << "then least recently used";
  lru.on_access(2, Tier::kHost);  // used again: back in the recency order
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 3, 4}), 3);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 4}), 1);
  StaticPolicy held;
  for (ChunkId c : {1, 2}) held.on_access(c, Tier::kHost);
  held.on_demote(2, Tier::kHost, Demotion::kLastFirst);
  EXPECT_EQ(held.choose_victim(Tier::kHost, {1, 2}), 2) << "the static policy's LRU order takes it too";
}

// Demoted kFirstFirst (the updates in backward, whose next forward needs the
// last updated first): the first demoted leaves first, before any chunk
// demoted kLastFirst or accessed.
TEST(LruPolicy, ChunksDemotedFirstFirstLeaveInTheOrderDemoted) {
  LruPolicy lru;
  for (ChunkId c : {1, 2, 3, 4, 5}) lru.on_access(c, Tier::kHost);
  lru.on_demote(4, Tier::kHost, Demotion::kLastFirst);
  lru.on_demote(3, Tier::kHost, Demotion::kFirstFirst);
  lru.on_demote(2, Tier::kHost, Demotion::kFirstFirst);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 3, 4, 5, 9}), 3);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 4, 5, 9}), 2);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 4, 5, 9}), 4);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 5, 9}), 9) << "then never accessed";
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 5}), 1) << "then least recently used";
}

// Demoted kBeforeAll (an updated family's optimizer state, needed only in
// the next step's update, after every parameter): before any chunk demoted
// otherwise or accessed, the last demoted first, whichever order the others
// were demoted in before or after them.
TEST(LruPolicy, ChunksDemotedBeforeAllLeaveFirstTheLastDemotedFirst) {
  LruPolicy lru;
  for (ChunkId c : {1, 2, 3, 4, 5, 6}) lru.on_access(c, Tier::kHost);
  lru.on_demote(6, Tier::kHost, Demotion::kFirstFirst);
  lru.on_demote(4, Tier::kHost, Demotion::kBeforeAll);
  lru.on_demote(5, Tier::kHost, Demotion::kLastFirst);
  lru.on_demote(3, Tier::kHost, Demotion::kBeforeAll);
  lru.on_demote(2, Tier::kHost, Demotion::kFirstFirst);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 3, 4, 5, 6, 9}), 3) << "the last demoted kBeforeAll";
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 4, 5, 6, 9}), 4);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 5, 6, 9}), 6) << "then the first demoted kFirstFirst";
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 2, 5, 9}), 2);
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 5, 9}), 5) << "then kLastFirst";
  lru.on_access(3, Tier::kHost);  // used again: back in the recency order
  EXPECT_EQ(lru.choose_victim(Tier::kHost, {1, 3}), 1);
}

}  // namespace
}  // namespace strata::memory

namespace strata::memory {
namespace {

// Runs `steps` repetitions of `sequence` (one chunk per operator) through a
// device cache of `capacity` equal-sized chunks, evicting by `policy` with
// the cursor at each operator as the engine sets it; returns the misses.
int misses_under(EvictionPolicy& policy, TracePolicy* planner, const std::vector<ChunkId>& sequence, int steps,
                 size_t capacity) {
  std::vector<ChunkId> cache;
  int misses = 0;
  for (int s = 0; s < steps; ++s) {
    for (size_t k = 0; k < sequence.size(); ++k) {
      const ChunkId c = sequence[k];
      if (planner != nullptr) planner->set_cursor(static_cast<int64_t>(k));
      if (std::find(cache.begin(), cache.end(), c) == cache.end()) {
        misses += 1;
        if (cache.size() == capacity) {
          const ChunkId victim = policy.choose_victim(Tier::kDevice, cache);
          EXPECT_NE(std::find(cache.begin(), cache.end(), victim), cache.end()) << "victim outside the candidates";
          cache.erase(std::find(cache.begin(), cache.end(), victim));
          policy.on_leave(victim, Tier::kDevice);
        }
        cache.push_back(c);
      }
      policy.on_access(c, Tier::kDevice);
    }
  }
  return misses;
}

// The fewest misses any eviction choice achieves (exhaustive search over
// cache contents, chunks 0..7): the reference Belady must reach.
int optimal_misses(const std::vector<ChunkId>& trace, size_t capacity) {
  std::map<uint32_t, int> best = {{0u, 0}};  // cache set (bitmask) -> fewest misses so far
  for (ChunkId c : trace) {
    std::map<uint32_t, int> next;
    const auto keep = [&](uint32_t set, int misses) {
      auto [it, fresh] = next.emplace(set, misses);
      if (!fresh) it->second = std::min(it->second, misses);
    };
    for (const auto& [set, misses] : best) {
      const uint32_t bit = 1u << c;
      if (set & bit) {
        keep(set, misses);
      } else if (static_cast<size_t>(__builtin_popcount(set)) < capacity) {
        keep(set | bit, misses + 1);
      } else {
        for (uint32_t v = 0; v < 8; ++v) {
          if (set & (1u << v)) keep((set & ~(1u << v)) | bit, misses + 1);
        }
      }
    }
    best = std::move(next);
  }
  int fewest = INT32_MAX;
  for (const auto& [set, misses] : best) fewest = std::min(fewest, misses);
  return fewest;
}

TEST(TracePolicy, NextUseCountsAcrossTheStepBoundary) {
  TracePolicy p;
  p.set_plan({{0}, {1, 2}, {0}, {3}});
  EXPECT_EQ(p.plan_size(), 4u);
  EXPECT_EQ(p.plan_op(1), (std::vector<ChunkId>{1, 2}));
  EXPECT_TRUE(p.plan_op(4).empty());
  EXPECT_TRUE(p.plan_op(-1).empty());
  EXPECT_EQ(p.next_use(0, 0), 2);  // operator 2
  EXPECT_EQ(p.next_use(0, 2), 2);  // operator 0 of the next step: 0 + 4 - 2
  EXPECT_EQ(p.next_use(2, 1), 4);  // only operator 1: next step's
  EXPECT_EQ(p.next_use(9, 0), INT64_MAX);  // never used
  p.clear_plan();
  EXPECT_FALSE(p.has_plan());
}

TEST(TracePolicy, EvictsTheFurthestNextUseAndUnusedChunksFirst) {
  TracePolicy p;
  for (ChunkId c : {1, 2, 3, 7}) p.on_access(c, Tier::kDevice);
  p.set_plan({{1}, {2}, {3}, {1}, {2}});
  p.set_cursor(0);
  // Next uses from operator 0: 2 at 1, 3 at 2, 1 at 3; 7 never.
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2, 3, 7}), 7);
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2, 3}), 1);
  p.set_cursor(3);  // from operator 3: 2 next at 4, 1 at the next step's 0, 3 at its 2
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2, 3}), 3);
}

TEST(TracePolicy, FallsBackToLruOutsideAPlannedStepAndOffTheDevice) {
  TracePolicy p;
  p.on_access(1, Tier::kDevice);
  p.on_access(2, Tier::kDevice);
  p.on_access(1, Tier::kDevice);
  // No plan: LRU evicts 2.
  p.set_cursor(0);
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2}), 2);
  p.set_plan({{1}, {2}, {1}});
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2}), 1);  // Belady: 2 is needed first
  EXPECT_EQ(p.choose_victim(Tier::kHost, {1, 2}), 2);    // host tier: LRU
  p.set_cursor(-1);                                       // outside the plan (Engine::run)
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2}), 2);
}

TEST(TracePolicy, MissesAsFewAsTheOptimumAndNeverMoreThanLru) {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    const int chunks = 3 + static_cast<int>(rng() % 5);  // 3..7
    const size_t capacity = 1 + rng() % static_cast<uint32_t>(chunks - 1);
    std::vector<ChunkId> sequence(4 + rng() % 9);
    for (ChunkId& c : sequence) c = static_cast<ChunkId>(rng() % static_cast<uint32_t>(chunks));
    constexpr int kSteps = 3;
    std::vector<ChunkId> trace;
    for (int s = 0; s < kSteps; ++s) trace.insert(trace.end(), sequence.begin(), sequence.end());

    TracePolicy belady;
    std::vector<std::vector<ChunkId>> plan;
    for (ChunkId c : sequence) plan.push_back({c});
    belady.set_plan(plan);
    LruPolicy lru;
    const int planned = misses_under(belady, &belady, sequence, kSteps, capacity);
    const int recent = misses_under(lru, nullptr, sequence, kSteps, capacity);
    const int optimum = optimal_misses(trace, capacity);
    SCOPED_TRACE(::testing::Message() << "round " << round << ", capacity " << capacity);
    EXPECT_EQ(planned, optimum);
    EXPECT_LE(planned, recent);
  }
}

TEST(StaticPolicy, EvictsStreamedChunksBeforeHeldOnesEachLeastRecentlyUsed) {
  StaticPolicy p;
  p.set_held({1, 2});
  for (ChunkId c : {1, 3, 2, 4}) p.on_access(c, Tier::kDevice);
  EXPECT_TRUE(p.held(1));
  EXPECT_FALSE(p.held(3));
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2, 3, 4}), 3);  // streamed, least recent
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2, 4}), 4);
  EXPECT_EQ(p.choose_victim(Tier::kDevice, {1, 2}), 1);  // only held ones left: LRU among them
  EXPECT_EQ(p.choose_victim(Tier::kHost, {1, 2, 3, 4}), 1);  // other tiers: plain LRU
}

TEST(StaticHeldChunks, HoldsThePrefixWithinTheFractionAndTheStreamingRoom) {
  const std::vector<std::pair<ChunkId, uint64_t>> chunks = {{0, 100}, {1, 100}, {2, 100}, {3, 100}, {4, 100}};
  // Half of 500 bytes: the first two chunks (a third would make 300).
  EXPECT_EQ(static_held_chunks(chunks, 0.5, 10'000), (std::unordered_set<ChunkId>{0, 1}));
  EXPECT_TRUE(static_held_chunks(chunks, 0.0, 10'000).empty());
  EXPECT_EQ(static_held_chunks(chunks, 1.0, 10'000).size(), 5u);
  // A 450-byte device keeps room to stream the two largest (200): 250 held, two chunks.
  EXPECT_EQ(static_held_chunks(chunks, 1.0, 450), (std::unordered_set<ChunkId>{0, 1}));
  // Auto (fraction < 0): as many as that room allows.
  EXPECT_EQ(static_held_chunks(chunks, -1.0, 560), (std::unordered_set<ChunkId>{0, 1, 2}));
  // Too small a device to stream two chunks holds nothing.
  EXPECT_TRUE(static_held_chunks(chunks, -1.0, 150).empty());
  // A prefix: a large chunk that does not fit stops it, smaller ones after it stay streamed.
  const std::vector<std::pair<ChunkId, uint64_t>> mixed = {{0, 100}, {1, 400}, {2, 10}, {3, 10}};
  EXPECT_EQ(static_held_chunks(mixed, 0.5, 10'000), (std::unordered_set<ChunkId>{0}));
}

TEST(NvmeOptimFamilies, FractionRoundsAndAutoKeepsHalfTheHostForState) {
  const std::vector<uint64_t> bytes = {100, 100, 100, 100};
  EXPECT_EQ(nvme_optim_families(bytes, 0.0, 0), 0u);
  EXPECT_EQ(nvme_optim_families(bytes, 0.5, 0), 2u);
  EXPECT_EQ(nvme_optim_families(bytes, 0.6, 0), 2u);  // 2.4 rounds to 2
  EXPECT_EQ(nvme_optim_families(bytes, 0.9, 0), 4u);  // 3.6 rounds to 4
  EXPECT_EQ(nvme_optim_families(bytes, 1.0, 1'000'000), 4u);
  // Auto: the families that fit in half the host budget stay, in step order.
  EXPECT_EQ(nvme_optim_families(bytes, -1.0, 1000), 0u);  // 400 <= 500
  EXPECT_EQ(nvme_optim_families(bytes, -1.0, 500), 2u);   // 200 <= 250 < 300
  EXPECT_EQ(nvme_optim_families(bytes, -1.0, 100), 4u);   // not even one fits in 50
  EXPECT_EQ(nvme_optim_families({}, -1.0, 100), 0u);
}

}  // namespace
}  // namespace strata::memory
