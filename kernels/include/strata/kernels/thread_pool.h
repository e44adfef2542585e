#pragma once
// ThreadPool: the CPU kernels' workers, one per core, bound to their cores
// through hwloc. parallel_for splits [0, n) into one contiguous range per
// thread (aligned to `grain` elements), so every thread streams through one
// long range; the calling thread runs the first range itself. Callers on
// several threads take turns: one split parallel_for runs at a time. When a
// range throws, the others still run to their end, and parallel_for rethrows
// the first exception once none is running (fn never outlives the call).

#include <cstdint>
#include <functional>
#include <memory>

namespace strata::kernels {

class ThreadPool {
 public:
  /// `threads` >= 1, including the caller.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept;
  /// Runs fn(begin, end) over [0, n); ranges below `min_per_thread` elements are not split further.
  void parallel_for(int64_t n, int64_t grain, int64_t min_per_thread,
                    const std::function<void(int64_t, int64_t)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The pool the kernels use: STRATA_NUM_THREADS threads, else one per core.
ThreadPool& kernel_thread_pool();
/// Replaces the kernel pool with one of `threads` threads (benchmarks, tests).
/// Not safe while kernels run on other threads.
void set_kernel_threads(int threads);
int kernel_threads();

}  // namespace strata::kernels
