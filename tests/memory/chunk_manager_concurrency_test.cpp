// The chunk manager used from several threads at once, with prefetches on the
// copy engine, over the real NVMe store. Each thread owns some chunks (so it
// knows what they must hold) but all of them compete for the same budgets, so
// they evict each other's chunks through all three tiers.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "memory/nvme_fixture.h"
#include "strata/core/error.h"
#include "strata/memory/chunk_manager.h"
#include "strata/offload/device_memory.h"

namespace strata::memory {
namespace {

constexpr int64_t kElems = 4096;  // fp32: 16 KiB chunks
constexpr uint64_t kChunkBytes = kElems * 4;

std::vector<float> pattern(ChunkId id, uint32_t version) {
  std::vector<float> v(kElems);
  for (int64_t i = 0; i < kElems; ++i) v[i] = static_cast<float>(id * 1000003 + version * 7919 + i);
  return v;
}

ChunkManagerOptions tight(testing::TestNvme& nvme) {
  ChunkManagerOptions o;
  o.budgets = {4 * kChunkBytes, 6 * kChunkBytes, 64 * kChunkBytes};
  o.device = offload::make_emulated_device_memory();
  o.nvme = nvme.store;
  return o;
}

std::vector<ChunkId> register_chunks(ChunkManager& mgr, int n, const std::string& prefix) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < n; ++i) specs.push_back({prefix + std::to_string(i), kElems});
  const Registration reg = mgr.register_tensors(specs, FamilySpec{}, kElems);
  std::vector<ChunkId> ids;
  for (FamilyId f : reg.families) ids.push_back(mgr.family(f).param);
  return ids;
}

TEST(ChunkManagerConcurrency, PrefetchOverlapsAndAccessWaitsForIt) {
  testing::TestNvme nvme(64 * kChunkBytes, "prefetch");
  ChunkManager mgr(tight(nvme));
  const auto ids = register_chunks(mgr, 3, "w");
  for (ChunkId id : ids) {
    mgr.access(id, Tier::kHost);
    const auto v = pattern(id, 1);
    mgr.write(id, v.data(), kChunkBytes);
    mgr.move(id, Tier::kNvme);
  }
  std::vector<offload::CopyTicket> tickets;
  for (ChunkId id : ids) tickets.push_back(mgr.prefetch(id, Tier::kDevice));
  for (ChunkId id : ids) {
    void* p = mgr.access(id, Tier::kDevice);  // waits if its prefetch is in flight
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(mgr.chunk(id).location(), Tier::kDevice);
    std::vector<float> got(kElems);
    std::memcpy(got.data(), p, kChunkBytes);  // the emulated device is host-addressable
    EXPECT_EQ(got, pattern(id, 1)) << "never half-moved";
  }
  for (auto& t : tickets) offload::CopyEngine::wait(t);
  const MoveStats m = mgr.move_stats();
  EXPECT_EQ(m.count[int(Tier::kNvme)][int(Tier::kDevice)], 3u) << "streamed nvme -> device, no host stop";
}

// The real NVMe store, with every streamed read (and, when asked, every
// write) held back for 200 ms, so that an access right after a prefetch
// deterministically finds the move in flight.
struct SlowStore final : SwapStore {
  std::shared_ptr<SwapStore> inner;
  std::atomic<int> reads{0};
  std::atomic<int> writes{0};
  bool slow_writes = false;  // host -> nvme writes held back too
  explicit SlowStore(std::shared_ptr<SwapStore> s) : inner(std::move(s)) {}
  void write(int64_t key, const void* src, size_t bytes) override {
    ++writes;
    if (slow_writes) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    inner->write(key, src, bytes);
  }
  void read(int64_t key, void* dst, size_t bytes) override { inner->read(key, dst, bytes); }
  void discard(int64_t key) noexcept override { inner->discard(key); }
  size_t alignment() const noexcept override { return inner->alignment(); }
  std::string describe() const override { return "slow " + inner->describe(); }
  void read_streamed(int64_t key, size_t bytes,
                     const std::function<void(size_t, const void*, size_t)>& sink) override {
    ++reads;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    inner->read_streamed(key, bytes, sink);
  }
  void write_streamed(int64_t key, size_t bytes, const std::function<void(size_t, void*, size_t)>& source) override {
    inner->write_streamed(key, bytes, source);
  }
};

// Gives chunk `id` the payload pattern(id, seed) and moves it to nvme.
void put_on_nvme(ChunkManager& mgr, ChunkId id, int seed) {
  mgr.access(id, Tier::kHost);
  mgr.write(id, pattern(id, seed).data(), kChunkBytes);
  mgr.move(id, Tier::kNvme);
}

// Starts a prefetch of `id` to the device and returns once its slow read has
// begun: from then on the chunk is busy, its destination reserved.
offload::CopyTicket prefetch_started(ChunkManager& mgr, SlowStore& slow, ChunkId id) {
  auto ticket = mgr.prefetch(id, Tier::kDevice);
  while (slow.reads == 0) std::this_thread::yield();
  return ticket;
}

TEST(ChunkManagerConcurrency, AccessDuringAPrefetchStallsAndIsCounted) {
  testing::TestNvme nvme(64 * kChunkBytes, "stall");
  auto slow = std::make_shared<SlowStore>(nvme.store);
  ChunkManagerOptions o = tight(nvme);
  o.nvme = slow;
  ChunkManager mgr(std::move(o));
  const auto ids = register_chunks(mgr, 1, "w");
  put_on_nvme(mgr, ids[0], 3);
  EXPECT_EQ(mgr.move_stats().stalls, 0u);
  auto ticket = prefetch_started(mgr, *slow, ids[0]);
  mgr.access(ids[0], Tier::kDevice);  // must wait for the prefetch, not start a second move
  offload::CopyEngine::wait(ticket);
  const MoveStats m = mgr.move_stats();
  EXPECT_EQ(m.stalls, 1u);
  EXPECT_GT(m.stall_seconds, 0.05);
  EXPECT_EQ(m.count[int(Tier::kNvme)][int(Tier::kDevice)], 1u) << "one move, not two";
  EXPECT_EQ(slow->reads, 1);
  std::vector<float> got(kElems);
  mgr.read(ids[0], got.data(), kChunkBytes);
  EXPECT_EQ(got, pattern(ids[0], 3));
}

// A full tier whose only chunk is still arriving is not "nothing evictable":
// the request waits for the arrival, then evicts it.
TEST(ChunkManagerConcurrency, RequestWaitsForAMoveArrivingOnAFullTier) {
  testing::TestNvme nvme(64 * kChunkBytes, "arrive");
  auto slow = std::make_shared<SlowStore>(nvme.store);
  ChunkManagerOptions o = tight(nvme);
  o.budgets.device = kChunkBytes;
  o.nvme = slow;
  ChunkManager mgr(std::move(o));
  const auto ids = register_chunks(mgr, 2, "w");
  put_on_nvme(mgr, ids[0], 5);
  auto ticket = prefetch_started(mgr, *slow, ids[0]);  // chunk 0 holds the whole device tier, in flight
  mgr.access(ids[1], Tier::kDevice);                    // waits for it to land, then evicts it
  offload::CopyEngine::wait(ticket);
  EXPECT_TRUE(mgr.chunk(ids[1]).resident_on(Tier::kDevice));
  EXPECT_TRUE(mgr.chunk(ids[0]).resident_on(Tier::kHost));
  EXPECT_LE(mgr.tier_stats(Tier::kDevice).peak, kChunkBytes);
  std::vector<float> got(kElems);
  mgr.read(ids[0], got.data(), kChunkBytes);
  EXPECT_EQ(got, pattern(ids[0], 5));
}

// Note [Waiting for moves leaving the tier]: a full host tier whose chunk
// is already being written out makes a request wait for that write, and
// evicts nothing else.
TEST(ChunkManagerConcurrency, RequestWaitsForAMoveLeavingTheTierInsteadOfEvicting) {
  testing::TestNvme nvme(64 * kChunkBytes, "leave");
  auto slow = std::make_shared<SlowStore>(nvme.store);
  slow->slow_writes = true;
  ChunkManagerOptions o = tight(nvme);
  o.budgets.host = 2 * kChunkBytes;
  o.nvme = slow;
  ChunkManager mgr(std::move(o));
  const auto ids = register_chunks(mgr, 3, "w");
  for (int i = 0; i < 2; ++i) {
    mgr.access(ids[i], Tier::kHost);
    mgr.write(ids[i], pattern(ids[i], 7).data(), kChunkBytes);
  }
  auto ticket = mgr.prefetch(ids[0], Tier::kNvme);
  while (slow->writes == 0) std::this_thread::yield();  // chunk 0 is leaving the full host tier
  mgr.access(ids[2], Tier::kHost);  // fits once chunk 0 is out: waits, evicts nothing
  offload::CopyEngine::wait(ticket);
  EXPECT_EQ(mgr.chunk(ids[0]).location(), Tier::kNvme);
  EXPECT_EQ(mgr.chunk(ids[1]).location(), Tier::kHost) << "not evicted while a move was freeing the room";
  EXPECT_EQ(mgr.chunk(ids[2]).location(), Tier::kHost);
  EXPECT_EQ(slow->writes, 1) << "one write: the move already leaving";
  EXPECT_EQ(mgr.tier_stats(Tier::kHost).evictions, 0u);
  EXPECT_LE(mgr.tier_stats(Tier::kHost).peak, 2 * kChunkBytes);
  for (int i = 0; i < 2; ++i) {
    std::vector<float> got(kElems);
    mgr.read(ids[i], got.data(), kChunkBytes);
    EXPECT_EQ(got, pattern(ids[i], 7)) << i;
  }
}

TEST(ChunkManagerConcurrency, PrefetchErrorsReachTheTicket) {
  ChunkManagerOptions o;
  o.budgets = {kChunkBytes, kChunkBytes, 0};
  o.device = offload::make_emulated_device_memory();
  ChunkManager mgr(std::move(o));
  const Registration reg = mgr.register_tensors({{"big", 4 * kElems}}, FamilySpec{}, kElems);
  auto t = mgr.prefetch(mgr.family(reg.families[0]).param, Tier::kDevice);
  EXPECT_THROW(offload::CopyEngine::wait(t), Error) << "a chunk larger than the device budget";
  EXPECT_THROW(mgr.prefetch(999, Tier::kHost), Error) << "unknown chunks are refused at once";
}

TEST(ChunkManagerConcurrency, TwoThreadsRoundTripThroughAllTiers) {
  testing::TestNvme nvme(64 * kChunkBytes, "threads");
  ChunkManager mgr(tight(nvme));
  constexpr int kThreads = 2, kPerThread = 8, kSteps = 1500;
  std::vector<std::vector<ChunkId>> owned;
  for (int t = 0; t < kThreads; ++t) owned.push_back(register_chunks(mgr, kPerThread, "t" + std::to_string(t) + "_"));
  std::atomic<int> failures{0};
  std::atomic<int> refusals{0};

  auto worker = [&](int t) {
    std::mt19937 rng(1000 + t);
    std::vector<uint32_t> version(kPerThread, 0);  // 0: no payload yet
    std::vector<float> buf(kElems);
    auto check_all = [&](int step) {
      for (int k = 0; k < kPerThread; ++k) {
        if (version[k] == 0) continue;
        mgr.read(owned[t][k], buf.data(), kChunkBytes);
        if (buf != pattern(owned[t][k], version[k])) {
          ADD_FAILURE() << "thread " << t << " step " << step << ": chunk " << owned[t][k] << " lost its contents";
          ++failures;
        }
      }
      for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
        const TierStats s = mgr.tier_stats(tier);
        if (s.used > s.budget || s.peak > s.budget) {
          ADD_FAILURE() << tier_name(tier) << " over budget";
          ++failures;
        }
      }
    };
    for (int step = 0; step < kSteps && failures == 0; ++step) {
      const int k = static_cast<int>(rng() % kPerThread);
      const ChunkId id = owned[t][k];
      const int op = static_cast<int>(rng() % 10);
      try {
        if (op < 3) {
          mgr.access(id, rng() % 2 ? Tier::kDevice : Tier::kHost);
          if (version[k] == 0) version[k] = 1, mgr.write(id, pattern(id, 1).data(), kChunkBytes);
        } else if (op < 5) {
          if (version[k] != 0) mgr.move(id, static_cast<Tier>(rng() % 3));
        } else if (op < 6) {
          if (version[k] != 0) offload::CopyEngine::wait(mgr.prefetch(id, Tier::kDevice));
        } else if (op < 8) {
          if (version[k] != 0) {
            ++version[k];
            mgr.write(id, pattern(id, version[k]).data(), kChunkBytes);
          }
        } else if (op < 9) {
          // Compute on the device copy: pinned, it stays put while the other thread evicts.
          if (version[k] != 0) {
            mgr.access(id, Tier::kDevice);
            mgr.transition(id, 0, TensorState::kHold);
            mgr.transition(id, 0, TensorState::kCompute);
            const float* p = static_cast<const float*>(mgr.data(id));
            const auto want = pattern(id, version[k]);
            if (std::memcmp(p, want.data(), kChunkBytes) != 0) {
              ADD_FAILURE() << "pinned chunk " << id << " changed under compute";
              ++failures;
            }
            mgr.transition(id, 0, TensorState::kHold);
            mgr.transition(id, 0, TensorState::kFree);
          }
        } else {
          mgr.release(id);
          version[k] = 0;
        }
      } catch (const Error& e) {
        // Both threads may pin or move the last evictable chunks at once; a
        // refusal must say so and change nothing.
        if (std::string(e.what()).find("internal assertion") != std::string::npos) {
          ADD_FAILURE() << e.what();
          ++failures;
        }
        ++refusals;
      }
      check_all(step);
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  EXPECT_EQ(failures, 0);
  const MoveStats m = mgr.move_stats();
  EXPECT_GT(m.count[int(Tier::kDevice)][int(Tier::kHost)], 50u);
  EXPECT_GT(m.count[int(Tier::kHost)][int(Tier::kNvme)], 20u);
  EXPECT_GT(m.count[int(Tier::kNvme)][int(Tier::kHost)], 20u);
  EXPECT_LT(refusals, kSteps / 4);
}

}  // namespace
}  // namespace strata::memory
