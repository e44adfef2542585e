#include "strata/offload/copy_engine.h"

#include "strata/core/error.h"

namespace strata::offload {

CopyEngine::CopyEngine(int threads) {
  STRATA_CHECK(threads >= 1, "the copy engine needs at least one thread, got ", threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

CopyTicket CopyEngine::submit(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  CopyTicket ticket = task.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSERT(!stop_, "copy engine is shutting down");
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return ticket;
}

size_t CopyEngine::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

size_t CopyEngine::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + running_;
}

void CopyEngine::work() {
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued ran
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    task();  // exceptions land in the ticket
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
  }
}

}  // namespace strata::offload
