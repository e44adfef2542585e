// Property test: thousands of random register / access / move / release /
// compute sequences under tight budgets. After every step, no tier is over its
// budget, the manager's accounting equals the sum over resident chunks, and
// every chunk holds the last pattern written into it (or zeros, or nothing).
// Contents are read back after every step for each chunk on device or host
// and each chunk that moved; a chunk that stayed on NVMe is read back every
// kFullCheckEvery steps and after the last (reading all of them every step
// made this the suite's slowest unit test, 20-30 s a seed under ASan), so a
// corruption of one is caught unless the chunk is released or overwritten
// within those steps.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "memory/nvme_fixture.h"
#include "strata/core/error.h"
#include "strata/memory/chunk_manager.h"
#include "strata/offload/device_memory.h"

namespace strata::memory {
namespace {

struct Expected {
  bool has_payload = false;
  uint32_t seed = 0;  // 0: zero-filled
};

std::vector<unsigned char> bytes_for(size_t n, uint32_t seed) {
  std::vector<unsigned char> v(n, 0);
  if (seed == 0) return v;
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

class PropertyTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(PropertyTest, RandomSequencesKeepBudgetsAndContents) {
  const uint32_t seed = GetParam();
  std::mt19937 rng(seed);
  constexpr uint64_t kPage = 4096;
  testing::TestNvme nvme(100 * kPage, "prop");
  ChunkManagerOptions opts;
  opts.budgets = {5 * kPage, 7 * kPage, 100 * kPage};
  opts.device = offload::make_emulated_device_memory();
  opts.nvme = nvme.store;
  opts.world_size = 1 + seed % 3;
  ChunkManager mgr(std::move(opts));

  std::map<ChunkId, Expected> expected;
  std::vector<ChunkId> all;
  uint32_t next_seed = 1;
  int failures = 0;

  auto register_some = [&] {
    FamilySpec spec;
    spec.param_dtype = static_cast<DType>(rng() % 3);
    spec.optim_states = static_cast<int>(rng() % 3);
    spec.separate_grad = rng() % 2;
    std::vector<TensorSpec> tensors;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < n; ++i) tensors.push_back({"p" + std::to_string(all.size()) + "_" + std::to_string(i),
                                                   static_cast<int64_t>(rng() % 1500)});
    const Registration reg = mgr.register_tensors(tensors, spec, 1024);
    for (FamilyId f : reg.families) {
      for (ChunkId id : mgr.family(f).members()) {
        all.push_back(id);
        expected[id] = Expected{};
      }
    }
  };
  for (int i = 0; i < 4; ++i) register_some();

  // Where each chunk was at the last check: one that stays on NVMe is read back only on full checks.
  std::map<ChunkId, std::optional<Tier>> last_seen;
  auto verify = [&](int step, bool full) {
    uint64_t used[kNumTiers] = {0, 0, 0};
    uint64_t kept = 0;
    int64_t count[kNumTiers] = {0, 0, 0};
    for (ChunkId id : all) {
      const Chunk& c = mgr.chunk(id);
      const Expected& e = expected[id];
      ASSERT_EQ(c.location().has_value(), e.has_payload) << "step " << step << " " << c.describe();
      const std::optional<Tier> was = std::exchange(last_seen[id], c.location());
      if (!e.has_payload) continue;
      used[static_cast<int>(*c.location())] += c.alloc_bytes();
      if (c.nvme_copy_kept()) kept += c.alloc_bytes();  // Note [Clean copies on NVMe]
      count[static_cast<int>(*c.location())] += 1;
      if (!full && c.location() == Tier::kNvme && was == Tier::kNvme) continue;
      std::vector<unsigned char> got(c.payload_bytes());
      mgr.read(id, got.data(), got.size());
      ASSERT_EQ(got, bytes_for(c.payload_bytes(), e.seed)) << "step " << step << " contents of " << c.describe();
    }
    for (int t = 0; t < kNumTiers; ++t) {
      const TierStats s = mgr.tier_stats(static_cast<Tier>(t));
      ASSERT_LE(s.used, s.budget) << "step " << step << " tier " << tier_name(static_cast<Tier>(t));
      ASSERT_LE(s.peak, s.budget);
      const bool nvme = static_cast<Tier>(t) == Tier::kNvme;
      ASSERT_EQ(s.used, used[t] + (nvme ? kept : 0)) << "step " << step << " accounting of "
                                                      << tier_name(static_cast<Tier>(t));
      ASSERT_EQ(s.kept, nvme ? kept : 0);
      ASSERT_EQ(s.chunks, count[t]);
    }
  };

  constexpr int kSteps = 2500;
  constexpr int kFullCheckEvery = 16;
  for (int step = 0; step < kSteps; ++step) {
    const ChunkId id = all[rng() % all.size()];
    // The chunk this step touches is read back whatever its tier.
    last_seen[id] = std::nullopt;
    const int op = static_cast<int>(rng() % 100);
    const Chunk& c = mgr.chunk(id);
    try {
      if (op < 35) {
        const Tier t = rng() % 3 == 0 ? Tier::kHost : Tier::kDevice;
        mgr.access(id, t);
        expected[id].has_payload = true;
      } else if (op < 50) {
        mgr.move(id, static_cast<Tier>(rng() % 3));
        expected[id].has_payload = true;
      } else if (op < 65) {
        if (c.location()) {
          const uint32_t s = next_seed++;
          const auto data = bytes_for(c.payload_bytes(), s);
          mgr.write(id, data.data(), data.size());
          expected[id].seed = s;
        }
      } else if (op < 72) {
        mgr.release(id);
        expected[id] = Expected{};
      } else if (op < 92) {
        // Drive one tensor one legal step; entering COMPUTE pins the chunk.
        if (c.num_tensors() > 0) {
          const size_t slot = rng() % c.num_tensors();
          std::vector<TensorState> legal;
          for (int s = 0; s < kNumTensorStates; ++s) {
            if (is_legal_transition(c.state(slot), static_cast<TensorState>(s))) legal.push_back(static_cast<TensorState>(s));
          }
          const TensorState to = legal[rng() % legal.size()];
          const bool addressable = c.location() == Tier::kDevice || c.location() == Tier::kHost;
          if (to != TensorState::kCompute || addressable) mgr.transition(id, slot, to);
        }
      } else if (op < 99) {
        // Unpin everything now and then so the system does not seize up.
        for (ChunkId other : all) {
          const Chunk& oc = mgr.chunk(other);
          for (size_t s = 0; s < oc.num_tensors(); ++s) {
            if (oc.state(s) == TensorState::kCompute) mgr.transition(other, s, TensorState::kHold);
          }
        }
      } else {
        register_some();
      }
    } catch (const Error& e) {
      // Refusals (budget exhausted by pinned chunks, moving a COMPUTE chunk)
      // are allowed; they must leave every invariant intact. A broken
      // invariant inside the manager is never allowed.
      ASSERT_EQ(std::string(e.what()).find("internal assertion"), std::string::npos) << e.what();
      ++failures;
      if (c.location()) expected[id].has_payload = true;
    }
    verify(step, step % kFullCheckEvery == 0 || step == kSteps - 1);
    if (::testing::Test::HasFatalFailure()) return;
  }
  const MoveStats m = mgr.move_stats();
  EXPECT_GT(m.count[int(Tier::kDevice)][int(Tier::kHost)], 40u) << "the sequence must exercise eviction";
  EXPECT_GT(m.count[int(Tier::kHost)][int(Tier::kNvme)], 10u);
  EXPECT_GT(m.count[int(Tier::kNvme)][int(Tier::kHost)] + m.count[int(Tier::kNvme)][int(Tier::kDevice)], 10u);
  EXPECT_GT(m.count[int(Tier::kNvme)][int(Tier::kDevice)], 0u) << "the streamed path must be exercised";
  EXPECT_GT(m.count[int(Tier::kDevice)][int(Tier::kNvme)], 0u);
  EXPECT_GT(m.nvme_kept_by_role[static_cast<size_t>(ChunkRole::kParam)], 0u) << "clean copies must be exercised";
  EXPECT_GT(mgr.tier_stats(Tier::kDevice).evictions, 20u);
  EXPECT_LT(failures, kSteps / 2) << "most operations should succeed";
}

INSTANTIATE_TEST_SUITE_P(Seeds, PropertyTest, ::testing::Values(1u, 2u, 3u, 42u));

}  // namespace
}  // namespace strata::memory
