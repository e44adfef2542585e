#include "nvme_ring.h"

#include "strata/core/error.h"
#include "strata/core/log.h"

// Requests travel to the reaper thread through the kernel, which
// ThreadSanitizer cannot see; these annotations tell it about that ordering.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define STRATA_TSAN_RELEASE(p) __tsan_release(p)
#define STRATA_TSAN_ACQUIRE(p) __tsan_acquire(p)
#else
#define STRATA_TSAN_RELEASE(p) ((void)(p))
#define STRATA_TSAN_ACQUIRE(p) ((void)(p))
#endif

namespace strata::offload::detail {

IoRing::IoRing(unsigned depth, const std::vector<int>& fds, Completion on_complete)
    : fds_(fds), on_complete_(std::move(on_complete)) {
  const int rc = io_uring_queue_init(depth, &ring_, 0);
  STRATA_CHECK(rc == 0, "io_uring is unavailable (io_uring_queue_init: ", errno_text(-rc),
               "); the NVMe tier needs it (see `strata info`)");
  if (!fds_.empty()) {
    const int reg = io_uring_register_files(&ring_, fds_.data(), static_cast<unsigned>(fds_.size()));
    fixed_files_ = reg == 0;
    if (!fixed_files_) STRATA_LOG(kInfo, "io_uring_register_files failed ({}); using plain fds", errno_text(-reg));
  }
  reaper_ = std::thread([this] { reap(); });
}

IoRing::~IoRing() {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe != nullptr) {
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, nullptr);  // tells the reaper to stop
      int rc;
      do rc = io_uring_submit(&ring_);
      while (rc == -EINTR || rc == -EAGAIN);
    }
  }
  if (reaper_.joinable()) reaper_.join();
  io_uring_queue_exit(&ring_);
}

bool IoRing::register_buffers(const std::vector<std::pair<char*, size_t>>& regions) {
  std::vector<iovec> iov;
  for (const auto& [p, n] : regions) iov.push_back({p, n});
  std::lock_guard<std::mutex> lock(submit_mu_);
  if (!fixed_buffers_.empty()) io_uring_unregister_buffers(&ring_);
  fixed_buffers_.clear();
  if (iov.empty()) return true;
  const int rc = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
  if (rc != 0) {
    STRATA_LOG(kWarn, "io_uring_register_buffers failed ({}); transfers use unregistered buffers", errno_text(-rc));
    return false;
  }
  fixed_buffers_ = regions;
  return true;
}

int IoRing::buffer_index(const char* p, size_t len) const {
  for (size_t i = 0; i < fixed_buffers_.size(); ++i) {
    if (p >= fixed_buffers_[i].first && p + len <= fixed_buffers_[i].first + fixed_buffers_[i].second) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

void IoRing::submit(const IoRequest* requests, size_t n) {
  std::lock_guard<std::mutex> lock(submit_mu_);
  uint64_t fixed = 0;
  for (size_t k = 0; k < n; ++k) {
    const IoRequest& r = requests[k];
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    STRATA_ASSERT(sqe != nullptr, "io_uring submission queue full: more than its depth in flight");
    const int fd = fixed_files_ ? r.file : fds_[static_cast<size_t>(r.file)];
    const auto len = static_cast<unsigned>(r.len);
    const int index = buffer_index(r.buf, r.len);
    if (r.is_read) {
      if (index >= 0) {
        io_uring_prep_read_fixed(sqe, fd, r.buf, len, r.offset, index);
      } else {
        io_uring_prep_read(sqe, fd, r.buf, len, r.offset);
      }
    } else if (index >= 0) {
      io_uring_prep_write_fixed(sqe, fd, r.buf, len, r.offset, index);
    } else {
      io_uring_prep_write(sqe, fd, r.buf, len, r.offset);
    }
    fixed += index >= 0 ? 1 : 0;
    if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, r.data);
    STRATA_TSAN_RELEASE(r.data);
  }
  fixed_requests_.fetch_add(fixed, std::memory_order_relaxed);
  int rc;
  do rc = io_uring_submit(&ring_);
  while (rc == -EINTR || rc == -EAGAIN);  // EAGAIN: the kernel is short of resources for a moment
  STRATA_CHECK_NEG_ERRNO(rc, "submitting ", n, " NVMe requests");
}

void IoRing::reap() {
  for (;;) {
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe(&ring_, &cqe);
    if (rc == -EINTR || rc == -EAGAIN) continue;
    if (rc < 0) {
      STRATA_LOG(kError, "io_uring_wait_cqe failed: {}", errno_text(-rc));
      continue;
    }
    void* data = io_uring_cqe_get_data(cqe);
    const int res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    if (data == nullptr) return;
    STRATA_TSAN_ACQUIRE(data);
    on_complete_(data, res);
  }
}

}  // namespace strata::offload::detail
