#include "strata/memory/chunk_manager.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "memory/nvme_fixture.h"
#include "offload/manual_event.h"
#include "strata/core/error.h"
#include "strata/offload/device_memory.h"

namespace strata::memory {
namespace {

using testing::TestNvme;

constexpr int64_t kElems = 1024;  // fp32: exactly one 4 KiB page per chunk
constexpr uint64_t kPage = 4096;

ChunkManagerOptions options(uint64_t device, uint64_t host, uint64_t nvme = 0,
                            std::shared_ptr<SwapStore> store = nullptr) {
  ChunkManagerOptions o;
  o.budgets = {device, host, nvme};
  o.device = offload::make_emulated_device_memory();
  o.nvme = std::move(store);
  return o;
}

// Budgets on a device of the test's own.
ChunkManagerOptions options(uint64_t device, uint64_t host, std::shared_ptr<offload::DeviceMemory> memory) {
  ChunkManagerOptions o = options(device, host);
  o.device = std::move(memory);
  return o;
}

// n single-tensor fp32 families with one chunk each; returns their param chunk ids.
std::vector<ChunkId> add_chunks(ChunkManager& mgr, int n) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < n; ++i) specs.push_back({"t" + std::to_string(i), kElems});
  const Registration reg = mgr.register_tensors(specs, FamilySpec{}, kElems);
  std::vector<ChunkId> ids;
  for (FamilyId f : reg.families) ids.push_back(mgr.family(f).param);
  return ids;
}

std::vector<float> pattern(ChunkId id, float salt = 0) {
  std::vector<float> v(kElems);
  for (int64_t i = 0; i < kElems; ++i) v[i] = static_cast<float>(id * 100000 + i) + salt;
  return v;
}

void fill(ChunkManager& mgr, ChunkId id, Tier tier, float salt = 0) {
  mgr.access(id, tier);
  const auto v = pattern(id, salt);
  mgr.write(id, v.data(), v.size() * sizeof(float));
}

std::vector<float> contents(const ChunkManager& mgr, ChunkId id) {
  std::vector<float> v(kElems);
  mgr.read(id, v.data(), v.size() * sizeof(float));
  return v;
}

// Every tier's peak within its budget, by the manager's own accounting.
void expect_peaks_within_budgets(const ChunkManager& mgr) {
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    EXPECT_LE(mgr.tier_stats(t).peak, mgr.tier_stats(t).budget) << tier_name(t);
  }
}

TEST(ChunkManager, RegistersFamiliesWithSharedLayout) {
  ChunkManager mgr(options(1 << 20, 1 << 20));
  FamilySpec spec;
  spec.param_dtype = DType::kBFloat16;
  spec.optim_states = 2;
  const Registration reg = mgr.register_tensors({{"a", 300}, {"b", 500}, {"c", 900}}, spec, 1000);
  ASSERT_EQ(reg.families.size(), 2u);  // [a, b] then [c]
  EXPECT_EQ(reg.tensors[1].family, reg.families[0]);
  EXPECT_EQ(reg.tensors[1].offset, 300);
  EXPECT_EQ(reg.tensors[2].family, reg.families[1]);
  EXPECT_EQ(reg.plan.waste_elems(), 2000 - 1700);
  const ChunkFamily& fam = mgr.family(reg.families[0]);
  ASSERT_TRUE(fam.master.has_value());
  EXPECT_EQ(mgr.chunk(fam.param).dtype(), DType::kBFloat16);
  EXPECT_EQ(mgr.chunk(*fam.master).dtype(), DType::kFloat32);
  EXPECT_EQ(mgr.chunk(fam.grad).dtype(), DType::kBFloat16);
  ASSERT_EQ(fam.optim_states.size(), 2u);
  EXPECT_EQ(mgr.chunk(fam.optim_states[1]).role(), ChunkRole::kOptimState);
  EXPECT_EQ(mgr.chunk(fam.optim_states[1]).role_index(), 1);
  EXPECT_EQ(fam.members().size(), 5u);
  for (ChunkId id : fam.members()) {
    EXPECT_EQ(&mgr.chunk(id).layout(), fam.layout.get()) << "one layout per family";
    EXPECT_FALSE(mgr.chunk(id).location().has_value());
  }
  EXPECT_EQ(mgr.chunk(fam.param).payload_bytes(), 2000u);
  EXPECT_EQ(mgr.chunk(*fam.master).payload_bytes(), 4000u);
}

TEST(ChunkManager, Fp32FamilyHasNoMasterAndCanReuseTheParamChunkForGrads) {
  ChunkManager mgr(options(1 << 20, 1 << 20));
  FamilySpec spec;
  spec.separate_grad = false;
  spec.optim_states = 1;
  const Registration reg = mgr.register_tensors({{"w", 100}}, spec, 100);
  const ChunkFamily& fam = mgr.family(reg.families[0]);
  EXPECT_FALSE(fam.master.has_value());
  EXPECT_EQ(fam.grad, fam.param);
  EXPECT_EQ(fam.members().size(), 2u);
}

TEST(ChunkManager, ShardedFamiliesHoldOneRanksShard) {
  // ZeRO stage 3 on rank 2 of 4: optimizer state, master, a gradient shard
  // and a parameter shard are a quarter of the chunk; the parameter chunk is
  // gathered; the full gradient chunk stays for backward.
  ChunkManagerOptions o = options(1 << 20, 1 << 20);
  o.world_size = 4;
  ChunkManager mgr(std::move(o));
  FamilySpec spec;
  spec.param_dtype = DType::kBFloat16;
  spec.optim_states = 2;
  spec.shard = ShardSpec{2, true, true, true};
  const Registration reg = mgr.register_tensors({{"a", 300}, {"b", 350}}, spec, 1000);
  ASSERT_EQ(reg.families.size(), 1u);
  const ChunkFamily& fam = mgr.family(reg.families[0]);
  ASSERT_TRUE(fam.grad_shard && fam.param_shard && fam.master);
  EXPECT_EQ(fam.members().size(), 7u);
  EXPECT_EQ(mgr.chunk(fam.param).capacity_elems(), 1000);
  EXPECT_TRUE(mgr.chunk(fam.param).gathered());
  EXPECT_FALSE(mgr.chunk(fam.param).shard());
  EXPECT_EQ(mgr.chunk(fam.grad).capacity_elems(), 1000);
  for (ChunkId id : {*fam.master, fam.optim_states[0], fam.optim_states[1], *fam.grad_shard, *fam.param_shard}) {
    const Chunk& c = mgr.chunk(id);
    EXPECT_TRUE(c.shard()) << c.describe();
    EXPECT_EQ(c.capacity_elems(), 250);
    EXPECT_EQ(c.layout().used_elems, 150) << "rank 2's shard [500, 750) holds elements up to 650";
    EXPECT_EQ(c.num_tensors(), 1u);
  }
  EXPECT_EQ(mgr.chunk(*fam.param_shard).dtype(), DType::kBFloat16);
  EXPECT_EQ(mgr.chunk(*fam.master).dtype(), DType::kFloat32);
  EXPECT_NE(mgr.chunk(*fam.param_shard).describe().find("shard"), std::string::npos);
  // Stage 3 without sharded gradients, and a rank outside the world, are refused.
  spec.shard = ShardSpec{0, true, false, true};
  EXPECT_THROW(mgr.register_tensors({{"c", 10}}, spec, 1000), Error);
  spec.shard = ShardSpec{4, true, false, false};
  EXPECT_THROW(mgr.register_tensors({{"c", 10}}, spec, 1000), Error);
}

TEST(ChunkManager, GatheredChunksAreNeverEvicted) {
  ChunkManagerOptions o = options(2 * kPage, 8 * kPage);
  o.world_size = 2;
  ChunkManager mgr(std::move(o));
  FamilySpec spec;
  spec.shard = ShardSpec{0, true, true, true};
  const Registration reg = mgr.register_tensors({{"a", kElems}, {"b", kElems}, {"c", kElems}}, spec, kElems);
  const ChunkId a = mgr.family(reg.families[0]).param, b = mgr.family(reg.families[1]).param;
  const ChunkId c = mgr.family(reg.families[2]).param;
  mgr.access(a, Tier::kDevice);
  mgr.access(b, Tier::kDevice);
  // The device is full of gathered chunks: a third is refused, naming them, and nothing moved.
  try {
    mgr.access(c, Tier::kDevice);
    FAIL() << "a gathered chunk was evicted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gathered"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(mgr.chunk(a).resident_on(Tier::kDevice));
  EXPECT_TRUE(mgr.chunk(b).resident_on(Tier::kDevice));
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).evictions, 0u);
  mgr.release(a);
  mgr.access(c, Tier::kDevice);
  EXPECT_LE(mgr.tier_stats(Tier::kDevice).peak, 2 * kPage);
}

TEST(ChunkManager, AutoChunkSizeUsesTheSearch) {
  ChunkManager mgr(options(1 << 20, 1 << 20));
  const Registration reg =
      mgr.register_tensors({{"a", 6}, {"b", 5}, {"c", 4}, {"d", 3}, {"e", 10}}, FamilySpec{}, ChunkSizeSearch{8, 12, 1, 1});
  EXPECT_EQ(reg.plan.chunk_elems, 11);
  EXPECT_EQ(reg.families.size(), 3u);
}

TEST(ChunkManager, SearchedChunksAreCappedAtAQuarterOfTheDeviceBudget) {
  // The search asks for 8192..16384 elements; a 64 KiB device budget allows at
  // most 16 KiB = 4096 fp32 elements per chunk, a 1 MiB one does not limit it.
  const ChunkSizeSearch search{8192, 16384, 8192, 1};
  ChunkManager roomy(options(1 << 20, 1 << 20));
  EXPECT_EQ(roomy.register_tensors({{"a", 8192}, {"b", 8192}}, FamilySpec{}, search).plan.chunk_elems, 8192);
  ChunkManager tight(options(64 << 10, 1 << 20));
  const Registration reg = tight.register_tensors({{"a", 8192}, {"b", 8192}}, FamilySpec{}, search);
  EXPECT_EQ(reg.plan.chunk_elems, 4096);
  for (FamilyId f : reg.families) EXPECT_NO_THROW(tight.access(tight.family(f).param, Tier::kDevice));
}

TEST(ChunkManager, EveryBufferIsAligned) {
    TestNvme nvme(64 * kPage);
  ChunkManager mgr(options(8 * kPage, 8 * kPage, 64 * kPage, nvme.store));
  FamilySpec spec;
  spec.param_dtype = DType::kFloat16;
  spec.optim_states = 2;
  // Odd sizes so that payloads are not page multiples.
  const Registration reg = mgr.register_tensors({{"a", 333}, {"b", 777}, {"c", 5}}, spec, 1111);
  for (FamilyId f : reg.families) {
    for (ChunkId id : mgr.family(f).members()) {
      for (Tier t : {Tier::kDevice, Tier::kHost}) {
        void* p = mgr.access(id, t);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kChunkAlignment, 0u) << mgr.chunk(id).describe();
        EXPECT_EQ(mgr.data(id), p);
        EXPECT_EQ(mgr.chunk(id).alloc_bytes() % kChunkAlignment, 0u);
      }
    }
  }
}

TEST(ChunkManager, MaterialisesZeroFilledAndAccountsExactly) {
  ChunkManager mgr(options(4 * kPage, 4 * kPage));
  const auto ids = add_chunks(mgr, 3);
  mgr.access(ids[0], Tier::kDevice);
  mgr.access(ids[1], Tier::kHost);
  EXPECT_EQ(contents(mgr, ids[0]), std::vector<float>(kElems, 0.0f));
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).used, kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).used, kPage);
  mgr.access(ids[1], Tier::kDevice);
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).used, 2 * kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).used, 0u);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).peak, kPage);
  EXPECT_EQ(mgr.move_stats().bytes[int(Tier::kHost)][int(Tier::kDevice)], kPage);
  mgr.release(ids[0]);
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).used, kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).chunks, 1);
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).peak, 2 * kPage);
  EXPECT_FALSE(mgr.chunk(ids[0]).location().has_value());
  EXPECT_THROW(mgr.data(ids[0]), Error);
}

TEST(ChunkManager, EvictsLeastRecentlyUsedToHost) {
  ChunkManager mgr(options(2 * kPage, 8 * kPage));
  const auto ids = add_chunks(mgr, 4);
  fill(mgr, ids[0], Tier::kDevice);
  fill(mgr, ids[1], Tier::kDevice);
  fill(mgr, ids[2], Tier::kDevice);  // evicts 0
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kHost);
  mgr.access(ids[1], Tier::kDevice);  // 1 is now newer than 2
  fill(mgr, ids[3], Tier::kDevice);   // evicts 2
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kHost);
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kDevice);
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).evictions, 2u);
  EXPECT_LE(mgr.tier_stats(Tier::kDevice).peak, 2 * kPage);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(contents(mgr, ids[i]), pattern(ids[i])) << i;
}

TEST(ChunkManager, CascadesDeviceToHostToNvmeAndBack) {
    TestNvme nvme(4 * kPage);
  ChunkManager mgr(options(kPage, 2 * kPage, 4 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 4);
  fill(mgr, ids[0], Tier::kDevice);
  fill(mgr, ids[1], Tier::kDevice);  // 0 -> host
  fill(mgr, ids[2], Tier::kDevice);  // 1 -> host
  fill(mgr, ids[3], Tier::kDevice);  // 2 -> host, which pushes 0 (LRU) -> nvme
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme);
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kHost);
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kHost);
  EXPECT_EQ(mgr.chunk(ids[3]).location(), Tier::kDevice);
  EXPECT_TRUE(nvme.holds(ids[0]));
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0]));
  // nvme -> device streams directly: 3 leaves the device for host, which
  // pushes 1 (least recently used there) to nvme; host is not a staging area.
  mgr.access(ids[0], Tier::kDevice);
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kDevice);
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kNvme);
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kHost);
  EXPECT_EQ(mgr.chunk(ids[3]).location(), Tier::kHost);
  EXPECT_TRUE(nvme.holds(ids[0])) << "a parameter chunk keeps its copy (Note [Clean copies on NVMe])";
  const MoveStats m = mgr.move_stats();
  EXPECT_EQ(m.count[int(Tier::kNvme)][int(Tier::kDevice)], 1u);
  EXPECT_EQ(m.count[int(Tier::kNvme)][int(Tier::kHost)], 0u);
  EXPECT_EQ(m.count[int(Tier::kHost)][int(Tier::kNvme)], 2u);
  EXPECT_EQ(m.count[int(Tier::kDevice)][int(Tier::kHost)], 4u);
  EXPECT_EQ(m.bytes[int(Tier::kNvme)][int(Tier::kDevice)], kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, 2 * kPage) << "1, and the copy 0 keeps";
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).kept, kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).chunks, 1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(contents(mgr, ids[i]), pattern(ids[i])) << i;
  expect_peaks_within_budgets(mgr);
}

// prefetch_up only raises: a chunk on NVMe comes to host (read in the
// background, not on demand), one already on the device or host stays, and
// one without payload is not materialised.
TEST(ChunkManager, PrefetchUpRaisesAChunkAndNeverLowersOne) {
  TestNvme nvme(4 * kPage);
  ChunkManager mgr(options(kPage, 2 * kPage, 4 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 4);
  fill(mgr, ids[0], Tier::kDevice);
  fill(mgr, ids[1], Tier::kHost);
  fill(mgr, ids[2], Tier::kHost);
  mgr.move(ids[2], Tier::kNvme);
  const MoveStats before = mgr.move_stats();
  for (ChunkId id : {ids[0], ids[1], ids[2], ids[3]}) offload::CopyEngine::wait(mgr.prefetch_up(id, Tier::kHost));
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kDevice) << "an operator's chunk stays on the device";
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kHost);
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kHost) << "raised from NVMe";
  EXPECT_FALSE(mgr.chunk(ids[3]).location().has_value()) << "no payload: nothing to raise";
  const MoveStats after = mgr.move_stats();
  const auto param = static_cast<size_t>(ChunkRole::kParam);
  EXPECT_EQ(after.nvme_read_by_role[param] - before.nvme_read_by_role[param], kPage);
  EXPECT_EQ(after.nvme_demand_read_by_role[param], before.nvme_demand_read_by_role[param]) << "read in the background";
  EXPECT_EQ(after.count[int(Tier::kDevice)][int(Tier::kHost)], before.count[int(Tier::kDevice)][int(Tier::kHost)]);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(contents(mgr, ids[i]), pattern(ids[i])) << i;
  EXPECT_THROW(mgr.prefetch_up(ids[1], Tier::kNvme), Error);
}

// Note [Resident memory within the tier]: chunks of many sizes moving
// between host and NVMe in a random order fragment the host arena's first
// fit; the arena gives free pages back rather than hold more resident than
// the host budget, every chunk keeps its contents, and the NVMe traffic by
// role adds up to the traffic by tier.
TEST(ChunkManager, HostArenaHoldsNoMoreThanTheHostBudgetAsChunksOfManySizesMove) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  constexpr uint64_t kHost = 24 * kMiB;
  TestNvme nvme(256 * kMiB);
  ChunkManager mgr(options(kPage, kHost, 256 * kMiB, nvme.store));
  std::vector<ChunkId> ids;
  for (int64_t mib : {1, 2, 3, 5, 7}) {
    std::vector<TensorSpec> specs;
    for (int i = 0; i < 5; ++i) specs.push_back({"m" + std::to_string(mib) + "." + std::to_string(i), mib << 18});
    const Registration reg = mgr.register_tensors(specs, FamilySpec{}, mib << 18);
    for (FamilyId f : reg.families) ids.push_back(mgr.family(f).param);
  }
  const auto expected = [&](ChunkId id) {
    std::vector<float> v(mgr.chunk(id).payload_bytes() / sizeof(float));
    for (size_t i = 0; i < v.size(); i += 997) v[i] = static_cast<float>(id * 1000003 + static_cast<int64_t>(i));
    return v;
  };
  // jemalloc's own mappings (its metadata) count against the limit too, beside live chunks up to the budget.
  const uint64_t own = mgr.host_arena().stats().mapped_bytes;
  std::mt19937 rng(5);
  for (int k = 0; k < 200; ++k) {
    const ChunkId id = ids[rng() % ids.size()];
    const bool first = !mgr.chunk(id).location();
    mgr.access(id, Tier::kHost);
    if (first) {
      const auto v = expected(id);
      mgr.write(id, v.data(), v.size() * sizeof(float));
    }
    ASSERT_LE(mgr.host_arena().stats().mapped_bytes, kHost + own) << "after access " << k;
    ASSERT_LE(mgr.tier_stats(Tier::kHost).peak, kHost);
  }
  EXPECT_GT(mgr.host_arena().stats().released_bytes, 0u) << "the churn should fragment the arena, or it tests nothing";
  for (ChunkId id : ids) {
    if (!mgr.chunk(id).location()) continue;
    std::vector<float> got(mgr.chunk(id).payload_bytes() / sizeof(float));
    mgr.read(id, got.data(), got.size() * sizeof(float));
    EXPECT_EQ(got, expected(id)) << "chunk " << id;
  }
  const MoveStats m = mgr.move_stats();
  const auto nvme_tier = static_cast<size_t>(Tier::kNvme);
  uint64_t read = 0, written = 0;
  for (size_t t = 0; t < kNumTiers; ++t) {
    read += m.bytes[nvme_tier][t];
    written += m.bytes[t][nvme_tier];
  }
  EXPECT_GT(read, 0u);
  EXPECT_EQ(m.nvme_read_by_role[static_cast<size_t>(ChunkRole::kParam)], read);
  EXPECT_EQ(m.nvme_written_by_role[static_cast<size_t>(ChunkRole::kParam)], written);
}

TEST(ChunkManager, NvmeToDeviceNeedsNoRoomOnHost) {
  // A one-chunk host tier, full: nvme -> device streams through the store's
  // staging blocks instead of parking the chunk on host.
  TestNvme nvme(4 * kPage);
  ChunkManager mgr(options(kPage, kPage, 4 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 3);
  fill(mgr, ids[0], Tier::kDevice);
  fill(mgr, ids[1], Tier::kDevice);
  fill(mgr, ids[2], Tier::kDevice);  // 0 -> nvme, 1 on host, 2 on device
  ASSERT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme);
  mgr.access(ids[0], Tier::kDevice);  // 2 -> host pushes 1 -> nvme; 0 streams nvme -> device
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kDevice);
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kNvme);
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kHost);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(contents(mgr, ids[i]), pattern(ids[i])) << i;
  EXPECT_LE(mgr.tier_stats(Tier::kHost).peak, kPage);
}

TEST(ChunkManager, CorruptNvmeChunkNeverReachesTheDevice) {
  TestNvme nvme(8 * kPage);
  ChunkManager mgr(options(2 * kPage, 2 * kPage, 8 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 1);
  fill(mgr, ids[0], Tier::kDevice);
  mgr.move(ids[0], Tier::kNvme);  // streamed device -> nvme
  nvme.faults->corrupt_request(1, 77);
  try {
    mgr.access(ids[0], Tier::kDevice);
    FAIL() << "a flipped byte was not detected";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("checksum mismatch"), std::string::npos) << e.message();
  }
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme) << "the chunk stays where its valid copy is";
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).used, 0u) << "the half-filled device buffer was returned";
  mgr.access(ids[0], Tier::kDevice);
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0]));
}

TEST(ChunkManager, ComputeChunksAreNeverMovedEvictedOrReleased) {
  ChunkManager mgr(options(2 * kPage, 8 * kPage));
  const auto ids = add_chunks(mgr, 3);
  fill(mgr, ids[0], Tier::kDevice);
  fill(mgr, ids[1], Tier::kDevice);
  mgr.transition(ids[0], 0, TensorState::kHold);
  mgr.transition(ids[0], 0, TensorState::kCompute);
  EXPECT_THROW(mgr.move(ids[0], Tier::kHost), Error);
  EXPECT_THROW(mgr.release(ids[0]), Error);
  // 0 is the least recently used, but pinned: 1 must go instead.
  fill(mgr, ids[2], Tier::kDevice);
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kDevice);
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kHost);
  mgr.transition(ids[2], 0, TensorState::kHold);
  mgr.transition(ids[2], 0, TensorState::kCompute);
  // Both device chunks pinned: the request fails and says why.
  try {
    mgr.access(ids[1], Tier::kDevice);
    FAIL() << "device over-committed";
  } catch (const Error& e) {
    const std::string msg = e.message();
    for (const char* part : {"device tier cannot fit 4.00 KiB", "budget 8.00 KiB", "2 chunks", "COMPUTE",
                             "Raise the device budget"}) {
      EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
    }
  }
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kHost) << "a refused access leaves the chunk where it was";
  EXPECT_EQ(contents(mgr, ids[1]), pattern(ids[1]));
  mgr.transition(ids[0], 0, TensorState::kHold);
  EXPECT_NO_THROW(mgr.access(ids[1], Tier::kDevice));
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kHost);
}

TEST(ChunkManager, ChunkLargerThanTheBudgetIsAClearError) {
  ChunkManager mgr(options(kPage, 8 * kPage));
  const Registration reg = mgr.register_tensors({{"huge", 4 * kElems}}, FamilySpec{}, kElems);
  try {
    mgr.access(mgr.family(reg.families[0]).param, Tier::kDevice);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("device budget 4.00 KiB is smaller than chunk 0"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("lower the chunk size"), std::string::npos) << e.message();
  }
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).used, 0u);
}

TEST(ChunkManager, NvmeNeedsAStore) {
  EXPECT_THROW(ChunkManager(options(kPage, kPage, 4 * kPage, nullptr)), Error) << "nvme budget without a store";
  ChunkManager mgr(options(kPage, kPage));
  const auto ids = add_chunks(mgr, 3);
  fill(mgr, ids[0], Tier::kDevice);
  fill(mgr, ids[1], Tier::kDevice);
  try {
    fill(mgr, ids[2], Tier::kDevice);  // would push a host chunk to nvme
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("no NVMe store is configured"), std::string::npos) << e.message();
  }
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0]));
  EXPECT_EQ(contents(mgr, ids[1]), pattern(ids[1]));
}

TEST(ChunkManager, FailedNvmeWriteKeepsTheHostCopy) {
    TestNvme nvme(4 * kPage);
  ChunkManager mgr(options(kPage, kPage, 4 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 3);
  fill(mgr, ids[0], Tier::kDevice);
  fill(mgr, ids[1], Tier::kDevice);  // 0 on host, 1 on device
  nvme.faults->fail_request(1, ENOSPC);
  EXPECT_THROW(fill(mgr, ids[2], Tier::kDevice), Error);  // disk "full" during eviction
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kHost);
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0]));
  EXPECT_EQ(contents(mgr, ids[1]), pattern(ids[1]));
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, 0u);
  EXPECT_EQ(nvme.stored_chunks(), 0u);
  // The next attempt succeeds.
  fill(mgr, ids[2], Tier::kDevice);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(contents(mgr, ids[i]), pattern(ids[i])) << i;
}

TEST(ChunkManager, FailedNvmeReadKeepsTheNvmeCopy) {
    TestNvme nvme(4 * kPage);
  ChunkManager mgr(options(kPage, 2 * kPage, 4 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 2);
  fill(mgr, ids[0], Tier::kHost);
  mgr.move(ids[0], Tier::kNvme);
  nvme.faults->fail_request(1, EIO);
  EXPECT_THROW(mgr.access(ids[0], Tier::kHost), Error);
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).used, 0u) << "the failed destination is returned";
  mgr.access(ids[0], Tier::kHost);
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0]));
}

// overwrite() gives a chunk elsewhere a zero-filled payload where it is
// wanted without reading its old bytes (no NVMe read, its NVMe copy
// dropped), keeps the bytes of one already there, and, when no room can be
// made, fails and leaves the old payload the chunk's.
TEST(ChunkManager, OverwriteTakesNoReadAndKeepsTheOldPayloadWhenItFails) {
  TestNvme nvme(4 * kPage);
  ChunkManager mgr(options(kPage, 2 * kPage, 4 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 3);
  fill(mgr, ids[0], Tier::kHost);
  mgr.move(ids[0], Tier::kNvme);
  fill(mgr, ids[1], Tier::kHost, 1);
  const MoveStats before = mgr.move_stats();
  void* p = mgr.overwrite(ids[0], Tier::kHost);
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kHost);
  EXPECT_EQ(p, mgr.data(ids[0]));
  EXPECT_EQ(contents(mgr, ids[0]), std::vector<float>(kElems, 0.0f)) << "zero-filled, not the old bytes";
  EXPECT_FALSE(nvme.holds(ids[0])) << "the NVMe copy is dropped";
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, 0u);
  const MoveStats after = mgr.move_stats();
  EXPECT_EQ(after.count[int(Tier::kNvme)][int(Tier::kHost)], before.count[int(Tier::kNvme)][int(Tier::kHost)]);
  EXPECT_EQ(after.nvme_read_by_role[size_t(ChunkRole::kParam)], before.nvme_read_by_role[size_t(ChunkRole::kParam)]);
  // Already where it is wanted: the bytes stay.
  mgr.overwrite(ids[1], Tier::kHost);
  EXPECT_EQ(contents(mgr, ids[1]), pattern(ids[1], 1));
  // From the device to host: the device copy goes, nothing is copied.
  fill(mgr, ids[2], Tier::kDevice, 2);
  mgr.transition(ids[1], 0, TensorState::kHold);
  mgr.transition(ids[1], 0, TensorState::kCompute);
  mgr.transition(ids[0], 0, TensorState::kHold);
  mgr.transition(ids[0], 0, TensorState::kCompute);
  // The host tier holds two pinned chunks: no room, the device copy stays.
  EXPECT_THROW(mgr.overwrite(ids[2], Tier::kHost), Error);
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kDevice);
  EXPECT_EQ(contents(mgr, ids[2]), pattern(ids[2], 2));
  mgr.transition(ids[0], 0, TensorState::kHold);
  mgr.overwrite(ids[2], Tier::kHost);
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kHost);
  EXPECT_EQ(mgr.tier_stats(Tier::kDevice).used, 0u);
  EXPECT_EQ(contents(mgr, ids[2]), std::vector<float>(kElems, 0.0f));
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme) << "made room as any access does";
  EXPECT_EQ(contents(mgr, ids[0]), std::vector<float>(kElems, 0.0f));
  EXPECT_EQ(mgr.move_stats().count[int(Tier::kDevice)][int(Tier::kHost)],
            before.count[int(Tier::kDevice)][int(Tier::kHost)]);
  expect_peaks_within_budgets(mgr);
  EXPECT_THROW(mgr.overwrite(ids[2], Tier::kNvme), Error);
}

// Note [Clean copies on NVMe]: a parameter chunk read from NVMe keeps its
// copy there, and going back unchanged writes nothing; changed on host or
// on the device, through its payload as an operator changes it, it is
// written again and reads back changed.
TEST(ChunkManager, AParameterChunkEvictedUnchangedIsNotWrittenAgain) {
  TestNvme nvme(8 * kPage);
  ChunkManager mgr(options(kPage, kPage, 8 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 2);
  const auto param = static_cast<size_t>(ChunkRole::kParam);
  const auto written = [&] { return mgr.move_stats().nvme_written_by_role[param]; };
  const auto kept = [&] { return mgr.move_stats().nvme_kept_by_role[param]; };
  fill(mgr, ids[0], Tier::kHost);
  mgr.move(ids[0], Tier::kNvme);
  ASSERT_EQ(written(), kPage);
  mgr.access(ids[0], Tier::kHost);
  EXPECT_TRUE(nvme.holds(ids[0]));
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).kept, kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).chunks, 0);
  fill(mgr, ids[1], Tier::kHost);  // evicts 0, unchanged
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme);
  EXPECT_EQ(written(), kPage) << "nothing written for an unchanged chunk";
  EXPECT_EQ(kept(), kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).kept, 0u);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, kPage);
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0]));

  // Changed on host by a write through its payload: written again.
  mgr.access(ids[0], Tier::kHost);  // evicts 1, written for the first time
  ASSERT_EQ(written(), 2 * kPage);
  std::vector<float> want = pattern(ids[0]);
  want[kElems - 1] += 1.0f;  // the last element: the store's checksum covers the whole payload
  static_cast<float*>(mgr.data(ids[0]))[kElems - 1] += 1.0f;
  mgr.access(ids[1], Tier::kHost);  // evicts 0, changed
  EXPECT_EQ(written(), 3 * kPage);
  EXPECT_EQ(kept(), kPage);
  EXPECT_EQ(contents(mgr, ids[0]), want);
  mgr.access(ids[0], Tier::kHost);
  EXPECT_EQ(contents(mgr, ids[0]), want);

  // Up to the device and down again through host: unchanged keeps its copy, changed is written.
  mgr.move(ids[0], Tier::kNvme);  // kept, not written
  EXPECT_EQ(written(), 3 * kPage);
  mgr.access(ids[0], Tier::kDevice);  // streamed from NVMe; the copy stays
  mgr.move(ids[0], Tier::kHost);
  mgr.move(ids[0], Tier::kNvme);
  EXPECT_EQ(written(), 3 * kPage);
  EXPECT_EQ(kept(), 4 * kPage) << "0 clean twice, 1 once, and 0 on its way back from the device";
  mgr.access(ids[0], Tier::kDevice);
  const std::vector<float> on_device = pattern(ids[0], 5);
  mgr.write(ids[0], on_device.data(), on_device.size() * sizeof(float));
  mgr.move(ids[0], Tier::kHost);
  mgr.move(ids[0], Tier::kNvme);
  EXPECT_EQ(written(), 4 * kPage);
  EXPECT_EQ(contents(mgr, ids[0]), on_device);
  // Straight from the device to NVMe the payload is not compared: the kept copy goes, the chunk is written.
  mgr.access(ids[0], Tier::kDevice);
  mgr.move(ids[0], Tier::kNvme);
  EXPECT_EQ(written(), 5 * kPage);
  EXPECT_EQ(contents(mgr, ids[0]), on_device);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, 2 * kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).kept, 0u);

  // release() drops a kept copy with the chunk.
  mgr.access(ids[0], Tier::kHost);
  ASSERT_TRUE(nvme.holds(ids[0]));
  mgr.release(ids[0]);
  EXPECT_FALSE(nvme.holds(ids[0]));
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, kPage) << "1 alone";
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).kept, 0u);
  // forget_nvme_copy(): its caller changed the chunk, so the copy goes now.
  mgr.access(ids[1], Tier::kHost);
  ASSERT_TRUE(mgr.chunk(ids[1]).nvme_copy_kept());
  mgr.forget_nvme_copy(ids[1]);
  EXPECT_FALSE(mgr.chunk(ids[1]).nvme_copy_kept());
  EXPECT_FALSE(nvme.holds(ids[1]));
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, 0u);
  mgr.move(ids[1], Tier::kNvme);
  EXPECT_EQ(written(), 6 * kPage) << "written again: no copy to compare with";
  EXPECT_EQ(contents(mgr, ids[1]), pattern(ids[1]));
  expect_peaks_within_budgets(mgr);
}

// The difference of two move_stats() readings is what moved between them, in
// every field, whatever came before the first reading.
TEST(ChunkManager, MoveStatsBetweenTwoReadingsAreTheMovesInBetween) {
  TestNvme nvme(8 * kPage);
  ChunkManager mgr(options(kPage, 2 * kPage, 8 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 3);
  const auto param = static_cast<size_t>(ChunkRole::kParam);
  const auto host = static_cast<size_t>(Tier::kHost), dev = static_cast<size_t>(Tier::kDevice),
             disk = static_cast<size_t>(Tier::kNvme);
  for (const ChunkId id : ids) fill(mgr, id, Tier::kHost);  // the third evicts the first to NVMe
  mgr.move(ids[1], Tier::kNvme);
  const MoveStats before = mgr.move_stats();
  ASSERT_GT(before.nvme_written_by_role[param], 0u) << "the reading must start from moves already made";

  mgr.access(ids[0], Tier::kDevice);  // NVMe -> device on demand
  mgr.move(ids[0], Tier::kHost);      // device -> host, into the room left
  mgr.access(ids[1], Tier::kHost);    // NVMe -> host, evicting one of the two there
  const MoveStats d = mgr.move_stats() - before;

  EXPECT_EQ(d.bytes[disk][dev], kPage);
  EXPECT_EQ(d.count[disk][dev], 1u);
  EXPECT_EQ(d.bytes[dev][host], kPage);
  EXPECT_EQ(d.bytes[disk][host], kPage);
  EXPECT_EQ(d.nvme_read_by_role[param], 2 * kPage);
  EXPECT_EQ(d.nvme_demand_read_by_role[param], 2 * kPage);
  // The one eviction in between: written, or kept clean if it chose chunk 0.
  EXPECT_EQ(d.bytes[host][disk] + d.nvme_kept_by_role[param], kPage);
  EXPECT_EQ(d.nvme_written_by_role[param], d.bytes[host][disk]);
  EXPECT_EQ(d.started_bytes[disk][dev], kPage);
  const MoveStats none = mgr.move_stats() - mgr.move_stats();
  for (size_t from = 0; from < none.bytes.size(); ++from) {
    for (size_t to = 0; to < none.bytes.size(); ++to) EXPECT_EQ(none.bytes[from][to], 0u);
  }
  EXPECT_EQ(none.stalls, 0u);
}

// Kept copies are a cache inside the NVMe budget: a chunk that needs the
// room takes it from them, and a chunk whose copy was dropped is written
// when it goes back.
TEST(ChunkManager, KeptNvmeCopiesGiveWayToChunksThatNeedTheRoom) {
  TestNvme nvme(2 * kPage);
  ChunkManager mgr(options(kPage, 2 * kPage, 2 * kPage, nvme.store));
  const auto ids = add_chunks(mgr, 3);
  const auto param = static_cast<size_t>(ChunkRole::kParam);
  fill(mgr, ids[0], Tier::kHost);
  fill(mgr, ids[1], Tier::kHost);
  fill(mgr, ids[2], Tier::kHost);  // 0 -> nvme
  mgr.access(ids[0], Tier::kHost);  // 1 -> nvme, then 0 comes up keeping its copy: nvme full
  ASSERT_EQ(mgr.tier_stats(Tier::kNvme).used, 2 * kPage);
  ASSERT_EQ(mgr.tier_stats(Tier::kNvme).kept, kPage);
  mgr.access(ids[1], Tier::kHost);  // 2 -> nvme needs the room 0's copy holds
  EXPECT_FALSE(nvme.holds(ids[0]));
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kNvme);
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).used, 2 * kPage) << "2, and the copy 1 keeps";
  EXPECT_EQ(mgr.tier_stats(Tier::kNvme).kept, kPage);
  mgr.access(ids[2], Tier::kHost);  // 0 -> nvme: its copy is gone, so it is written; 1's copy gives way
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme);
  EXPECT_EQ(mgr.move_stats().nvme_written_by_role[param], 4 * kPage) << "0, 1, 2, and 0 again";
  EXPECT_EQ(mgr.move_stats().nvme_kept_by_role[param], 0u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(contents(mgr, ids[i]), pattern(ids[i])) << i;
  EXPECT_LE(mgr.tier_stats(Tier::kNvme).peak, 2 * kPage);
}

TEST(ChunkManager, ReadAndWriteCheckSizes) {
  ChunkManager mgr(options(kPage, kPage));
  const auto ids = add_chunks(mgr, 1);
  std::vector<float> v(kElems);
  EXPECT_THROW(mgr.read(ids[0], v.data(), v.size() * 4), Error) << "no payload yet";
  mgr.access(ids[0], Tier::kHost);
  EXPECT_THROW(mgr.read(ids[0], v.data(), 100), Error);
  EXPECT_THROW(mgr.write(ids[0], v.data(), 100), Error);
  EXPECT_THROW(mgr.access(ids[0], Tier::kNvme), Error);
  EXPECT_THROW(mgr.chunk(99), Error);
}

// The emulated device, every member forwarded: tests override what they change.
class ForwardingDevice : public offload::DeviceMemory {
 public:
  offload::DeviceKind kind() const noexcept override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  size_t alignment() const noexcept override { return inner_->alignment(); }
  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void deallocate(void* ptr, const offload::DeviceEvent& after) noexcept override { inner_->deallocate(ptr, after); }
  void set_capacity(uint64_t bytes) override { inner_->set_capacity(bytes); }
  void trim(uint64_t keep) override { inner_->trim(keep); }
  offload::DeviceArenaStats arena_stats() const override { return inner_->arena_stats(); }
  offload::DeviceEvent copy_from_host_async(void* d, const void* s, size_t n, const offload::DeviceEvent& a) override {
    return inner_->copy_from_host_async(d, s, n, a);
  }
  offload::DeviceEvent copy_to_host_async(void* d, const void* s, size_t n, const offload::DeviceEvent& a) override {
    return inner_->copy_to_host_async(d, s, n, a);
  }
  void fill_zero(void* p, size_t n) override { inner_->fill_zero(p, n); }
  offload::DeviceEvent compute_event() override { return inner_->compute_event(); }
  void compute_wait(const offload::DeviceEvent& e) override { inner_->compute_wait(e); }
  bool host_accessible() const noexcept override { return true; }

 protected:
  std::unique_ptr<offload::DeviceMemory> inner_ = offload::make_emulated_device_memory();
};

// Operators still running when they return, as a GPU's queued kernels are:
// compute_event() gives an event the test completes.
class RunningComputeDevice final : public ForwardingDevice {
 public:
  std::shared_ptr<offload::testing::ManualEvent> running = std::make_shared<offload::testing::ManualEvent>();
  offload::DeviceEvent compute_event() override { return offload::DeviceEvent(running); }
};

// Uploads that land only when the test opens the gate, and a compute stream
// that waits for an event without blocking the thread that asks, as a GPU's
// (cudaStreamWaitEvent): the events it was asked to wait for are recorded.
class GatedUploadDevice final : public ForwardingDevice {
 public:
  std::shared_ptr<offload::testing::ManualEvent> gate = std::make_shared<offload::testing::ManualEvent>();
  offload::DeviceEvent copy_from_host_async(void* d, const void* s, size_t n, const offload::DeviceEvent& a) override {
    EXPECT_FALSE(a.pending() && !a.query()) << "uploads here follow nothing unfinished";
    return inner_->copy_from_host_async(d, s, n, offload::DeviceEvent(gate));
  }
  void compute_wait(const offload::DeviceEvent& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    waits_.push_back(e);
  }
  std::vector<offload::DeviceEvent> waits() const {
    std::lock_guard<std::mutex> lock(mu_);
    return waits_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<offload::DeviceEvent> waits_;
};

// Whether `done` turns true within `limit`.
bool turns_true_within(const std::atomic<bool>& done, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done.load() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done.load();
}

// Note [Arrivals on the device]: bringing a chunk to the device queues the
// copy and makes compute wait for it; the caller goes on, the host source is
// kept (and counted) until the copy read it, and a copy out of the chunk
// waits for the arrival.
TEST(ChunkManager, ComputeWaitsForAChunksArrivalNotTheCaller) {
  auto device = std::make_shared<GatedUploadDevice>();
  ChunkManager mgr(options(kPage, 4 * kPage, device));
  const std::vector<ChunkId> ids = add_chunks(mgr, 2);
  fill(mgr, ids[0], Tier::kHost);
  fill(mgr, ids[1], Tier::kHost);
  std::atomic<bool> accessed{false};
  std::thread caller([&] {
    mgr.access(ids[0], Tier::kDevice);
    accessed = true;
  });
  const bool returned = turns_true_within(accessed, std::chrono::seconds(5));
  EXPECT_TRUE(returned) << "access() waited for the upload on the host";
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kDevice);
  const std::vector<offload::DeviceEvent> waits = device->waits();
  ASSERT_EQ(waits.size(), 1u) << "compute was not told to wait for the arrival";
  EXPECT_FALSE(waits[0].query()) << "the event compute waits for is not the pending upload";
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).used, 2 * kPage) << "the upload's source must stay until it is read";
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).chunks, 1);

  std::atomic<bool> evicted{false};
  std::thread next([&] {
    mgr.access(ids[1], Tier::kDevice);  // evicts ids[0]: one chunk fits
    evicted = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(evicted.load()) << "the eviction copied the chunk off the device before it arrived";
  device->gate->complete();
  caller.join();
  next.join();
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kHost);
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0])) << "the host copy is not what arrived";
  EXPECT_EQ(contents(mgr, ids[1]), pattern(ids[1]));
  mgr.release(ids[0]);  // also gives back the sources whose uploads completed
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).used, 0u);
  EXPECT_LE(mgr.tier_stats(Tier::kHost).peak, 4 * kPage);
}

// A host tier short of room takes back the sources of finished uploads
// before it evicts anything, waiting for them if it must; the budget holds.
TEST(ChunkManager, AHostTierShortOfRoomWaitsForUploadsStillReadingIt) {
  auto device = std::make_shared<GatedUploadDevice>();
  ChunkManager mgr(options(2 * kPage, kPage, device));
  const std::vector<ChunkId> ids = add_chunks(mgr, 2);
  fill(mgr, ids[0], Tier::kHost);
  mgr.access(ids[0], Tier::kDevice);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).used, kPage);
  std::atomic<bool> placed{false};
  std::thread t([&] {
    mgr.access(ids[1], Tier::kHost);
    placed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(placed.load()) << "a chunk took the room of an upload's source still being read";
  device->gate->complete();
  t.join();
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kDevice) << "nothing had to be evicted";
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kHost);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).used, kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).peak, kPage);
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).evictions, 0u);
  EXPECT_EQ(contents(mgr, ids[0]), pattern(ids[0]));
}

// Note [Copy streams and events]: an eviction copies a chunk off the device
// only after the operators that used it ran, and its memory is not handed to
// the next chunk before then.
TEST(ChunkManager, EvictionWaitsForTheLastOperatorThatUsedTheChunk) {
  auto device = std::make_shared<RunningComputeDevice>();
  ChunkManager mgr(options(kPage, 4 * kPage, device));
  const std::vector<ChunkId> ids = add_chunks(mgr, 2);
  fill(mgr, ids[0], Tier::kDevice);
  mgr.transition(ids[0], 0, TensorState::kHold);
  mgr.transition(ids[0], 0, TensorState::kCompute);
  auto* payload = static_cast<float*>(mgr.data(ids[0]));
  mgr.transition(ids[0], 0, TensorState::kHold);  // the operator returned; its kernels are queued
  std::atomic<bool> brought{false};
  std::thread next([&] {
    mgr.access(ids[1], Tier::kDevice);  // evicts ids[0]: one chunk fits
    brought = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(brought.load()) << "the eviction did not wait for the operator's event";
  for (int64_t i = 0; i < kElems; ++i) payload[i] = -1.0f;  // what the queued kernel writes
  device->running->complete();
  next.join();
  EXPECT_TRUE(brought.load());
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kHost);
  EXPECT_EQ(contents(mgr, ids[0]), std::vector<float>(kElems, -1.0f)) << "the host copy misses the kernel's writes";
  EXPECT_LE(mgr.tier_stats(Tier::kDevice).peak, kPage);
  EXPECT_LE(device->arena_stats().live, kPage) << "the arena never held more than the budget";
}

}  // namespace
}  // namespace strata::memory
