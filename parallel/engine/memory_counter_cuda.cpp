// The CUDA non-model counter: LibTorch's caching allocator statistics.
// Built only when LibTorch has CUDA (STRATA_TORCH_CUDA); CI compiles it for
// syntax against the installed c10/cuda headers (ctest cuda_counter_compiles).
#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "strata/parallel/memory_counter.h"

namespace strata::parallel {
namespace {

// Note [Two peaks from one register]
// The caching allocator has one peak per statistic, reset by
// resetPeakStats(device). The tracer wants a peak per operator and the
// capacity rule one per interval between operators with parameters. Every
// read or reset of either first folds the allocator's peak into both of ours
// and resets the allocator's, so no high-water mark is lost to the other
// register's reset. (It does reset the peak a user would read from
// torch.cuda.max_memory_allocated while strata traces or budgets capacity.)
class CudaCounter final : public NonModelCounter {
 public:
  explicit CudaCounter(int device) : device_(static_cast<c10::DeviceIndex>(device)) {}
  const char* source() const override { return "CUDA caching allocator statistics (allocated bytes)"; }
  uint64_t current() override {
    std::lock_guard<std::mutex> lock(mu_);
    return fold();
  }
  uint64_t peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    fold();
    return peak_;
  }
  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = fold();
  }
  uint64_t interval_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    fold();
    return interval_peak_;
  }
  void reset_interval_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    interval_peak_ = fold();
  }

 private:
  // Folds the allocator's peak into both registers, resets it, and returns
  // the current bytes. Index 0 is the aggregate pool in every LibTorch version.
  uint64_t fold() {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_);
    const auto now = static_cast<uint64_t>(std::max<int64_t>(0, stats.allocated_bytes[0].current));
    const auto high = static_cast<uint64_t>(std::max<int64_t>(0, stats.allocated_bytes[0].peak));
    peak_ = std::max({peak_, high, now});
    interval_peak_ = std::max({interval_peak_, high, now});
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_);
    return now;
  }
  c10::DeviceIndex device_;
  std::mutex mu_;
  uint64_t peak_ = 0, interval_peak_ = 0;
};

}  // namespace

NonModelCounter* cuda_non_model_counter(int device) {
  static std::mutex mu;
  static auto* counters = new std::map<int, std::unique_ptr<CudaCounter>>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  auto& c = (*counters)[device];
  if (!c) c = std::make_unique<CudaCounter>(device);
  return c.get();
}

}  // namespace strata::parallel
