#pragma once
// CopyEngine: runs tier moves in the background so they overlap with compute.
//
// Jobs (usually a ChunkManager move) run on the engine's worker threads; the
// caller gets a ticket to wait on (which rethrows the job's error) or test.
// The byte copies inside a job go through DeviceMemory, which on CUDA uses
// one stream per direction (host-to-device, device-to-host) with an event per
// copy, so uploads and downloads proceed side by side; host memory is pinned
// (HostArena). Without CUDA the workers copy with memcpy.

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::offload {

using CopyTicket = std::shared_future<void>;

class CopyEngine {
 public:
  explicit CopyEngine(int threads = 2);
  /// Finishes every queued job, then joins the workers.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  CopyTicket submit(std::function<void()> job);
  /// Blocks until the job ran; rethrows its exception.
  static void wait(const CopyTicket& ticket) { ticket.get(); }
  static bool test(const CopyTicket& ticket) {
    return ticket.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  size_t queued() const;
  /// Jobs queued or running.
  size_t in_flight() const;

 private:
  void work();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stop_ = false;
  size_t running_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace strata::offload
