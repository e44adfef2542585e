#pragma once
// The NVMe store's io_uring (nvme_store.h, "I/O"): one ring of `depth`
// entries over the store's files, registered with it (IOSQE_FIXED_FILE)
// when the kernel allows, buffers registered for READ_FIXED / WRITE_FIXED,
// and a reaper thread that owns the completion queue and hands every
// completion to the store. Knows nothing of chunks, extents or checksums.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <liburing.h>

namespace strata::offload::detail {

/// One block transfer: `len` bytes at `offset` of file `file` (an index into
/// the ring's files) to or from `buf`; `data` comes back with its completion.
struct IoRequest {
  bool is_read = false;
  int file = 0;
  uint64_t offset = 0;
  char* buf = nullptr;
  size_t len = 0;
  void* data = nullptr;  // never null
};

class IoRing {
 public:
  /// Called on the reaper thread with a request's `data` and its result
  /// (bytes transferred, or -errno).
  using Completion = std::function<void(void* data, int res)>;

  /// Throws strata::Error when io_uring is unavailable.
  IoRing(unsigned depth, const std::vector<int>& fds, Completion on_complete);
  /// Stops the reaper. Every submitted request must have completed.
  ~IoRing();
  IoRing(const IoRing&) = delete;
  IoRing& operator=(const IoRing&) = delete;

  /// Registers `regions` as the fixed buffers, replacing earlier ones; no
  /// request may be in flight. False (and a warning) when the kernel refuses
  /// (RLIMIT_MEMLOCK): transfers then use plain buffers.
  bool register_buffers(const std::vector<std::pair<char*, size_t>>& regions);
  size_t registered_buffers() const { return fixed_buffers_.size(); }

  /// Queues and submits `n` requests; the caller keeps at most `depth`
  /// in flight. A request whose buffer lies in a registered region goes as
  /// READ_FIXED / WRITE_FIXED.
  void submit(const IoRequest* requests, size_t n);
  /// Requests submitted so far through registered buffers.
  uint64_t fixed_requests() const { return fixed_requests_.load(std::memory_order_relaxed); }

 private:
  int buffer_index(const char* p, size_t len) const;
  void reap();

  io_uring ring_{};
  std::vector<int> fds_;
  bool fixed_files_ = false;
  std::vector<std::pair<char*, size_t>> fixed_buffers_;
  Completion on_complete_;
  std::mutex submit_mu_;  // the submission queue
  std::atomic<uint64_t> fixed_requests_{0};
  std::thread reaper_;
};

}  // namespace strata::offload::detail
