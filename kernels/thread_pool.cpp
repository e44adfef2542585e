#include "strata/kernels/thread_pool.h"

#include <hwloc.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <utility>
#include <mutex>
#include <thread>
#include <vector>

#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::kernels {

namespace {

// Binds the calling thread to core `index` (mod the number of cores). Best effort.
void bind_to_core(int index) {
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) != 0) return;
  if (hwloc_topology_load(topo) == 0) {
    const int cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    if (cores > 0) {
      hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, index % cores);
      if (core != nullptr && hwloc_set_cpubind(topo, core->cpuset, HWLOC_CPUBIND_THREAD) != 0) {
        STRATA_LOG(kDebug, "binding kernel thread {} to core {} failed", index, index % cores);
      }
    }
  }
  hwloc_topology_destroy(topo);
}

int default_threads() {
  if (const char* env = std::getenv("STRATA_NUM_THREADS")) {
    const int n = std::atoi(env);
    STRATA_CHECK(n >= 1, "STRATA_NUM_THREADS=", env, " is not a positive thread count");
    return n;
  }
  hwloc_topology_t topo = nullptr;
  int cores = 0;
  if (hwloc_topology_init(&topo) == 0) {
    if (hwloc_topology_load(topo) == 0) cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    hwloc_topology_destroy(topo);
  }
  return std::max(cores, 1);
}

}  // namespace

struct ThreadPool::Impl {
  int threads = 1;
  std::vector<std::thread> workers;
  std::mutex mu;
  std::mutex run_mu;  // held by the caller of a parallel_for for its whole run
  std::condition_variable wake;
  std::condition_variable done;
  uint64_t generation = 0;
  int pending = 0;
  bool stop = false;
  const std::function<void(int64_t, int64_t)>* job = nullptr;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::exception_ptr failure;  // the first range that threw, rethrown by parallel_for

  // Runs one range; a throw is kept for the caller, so every range still finishes.
  void run_range(const std::function<void(int64_t, int64_t)>& fn, std::pair<int64_t, int64_t> range) {
    if (range.first >= range.second) return;
    try {
      fn(range.first, range.second);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!failure) failure = std::current_exception();
    }
  }

  void worker(int index) {
    bind_to_core(index);
    uint64_t seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> lock(mu);
      wake.wait(lock, [&] { return stop || generation != seen; });
      if (stop) return;
      seen = generation;
      const auto range = ranges[index];
      const auto* fn = job;
      lock.unlock();
      run_range(*fn, range);
      lock.lock();
      if (--pending == 0) done.notify_one();
    }
  }
};

ThreadPool::ThreadPool(int threads) : impl_(std::make_unique<Impl>()) {
  STRATA_CHECK(threads >= 1, "a thread pool needs at least one thread, got ", threads);
  impl_->threads = threads;
  impl_->ranges.resize(threads);
  for (int i = 1; i < threads; ++i) impl_->workers.emplace_back([this, i] { impl_->worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->wake.notify_all();
  for (auto& t : impl_->workers) t.join();
}

int ThreadPool::size() const noexcept { return impl_->threads; }

void ThreadPool::parallel_for(int64_t n, int64_t grain, int64_t min_per_thread,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t by_size = std::max<int64_t>(n / std::max<int64_t>(min_per_thread, 1), 1);
  const int parts = static_cast<int>(std::min<int64_t>(impl_->threads, by_size));
  if (parts == 1) {
    fn(0, n);
    return;
  }
  // One job at a time: two threads may run kernels at once (the optimizer
  // step's device and host halves on the emulated device); the second waits.
  std::lock_guard<std::mutex> one_job(impl_->run_mu);
  // Contiguous ranges with boundaries on multiples of `grain` (no false sharing of writes).
  std::vector<std::pair<int64_t, int64_t>> ranges(impl_->threads, {0, 0});
  const int64_t per = (n + parts - 1) / parts;
  for (int p = 0; p < parts; ++p) {
    const int64_t b = std::min(n, (per * p + grain - 1) / grain * grain);
    const int64_t e = p + 1 == parts ? n : std::min(n, (per * (p + 1) + grain - 1) / grain * grain);
    ranges[p] = {b, e};
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->ranges = ranges;
    impl_->job = &fn;
    impl_->pending = impl_->threads - 1;
    impl_->failure = nullptr;
    ++impl_->generation;
  }
  impl_->wake.notify_all();
  impl_->run_range(fn, ranges[0]);
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->done.wait(lock, [&] { return impl_->pending == 0; });
  impl_->job = nullptr;
  if (impl_->failure) std::rethrow_exception(std::exchange(impl_->failure, nullptr));
}

namespace {
std::unique_ptr<ThreadPool>& pool_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
std::mutex& pool_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace

ThreadPool& kernel_thread_pool() {
  std::lock_guard<std::mutex> lock(pool_mutex());
  auto& slot = pool_slot();
  if (!slot) slot = std::make_unique<ThreadPool>(default_threads());
  return *slot;
}

void set_kernel_threads(int threads) {
  std::lock_guard<std::mutex> lock(pool_mutex());
  pool_slot() = std::make_unique<ThreadPool>(threads);
}

int kernel_threads() { return kernel_thread_pool().size(); }

}  // namespace strata::kernels
