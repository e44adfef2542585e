#pragma once
// A device event a test completes (or fails) by hand: work on a device stream
// that has not finished yet, as a GPU's queued kernels or copies.
#include <condition_variable>
#include <mutex>

#include "strata/core/error.h"
#include "strata/offload/device_event.h"

namespace strata::offload::testing {

class ManualEvent final : public DeviceEvent::Impl {
 public:
  void complete(bool failed = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      failed_ = failed;
    }
    cv_.notify_all();
  }
  bool query() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void synchronize() const override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (failed_) STRATA_FAIL("the work before this event failed");
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  bool failed_ = false;
};

}  // namespace strata::offload::testing
