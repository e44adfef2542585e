// The device arena (Note [The device arena]) and the copy streams and events
// of the emulated device (Note [Copy streams and events]): the same ordering
// rules CUDA streams follow, run by the copy engine's worker threads.
#include "strata/offload/device_arena.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "error_of.h"
#include "offload/manual_event.h"
#include "strata/core/error.h"
#include "strata/offload/device_memory.h"

namespace strata::offload {
namespace {

constexpr size_t kAlign = 4096;
constexpr uint64_t kMiB = 1 << 20;

// Segments from anonymous mappings, counted.
struct CountingBacking {
  std::atomic<int> reserved{0}, released{0};
  std::atomic<uint64_t> bytes_now{0};
  DeviceArena::Backing backing() {
    return {[this](size_t bytes) {
              void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
              if (p == MAP_FAILED) throw std::runtime_error("mmap");
              ++reserved;
              bytes_now += bytes;
              return p;
            },
            [this](void* p, size_t bytes) {
              ::munmap(p, bytes);
              ++released;
              bytes_now -= bytes;
            }};
  }
};

using testing::ManualEvent;

TEST(DeviceArena, OneReservationServesPayloadsAndFreedNeighboursCoalesce) {
  CountingBacking b;
  DeviceArena arena(b.backing(), kAlign, 8 * kMiB);
  std::vector<void*> p;
  for (int i = 0; i < 4; ++i) p.push_back(arena.allocate(2 * kMiB - 100));  // rounded up to 2 MiB
  EXPECT_EQ(b.reserved.load(), 1) << "a budget under 1 GiB is one reservation";
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p[i]) % kAlign, 0u);
    std::memset(p[i], i, 2 * kMiB);  // the memory is there
  }
  EXPECT_EQ(arena.stats().live, 8 * kMiB);
  EXPECT_NE(error_of([&] { arena.allocate(4096); }).find("raise the device budget"), std::string::npos)
      << "the capacity is the budget: a hard limit";
  arena.deallocate(p[1]);
  arena.deallocate(p[2]);
  void* big = arena.allocate(4 * kMiB);  // only fits if the two freed neighbours coalesced
  EXPECT_EQ(big, p[1]);
  EXPECT_EQ(b.reserved.load(), 1);
  arena.deallocate(big);
  arena.deallocate(p[0]);
  arena.deallocate(p[3]);
  EXPECT_EQ(arena.stats().live, 0u);
  arena.trim();
  EXPECT_EQ(b.released.load(), 1) << "trim gives the empty reservation back";
  EXPECT_EQ(b.bytes_now.load(), 0u);
}

TEST(DeviceArena, FreedMemoryIsReusedOnlyAfterItsLastUse) {
  CountingBacking b;
  DeviceArena arena(b.backing(), kAlign, 4 * kMiB);
  void* a = arena.allocate(2 * kMiB);
  void* c = arena.allocate(2 * kMiB);
  auto in_use = std::make_shared<ManualEvent>();
  arena.deallocate(a, DeviceEvent(in_use));  // compute may still read it
  EXPECT_EQ(arena.stats().pending, 2 * kMiB);
  // The arena is full until the event completes: allocate waits for it.
  std::atomic<bool> got{false};
  void* again = nullptr;
  std::thread t([&] {
    again = arena.allocate(2 * kMiB);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(got.load()) << "memory was handed out while its last user may still run";
  in_use->complete();
  t.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(again, a);
  EXPECT_EQ(arena.stats().pending, 0u);
  arena.deallocate(again);
  arena.deallocate(c);
}

TEST(DeviceArena, CompletedFreesAreTakenBackWithoutWaiting) {
  CountingBacking b;
  DeviceArena arena(b.backing(), kAlign, 4 * kMiB);
  void* a = arena.allocate(2 * kMiB);
  auto done = std::make_shared<ManualEvent>();
  arena.deallocate(a, DeviceEvent(done));
  done->complete();
  EXPECT_EQ(arena.allocate(4 * kMiB), a) << "the completed free coalesced with the free rest";
}

TEST(DeviceArena, FragmentationGetsAnOverflowSegmentNeverMorePayloadThanTheCapacity) {
  CountingBacking b;
  DeviceArena arena(b.backing(), kAlign, 6 * kMiB);
  void* x = arena.allocate(2 * kMiB);
  void* y = arena.allocate(2 * kMiB);
  void* z = arena.allocate(2 * kMiB);
  arena.deallocate(x);
  arena.deallocate(z);
  // 4 MiB free, in two 2 MiB holes: a 4 MiB payload fits the capacity but no hole.
  void* w = arena.allocate(4 * kMiB);
  DeviceArenaStats s = arena.stats();
  EXPECT_EQ(s.live, 6 * kMiB);
  EXPECT_EQ(s.segments, 2u);
  EXPECT_EQ(s.reserved, 10 * kMiB) << "the overflow segment is exactly the request";
  EXPECT_NE(error_of([&] { arena.allocate(4096); }), "no error") << "payloads stay within the capacity";
  arena.deallocate(w);
  EXPECT_EQ(arena.stats().segments, 1u) << "an overflow segment goes as soon as it empties";
  EXPECT_EQ(b.bytes_now.load(), 6 * kMiB);
  arena.deallocate(y);
}

TEST(DeviceArena, LargeBudgetsReserveInSegmentsThatTrimGivesBack) {
  CountingBacking b;
  DeviceArena arena(b.backing(), kAlign, 3 * DeviceArena::kMaxSegment);
  std::vector<void*> p;
  for (int i = 0; i < 3; ++i) p.push_back(arena.allocate(DeviceArena::kMaxSegment / 2 + kAlign));
  EXPECT_EQ(b.reserved.load(), 3) << "half-segment payloads plus a page: one per segment";
  arena.deallocate(p[2]);
  arena.deallocate(p[1]);
  arena.trim();
  EXPECT_EQ(b.released.load(), 2);
  EXPECT_EQ(arena.stats().reserved, DeviceArena::kMaxSegment);
  EXPECT_EQ(arena.set_capacity(kMiB), DeviceArena::kMaxSegment) << "not below what is held";
  arena.deallocate(p[0]);
  EXPECT_EQ(arena.set_capacity(kMiB), kMiB);
  EXPECT_EQ(b.bytes_now.load(), 0u);
}

TEST(DeviceArena, FreeingUnknownMemoryIsReportedNotCorrupting) {
  CountingBacking b;
  DeviceArena arena(b.backing(), kAlign, 4 * kMiB);
  void* a = arena.allocate(kMiB);
  int local = 0;
  arena.deallocate(&local);  // logged, ignored
  arena.deallocate(a);
  arena.deallocate(a);  // a double free: logged, ignored
  EXPECT_EQ(arena.stats().live, 0u);
  // The free lists are intact: the capacity is handed out again, once, in
  // extents that do not overlap, from the one segment.
  auto* x = static_cast<char*>(arena.allocate(2 * kMiB));
  auto* y = static_cast<char*>(arena.allocate(2 * kMiB));
  EXPECT_TRUE(x + 2 * kMiB <= y || y + 2 * kMiB <= x) << "two live extents overlap";
  EXPECT_EQ(arena.stats().segments, 1u);
  EXPECT_EQ(arena.stats().live, 4 * kMiB);
  EXPECT_NE(error_of([&] { arena.allocate(kAlign); }), "no error") << "the capacity was handed out twice";
  arena.deallocate(x);
  arena.deallocate(y);
}

// --- the emulated device's streams and events ---------------------------------

TEST(EmulatedStreams, ACopyWaitsForTheEventItFollows) {
  auto dev = make_emulated_device_memory();
  std::vector<float> host(1 << 16, 1.0f), back(host.size(), 0.0f);
  const size_t bytes = host.size() * sizeof(float);
  void* d = dev->allocate(bytes);
  dev->copy_from_host(d, host.data(), bytes);
  auto compute = std::make_shared<ManualEvent>();  // an operator still writing the payload
  const DeviceEvent copied = dev->copy_to_host_async(back.data(), d, bytes, DeviceEvent(compute));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(copied.query()) << "the download ran before the compute it follows";
  std::fill(static_cast<float*>(d), static_cast<float*>(d) + host.size(), 7.0f);  // what the operator wrote
  compute->complete();
  copied.synchronize();
  EXPECT_EQ(back[0], 7.0f);
  EXPECT_EQ(back.back(), 7.0f);
  dev->deallocate(d);
}

TEST(EmulatedStreams, OneStreamRunsInOrderAndAnotherFollowsItsEvents) {
  auto dev = make_emulated_device_memory();
  constexpr size_t n = 1 << 18;
  std::vector<int32_t> first(n, 1), second(n, 2), back(n, 0);
  void* d = dev->allocate(n * sizeof(int32_t));
  auto gate = std::make_shared<ManualEvent>();
  // Upload stream: a blocked upload, then another; they land in issue order.
  const DeviceEvent up1 = dev->copy_from_host_async(d, first.data(), n * 4, DeviceEvent(gate));
  const DeviceEvent up2 = dev->copy_from_host_async(d, second.data(), n * 4);
  // Download stream: after the second upload's event, whatever the timing.
  const DeviceEvent down = dev->copy_to_host_async(back.data(), d, n * 4, up2);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(up2.query()) << "a stream's second copy overtook its first";
  EXPECT_FALSE(down.query()) << "the download ran before the upload it waits for";
  gate->complete();
  down.synchronize();
  EXPECT_TRUE(up1.query());
  EXPECT_EQ(back[0], 2);
  EXPECT_EQ(back[n - 1], 2);
  dev->deallocate(d);
}

TEST(EmulatedStreams, AFailedEventFailsTheCopyAfterItAndLeavesTheDestination) {
  auto dev = make_emulated_device_memory();
  std::vector<float> src(1024, 3.0f), dst(1024, -1.0f);
  void* d = dev->allocate(4096);
  dev->copy_from_host(d, src.data(), 4096);
  auto broken = std::make_shared<ManualEvent>();
  broken->complete(/*failed=*/true);
  const DeviceEvent copied = dev->copy_to_host_async(dst.data(), d, 4096, DeviceEvent(broken));
  EXPECT_NE(error_of([&] { copied.synchronize(); }).find("failed"), std::string::npos);
  EXPECT_EQ(dst[0], -1.0f) << "a copy ordered after failed work must not run";
  dev->deallocate(d);
}

TEST(EmulatedStreams, ComputeIsTheCallingThread) {
  auto dev = make_emulated_device_memory();
  EXPECT_TRUE(dev->compute_event().query()) << "work on the calling thread is done when it returns";
  constexpr size_t n = 1 << 16;
  std::vector<float> ones(n, 1.0f), twos(n, 2.0f), fives(n, 5.0f);
  void* d = dev->allocate(n * 4);
  dev->copy_from_host(d, ones.data(), n * 4);
  auto gate = std::make_shared<ManualEvent>();
  dev->copy_from_host_async(d, twos.data(), n * 4, DeviceEvent(gate));
  const DeviceEvent up = dev->copy_from_host_async(d, fives.data(), n * 4);  // queued behind the gated one
  EXPECT_FALSE(up.query());
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate->complete();
  });
  dev->compute_wait(up);  // what an operator does before reading a chunk that was brought
  EXPECT_EQ(static_cast<float*>(d)[n - 1], 5.0f) << "compute went on before the copy it waits for";
  opener.join();
  dev->deallocate(d);
}

TEST(EmulatedStreams, ACopyWithNothingBeforeItIsDoneOnTheCallingThread) {
  auto dev = make_emulated_device_memory();
  std::vector<float> src(1024, 4.0f), back(1024, 0.0f);
  void* d = dev->allocate(4096);
  const DeviceEvent up = dev->copy_from_host_async(d, src.data(), 4096);
  EXPECT_FALSE(up.pending()) << "an idle stream handed the copy to its worker";
  EXPECT_EQ(static_cast<float*>(d)[1023], 4.0f);
  auto gate = std::make_shared<ManualEvent>();
  const DeviceEvent held = dev->copy_to_host_async(back.data(), d, 4096, DeviceEvent(gate));
  const DeviceEvent after = dev->copy_to_host_async(back.data(), d, 4096);  // the stream is busy: it queues
  EXPECT_TRUE(after.pending());
  EXPECT_FALSE(after.query()) << "a copy overtook the one before it on its stream";
  gate->complete();
  after.synchronize();
  EXPECT_TRUE(held.query());
  EXPECT_EQ(back[1023], 4.0f);
  dev->deallocate(d);
}

TEST(EmulatedStreams, TheDeviceBudgetIsTheArenaCapacity) {
  auto dev = make_emulated_device_memory();
  dev->set_capacity(64 * 1024);
  void* a = dev->allocate(64 * 1024);
  EXPECT_NE(error_of([&] { dev->allocate(4096); }), "no error");
  dev->deallocate(a);
  EXPECT_EQ(dev->arena_stats().live, 0u);
}

}  // namespace
}  // namespace strata::offload
