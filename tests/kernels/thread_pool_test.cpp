// ThreadPool (kernels/thread_pool.h): the ranges cover [0, n) once, on
// grain boundaries, no smaller than asked, the caller running the first;
// concurrent callers take turns; a range that throws reaches the caller
// only after every range finished.
#include "strata/kernels/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace strata::kernels {
namespace {

struct Range {
  int64_t begin, end;
  std::thread::id thread;
};

std::vector<Range> run(ThreadPool& pool, int64_t n, int64_t grain, int64_t min_per_thread, std::vector<int>& hits) {
  hits.assign(static_cast<size_t>(n), 0);
  std::mutex mu;
  std::vector<Range> ranges;
  pool.parallel_for(n, grain, min_per_thread, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)] += 1;  // disjoint ranges: no race
    std::lock_guard<std::mutex> lock(mu);
    ranges.push_back({b, e, std::this_thread::get_id()});
  });
  return ranges;
}

TEST(ThreadPool, RangesCoverEveryElementOnceOnGrainBoundaries) {
  for (const int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1000}, int64_t{4099}}) {
      for (const int64_t grain : {int64_t{1}, int64_t{16}, int64_t{64}}) {
        SCOPED_TRACE(testing::Message() << threads << " threads, n " << n << ", grain " << grain);
        std::vector<int> hits;
        const std::vector<Range> ranges = run(pool, n, grain, 1, hits);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "element " << i;
        EXPECT_LE(ranges.size(), static_cast<size_t>(threads));
        for (const Range& r : ranges) {
          EXPECT_LT(r.begin, r.end) << "no empty range is run";
          EXPECT_TRUE(r.begin == 0 || r.begin % grain == 0) << "range starts at " << r.begin;
        }
      }
    }
  }
}

TEST(ThreadPool, SmallWorkIsNotSplitAndTheCallerRunsTheFirstRange) {
  ThreadPool pool(4);
  std::vector<int> hits;
  std::vector<Range> ranges = run(pool, 100, 1, 1000, hits);
  ASSERT_EQ(ranges.size(), 1u) << "100 elements at 1000 per thread are one range";
  EXPECT_EQ(ranges[0].begin, 0);
  EXPECT_EQ(ranges[0].end, 100);
  EXPECT_EQ(ranges[0].thread, std::this_thread::get_id());
  ranges = run(pool, 4000, 1, 1000, hits);
  EXPECT_EQ(ranges.size(), 4u);
  for (const Range& r : ranges) {
    EXPECT_GE(r.end - r.begin, 1000) << "no range below min_per_thread";
    if (r.begin == 0) EXPECT_EQ(r.thread, std::this_thread::get_id()) << "the caller runs the first range";
  }
}

TEST(ThreadPool, ConcurrentCallersTakeTurns) {
  ThreadPool pool(2);
  std::atomic<int> active[2] = {0, 0};
  std::atomic<bool> overlapped{false};
  auto caller = [&](int me) {
    for (int round = 0; round < 20; ++round) {
      pool.parallel_for(2, 1, 1, [&](int64_t, int64_t) {
        active[me] += 1;
        if (active[1 - me] > 0) overlapped = true;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        active[me] -= 1;
      });
    }
  };
  std::thread a(caller, 0), b(caller, 1);
  a.join();
  b.join();
  EXPECT_FALSE(overlapped) << "two parallel_for calls ran their ranges at the same time";
}

TEST(ThreadPool, AThrowReachesTheCallerAfterEveryRangeFinished) {
  ThreadPool pool(3);
  for (const int64_t thrower : {int64_t{0}, int64_t{2}}) {  // the caller's range, and a worker's
    std::atomic<int> finished{0};
    try {
      pool.parallel_for(3, 1, 1, [&](int64_t b, int64_t) {
        if (b == thrower) throw std::runtime_error("range " + std::to_string(b));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        finished += 1;
      });
      FAIL() << "did not throw";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "range " + std::to_string(thrower));
    }
    EXPECT_EQ(finished.load(), 2) << "the other ranges ran to their end before the throw reached the caller";
  }
  std::vector<int> hits;
  run(pool, 300, 1, 1, hits);  // the pool still works
  for (int h : hits) ASSERT_EQ(h, 1);
}

}  // namespace
}  // namespace strata::kernels
