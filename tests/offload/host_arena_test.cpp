#include "strata/offload/host_arena.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <random>
#include <vector>

#include "strata/core/error.h"
#include "strata/offload/cuda_runtime.h"
#include "strata/offload/topology.h"

namespace strata::offload {
namespace {

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

TEST(HostArena, AllocationsAreAlignedWritableAndCounted) {
  HostArena arena;
  std::vector<std::pair<void*, size_t>> blocks;
  std::mt19937 rng(7);
  for (size_t size : {size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{1} << 20, (size_t{3} << 20) + 5}) {
    void* p = arena.allocate(size);
    ASSERT_TRUE(aligned(p, 4096)) << size;
    std::memset(p, 0xA5, size);
    blocks.emplace_back(p, size);
  }
  const HostArenaStats s = arena.stats();
  size_t requested = 0;
  for (auto& b : blocks) requested += b.second;
  EXPECT_GE(s.allocated_bytes, requested);
  EXPECT_GE(s.mapped_bytes, s.allocated_bytes);
  for (auto& b : blocks) {
    const auto* bytes = static_cast<const unsigned char*>(b.first);
    EXPECT_EQ(bytes[0], 0xA5);
    EXPECT_EQ(bytes[b.second - 1], 0xA5);
    arena.deallocate(b.first);
  }
  EXPECT_EQ(arena.stats().allocated_bytes, 0u);
}

TEST(HostArena, LargerAlignmentIsHonoured) {
  HostArenaOptions opts;
  opts.alignment = 1 << 16;
  HostArena arena(opts);
  for (int i = 0; i < 16; ++i) {
    void* p = arena.allocate(5000 + i * 777);
    EXPECT_TRUE(aligned(p, 1 << 16));
    arena.deallocate(p);
  }
}

TEST(HostArena, RejectsBadAlignment) {
  HostArenaOptions opts;
  opts.alignment = 1000;
  EXPECT_THROW(HostArena{opts}, Error);
  opts.alignment = 2048;
  EXPECT_THROW(HostArena{opts}, Error);
}

TEST(HostArena, FreedMemoryIsReusedNotRemapped) {
  HostArena arena;
  void* p = arena.allocate(8 << 20);
  arena.deallocate(p);
  const uint64_t mapped = arena.stats().mapped_bytes;
  for (int i = 0; i < 50; ++i) arena.deallocate(arena.allocate(8 << 20));
  EXPECT_EQ(arena.stats().mapped_bytes, mapped) << "chunk churn must not take new mappings from the OS";
}

// Note [Large chunks from one reservation]: freed neighbours serve a chunk
// as large as both together, so chunks of changing sizes reuse the memory
// already touched rather than taking more (which stays resident: the arena
// never returns memory).
TEST(HostArena, FreedNeighboursServeALargerChunk) {
  HostArenaOptions o;
  o.pin = false;
  o.huge_pages = false;  // 8 MiB would fill whole huge pages: another region (Note [Huge pages for large chunks])
  HostArena arena(o);
  void* a = arena.allocate(3 << 20);
  void* b = arena.allocate(5 << 20);
  std::memset(a, 1, 3 << 20);
  std::memset(b, 1, 5 << 20);
  const uint64_t mapped = arena.stats().mapped_bytes;
  arena.deallocate(a);
  arena.deallocate(b);
  void* c = arena.allocate(8 << 20);
  EXPECT_EQ(c, a) << "the two freed extents, merged, hold the larger chunk";
  EXPECT_EQ(arena.stats().mapped_bytes, mapped);
  EXPECT_EQ(arena.stats().allocated_bytes, uint64_t{8} << 20);
  arena.deallocate(c);
  EXPECT_EQ(arena.stats().allocated_bytes, 0u);
}

uint64_t vm_rss() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// The process's RSS at most `limit` (and 16 MiB) above `before`; under
// AddressSanitizer, which shadows what was touched, an eighth more.
void expect_rss_within(uint64_t before, uint64_t limit, const char* what) {
#if defined(__SANITIZE_ADDRESS__)
  const uint64_t shadow = limit / 8;
#else
  const uint64_t shadow = 0;
#endif
  EXPECT_LE(vm_rss(), before + limit + shadow + (uint64_t{16} << 20)) << what;
}

// The huge page size when an unpinned arena takes huge pages here (Note
// [Huge pages for large chunks]), else 0.
uint64_t huge_page_path() {
  const uint64_t huge = transparent_huge_page_bytes();
  return huge == 0 || huge > (size_t{8} << 20) || !cuda::probe().devices.empty() ? 0 : huge;
}

// Chunks of many sizes coming and going, never more than `live_limit` live
// at once; every block filled with its tag and checked when freed. Returns
// the most resident bytes the arena reported after any allocation.
uint64_t churn(HostArena& arena, uint64_t live_limit, uint64_t check_limit, size_t min_mib = 1, size_t max_mib = 24,
               int ops = 240) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<size_t> mib(min_mib, max_mib);
  struct Block {
    unsigned char* p;
    size_t bytes;
    unsigned char tag;
  };
  std::vector<Block> live;
  uint64_t live_bytes = 0, most = 0;
  const auto free_one = [&](size_t i) {
    const Block b = live[i];
    for (size_t k = 0; k < b.bytes; k += 4096) EXPECT_EQ(b.p[k], b.tag) << "block of " << b.bytes << " at " << k;
    EXPECT_EQ(b.p[b.bytes - 1], b.tag);
    arena.deallocate(b.p);
    live_bytes -= b.bytes;
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
  };
  for (int op = 0; op < ops; ++op) {
    const size_t bytes = mib(rng) << 20;
    while (live_bytes + bytes > live_limit) free_one(rng() % live.size());
    auto* p = static_cast<unsigned char*>(arena.allocate(bytes));
    const auto tag = static_cast<unsigned char>(op + 1);
    std::memset(p, tag, bytes);  // touched for real: the pages are resident now
    live.push_back({p, bytes, tag});
    live_bytes += bytes;
    const uint64_t resident = arena.stats().mapped_bytes;
    most = std::max(most, resident);
    if (check_limit != 0) {
      EXPECT_LE(resident, check_limit) << "after allocation " << op;
    }
  }
  while (!live.empty()) free_one(live.size() - 1);
  return most;
}

// churn() under a resident limit of `limit`: the arena's resident bytes,
// and the process's RSS, stay within it, free ranges released; `also` runs
// on the arena before it goes. The limit covers jemalloc's own mappings too
// (its metadata, mapped when the arena is made): live chunks stay that much below it.
void expect_churn_within(HostArenaOptions o, uint64_t limit, const char* what,
                         const std::function<void(HostArena&)>& also = nullptr) {
  o.resident_limit = limit;
  HostArena bounded(o);
  const uint64_t own = bounded.stats().mapped_bytes;
  ASSERT_LT(own, limit / 8);
  const uint64_t rss_before = vm_rss();
  EXPECT_LE(churn(bounded, limit - own, limit), limit);
  EXPECT_GT(bounded.stats().released_bytes, 0u) << "the churn should fragment first fit, or it tests nothing";
  EXPECT_EQ(bounded.stats().allocated_bytes, 0u);
  expect_rss_within(rss_before, limit, what);
  if (also) also(bounded);
}

// Note [Resident memory within the tier]: first fit over one reservation
// still fragments, so without a limit this churn holds more resident than
// ever lives at once; with one, the arena releases free ranges and its
// resident bytes (and the process's RSS) stay within the limit, every
// block's contents intact.
TEST(HostArena, ResidentBytesStayWithinTheLimitUnderMixedSizeChurn) {
  constexpr uint64_t kLive = uint64_t{96} << 20;
  HostArenaOptions o;
  o.pin = false;
  o.huge_pages = false;  // exactly within the limit: no huge-page rounding (HugePageRoundingStaysWithinTheLimit)
  {
    HostArena unbounded(o);
    const uint64_t most = churn(unbounded, kLive, 0);
    EXPECT_GT(most, kLive) << "the churn should fragment first fit, or it tests nothing";
    EXPECT_EQ(unbounded.stats().released_bytes, 0u);
  }
  expect_churn_within(o, kLive, "the released pages left the process");
}

uint64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_minflt);
}

// Note [Huge pages for large chunks]: a large chunk lies in whole huge
// pages and faults in a few times per huge page, not once per 4 KiB page as
// with the option off.
TEST(HostArena, LargeChunksFaultInHugePages) {
  const uint64_t huge = huge_page_path();
  if (huge == 0) GTEST_SKIP() << "no huge pages here (none from the kernel, or a CUDA device: the arena pins)";
  constexpr size_t kBytes = size_t{64} << 20;
  constexpr uint64_t kSmallPageFaults = kBytes / 4096;
  for (bool on : {true, false}) {
    HostArenaOptions o;
    o.pin = false;
    o.huge_pages = on;
    HostArena arena(o);
    void* p = arena.allocate(kBytes);
    const uint64_t before = minor_faults();
    std::memset(p, 7, kBytes);
    const uint64_t faults = minor_faults() - before;
    if (on) {
      EXPECT_TRUE(aligned(p, huge));
      EXPECT_EQ(arena.stats().huge_page_bytes, kBytes);
      // Half: a huge page the kernel cannot assemble (no contiguous memory) falls back to 4 KiB pages.
      EXPECT_LT(faults, kSmallPageFaults / 2) << "a 64 MiB chunk in huge pages faulted like 4 KiB pages";
    } else {
      EXPECT_EQ(arena.stats().huge_page_bytes, 0u);
      EXPECT_GT(faults, kSmallPageFaults * 9 / 10) << "the 4 KiB baseline should fault once a page, or this tests nothing";
    }
    arena.deallocate(p);
  }
}

// A chunk whose rounding to whole huge pages would take the live chunks
// past the limit takes 4 KiB pages, and the arena passes its limit by no
// more than the live chunks' rounding; churn of large chunks stays within
// the limit (and the rounding), in RSS too.
TEST(HostArena, HugePageRoundingStaysWithinTheLimit) {
  const uint64_t huge = huge_page_path();
  if (huge == 0) GTEST_SKIP() << "no huge pages here (none from the kernel, or a CUDA device: the arena pins)";
  HostArenaOptions o;
  o.pin = false;
  const uint64_t own = HostArena(o).stats().mapped_bytes;
  constexpr size_t kOdd = (size_t{33} << 20) + 4096;  // rounds up to whole huge pages
  o.resident_limit = own + 3 * kOdd + 8192;
  {
    HostArena arena(o);
    void* a = arena.allocate(kOdd);
    void* b = arena.allocate(kOdd);
    void* c = arena.allocate(kOdd);  // a third rounded chunk would pass the limit
    const uint64_t rounded = (kOdd + huge - 1) / huge * huge;
    EXPECT_EQ(arena.stats().huge_page_bytes, 2 * rounded);
    EXPECT_LE(arena.stats().mapped_bytes, o.resident_limit + 2 * (rounded - kOdd)) << "beyond the live rounding";
    for (void* p : {a, b, c}) arena.deallocate(p);
  }
  constexpr uint64_t kLive = uint64_t{320} << 20;
  o.resident_limit = kLive;
  HostArena bounded(o);
  const uint64_t rss_before = vm_rss();
  // Live chunks 16 MiB below the limit: at most ten of 32-80 MiB, each rounded by at most 1 MiB.
  const uint64_t most = churn(bounded, kLive - bounded.stats().mapped_bytes - (uint64_t{16} << 20), kLive, 32, 80, 60);
  EXPECT_LE(most, kLive);
  EXPECT_EQ(bounded.stats().allocated_bytes, 0u);
  expect_rss_within(rss_before, kLive, "huge pages held beyond the limit");
}

// Page-locking of the CPU's own for the pinned path without a GPU: mlock,
// which like cudaHostRegister keeps pages resident (madvise MADV_DONTNEED
// refuses a locked page, so an arena that released a range without
// unpinning it first would stay above its limit). It records each range, and
// counts what cudaHostRegister would refuse: a range overlapping a pinned
// one, an unpin of a range not pinned as such.
class LockingPinner final : public HostPinner {
 public:
  bool pin(void* ptr, size_t bytes) noexcept override {
    const uint64_t b = reinterpret_cast<uint64_t>(ptr), e = b + bytes;
    for (const auto& [begin, end] : ranges_) overlaps_ += begin < e && b < end ? 1 : 0;
    if (mlock(ptr, bytes) != 0) ++unlocked_;  // still recorded: the bookkeeping is checked either way
    ranges_[b] = e;
    return true;
  }
  void unpin(void* ptr, size_t bytes) noexcept override {
    const auto it = ranges_.find(reinterpret_cast<uint64_t>(ptr));
    if (it == ranges_.end() || it->second - it->first != bytes) {
      ++bad_unpins_;
      return;
    }
    munlock(ptr, bytes);
    ranges_.erase(it);
  }
  // Whether [ptr, ptr + bytes) lies in one pinned range.
  bool covers(const void* ptr, size_t bytes) const {
    const uint64_t b = reinterpret_cast<uint64_t>(ptr);
    auto it = ranges_.upper_bound(b);
    if (it == ranges_.begin()) return false;
    --it;
    return it->first <= b && b + bytes <= it->second;
  }
  uint64_t locked_bytes() const {
    uint64_t n = 0;
    for (const auto& [begin, end] : ranges_) n += end - begin;
    return n;
  }
  int overlaps() const { return overlaps_; }
  int bad_unpins() const { return bad_unpins_; }
  int unlocked() const { return unlocked_; }
  size_t ranges() const { return ranges_.size(); }

 private:
  std::map<uint64_t, uint64_t> ranges_;
  int overlaps_ = 0, bad_unpins_ = 0, unlocked_ = 0;
};

// Note [Pinned ranges from the reservation]: each large chunk is pinned as
// one range; a freed chunk's range, taken again as it was, is not pinned
// again; a chunk over part of a freed one's range unpins it first; and
// destroying the arena unpins everything.
TEST(HostArena, PinnedChunksArePinnedAsOneRangeEachAndReused) {
  auto pinner = std::make_shared<LockingPinner>();
  HostArenaOptions o;
  o.pinner = pinner;
  {
    HostArena arena(o);
    const uint64_t own = pinner->locked_bytes();  // jemalloc's own mappings, pinned whole
    constexpr size_t kBig = size_t{8} << 20, kSmall = size_t{3} << 20;
    void* a = arena.allocate(kBig);
    EXPECT_TRUE(pinner->covers(a, kBig));
    EXPECT_TRUE(arena.stats().pinned);
    const uint64_t pins = arena.stats().pins;
    arena.deallocate(a);
    void* again = arena.allocate(kBig);
    EXPECT_EQ(again, a) << "first fit should hand the freed range out again";
    EXPECT_EQ(arena.stats().pins, pins) << "a freed chunk's range, reused as it was, was pinned again";
    arena.deallocate(again);
    void* part = arena.allocate(kSmall);  // over the start of the freed 8 MiB range
    void* next = arena.allocate(kSmall);
    EXPECT_TRUE(pinner->covers(part, kSmall));
    EXPECT_TRUE(pinner->covers(next, kSmall));
    EXPECT_EQ(arena.stats().pins, pins + 2);
    EXPECT_EQ(arena.stats().pinned_bytes, pinner->locked_bytes() - own);
    EXPECT_EQ(arena.stats().pinned_bytes, 2 * kSmall) << "the freed 8 MiB range stayed pinned under the new chunks";
    std::memset(part, 1, kSmall);
    std::memset(next, 2, kSmall);
    arena.deallocate(part);
    arena.deallocate(next);
    EXPECT_EQ(pinner->overlaps(), 0) << "a range was pinned over one still pinned";
  }
  EXPECT_EQ(pinner->ranges(), 0u) << "the destroyed arena left ranges pinned";
  EXPECT_EQ(pinner->bad_unpins(), 0);
}

// Note [Pinned ranges from the reservation]: the pinned path under the
// churn that fragments first fit stays within its resident limit, in the
// process's RSS too: every release unpins first (with mlock, a release of a
// locked range fails and the arena stays above its limit).
TEST(HostArena, PinnedResidentBytesStayWithinTheLimitUnderMixedSizeChurn) {
  constexpr uint64_t kLive = uint64_t{96} << 20;
  auto pinner = std::make_shared<LockingPinner>();
  HostArenaOptions o;
  o.pinner = pinner;
  expect_churn_within(o, kLive, "pinned pages held beyond the limit", [&](HostArena& bounded) {
    EXPECT_LE(pinner->locked_bytes(), kLive);
    EXPECT_TRUE(bounded.stats().pinned);
  });
  EXPECT_EQ(pinner->overlaps(), 0) << "a range was pinned over one still pinned";
  EXPECT_EQ(pinner->bad_unpins(), 0);
  EXPECT_EQ(pinner->ranges(), 0u);
  if (pinner->unlocked() > 0) std::printf("note: mlock refused %d ranges here (no CAP_IPC_LOCK?)\n", pinner->unlocked());
}

TEST(HostArena, ArenasAreSeparate) {
  HostArena a, b;
  EXPECT_NE(a.arena_index(), b.arena_index());
  void* pa = a.allocate(1 << 20);
  void* pb = b.allocate(1 << 20);
  EXPECT_EQ(a.stats().allocated_bytes, b.stats().allocated_bytes);
  a.deallocate(pa);
  EXPECT_EQ(a.stats().allocated_bytes, 0u);
  EXPECT_GT(b.stats().allocated_bytes, 0u);
  b.deallocate(pb);
}

TEST(HostArena, PinsOnlyWithADeviceAndBindsOnlyOnNuma) {
  HostArena arena;
  void* p = arena.allocate(1 << 20);
  const HostArenaStats s = arena.stats();
  EXPECT_EQ(s.pinned, !cuda::probe().devices.empty());
  EXPECT_EQ(s.numa_bound, machine_topology().numa_nodes.size() > 1);
  arena.deallocate(p);

  HostArenaOptions unpinned;
  unpinned.pin = false;
  HostArena plain(unpinned);
  void* q = plain.allocate(1 << 20);
  EXPECT_FALSE(plain.stats().pinned);
  plain.deallocate(q);
}

TEST(HostArena, ReportsJemallocVersion) { EXPECT_EQ(jemalloc_version().rfind("5.", 0), 0u) << jemalloc_version(); }

}  // namespace
}  // namespace strata::offload
