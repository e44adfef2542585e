#include "strata/offload/nvme_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/core/log.h"
#include "strata/offload/cuda_runtime.h"
#include "strata/offload/extent_allocator.h"

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

namespace strata::offload {

// --- fault injection ---------------------------------------------------------

void FaultInjector::fail_request(int64_t nth, int error) {
  error_ = error;
  fail_at_ = seen_.load() + nth;
}
void FaultInjector::shorten_request(int64_t nth) { short_at_ = seen_.load() + nth; }
void FaultInjector::corrupt_request(int64_t nth, size_t byte) {
  byte_ = byte;
  corrupt_at_ = seen_.load() + nth;
}

FaultInjector::Fate FaultInjector::next() {
  const int64_t n = ++seen_;
  Fate f;
  if (n == fail_at_.load()) f.error = error_.load();
  f.shorten = n == short_at_.load();
  f.corrupt = n == corrupt_at_.load();
  f.byte = byte_.load();
  return f;
}

// --- transfers -----------------------------------------------------------------

struct IoOp {
  bool is_read = false;
  int64_t key = 0;
  size_t bytes = 0;
  char* buf = nullptr;
  Extent extent;
  uint64_t checksum = 0;
  int pending = 0;    // blocks not yet completed (guarded by the store's mutex)
  bool done = false;  // every block completed
  bool verified = false;
  bool raw = false;   // one block of a streamed transfer: no record update, no checksum here
  std::string error;  // the first failure, empty on success
};

namespace {

struct Block {
  IoTicket op;
  uint64_t file_offset;
  size_t len;
  char* buf;
  int buf_index;  // registered buffer, or -1
  FaultInjector::Fate fate;
};

std::string errno_text(int err) {
  char buf[128];
  return std::string(strerror_r(err, buf, sizeof(buf)));
}

void make_private_dir(const std::string& dir) {
  STRATA_CHECK(!dir.empty(), "the NVMe store needs a directory; set nvme_dir");
  std::string path;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    path = dir.substr(0, pos);
    if (path.empty()) continue;
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
      STRATA_FAIL("cannot create NVMe store directory ", path, ": ", errno_text(errno));
    }
  }
  struct stat st {};
  STRATA_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "NVMe store path ", dir,
               " is not a directory");
}

std::atomic<int> g_store_counter{0};

IoTicket make_op(bool is_read, int64_t key, void* buf, size_t bytes) {
  auto op = std::make_shared<IoOp>();
  op->is_read = is_read;
  op->key = key;
  op->bytes = bytes;
  op->buf = static_cast<char*>(buf);
  return op;
}

}  // namespace

struct NvmeStore::Impl {
  NvmeStoreOptions opt;
  std::vector<std::string> paths;
  std::vector<int> fds;
  bool fixed_files = false;
  std::vector<std::pair<char*, size_t>> fixed_buffers;
  std::vector<LeftoverFile> leftovers;
  io_uring ring{};
  bool ring_ready = false;
  std::unique_ptr<ExtentAllocator> alloc;

  struct Record {
    Extent extent;
    uint64_t checksum;
    size_t bytes;
  };

  mutable std::mutex mu;  // records, alloc, ops, counters
  std::condition_variable cv;
  std::unordered_map<int64_t, Record> records;
  unsigned inflight = 0;
  NvmeStoreStats stats;

  std::mutex submit_mu;  // the submission queue
  std::thread reaper;

  std::mutex stream_mu;  // one streamed transfer at a time: it owns the staging blocks
  std::vector<char*> staging;
  bool staging_pinned = false;
  std::vector<std::pair<void*, size_t>> user_buffers;

  // A fresh extent for a new copy of `key`, or a clear "store full" error.
  Extent allocate_extent(int64_t key, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    const auto extent = alloc->allocate(round_up(bytes, kAlignment));
    STRATA_CHECK(extent.has_value(), "NVMe store full: no free extent of ", format_bytes(bytes), " for chunk ", key,
                 " in ", opt.directory, " (", format_bytes(alloc->used()), " of ", format_bytes(alloc->capacity()),
                 " used, largest free extent ", format_bytes(alloc->largest_free()),
                 "); raise the nvme budget or lower the chunk size");
    return *extent;
  }

  // One block of a streamed transfer: [offset, offset+len) of `whole`.
  IoTicket submit_raw(bool is_read, int64_t key, const Extent& whole, size_t offset, char* buf, size_t len) {
    auto op = make_op(is_read, key, buf, len);
    op->raw = true;
    op->extent = Extent{whole.file, whole.offset + offset, len};
    submit(op);
    return op;
  }

  // Waits for every ticket, returning the first error (empty if none).
  std::string drain(std::vector<IoTicket>& tickets) {
    std::string first;
    for (auto& t : tickets) {
      if (!t) continue;
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return t->done; });
      if (first.empty()) first = t->error;
      t.reset();
    }
    return first;
  }

  void register_all_buffers() {
    std::vector<iovec> iov;
    fixed_buffers.clear();
    for (char* p : staging) iov.push_back({p, opt.block_bytes});
    for (const auto& [p, n] : user_buffers) iov.push_back({p, n});
    if (iov.empty()) return;
    std::lock_guard<std::mutex> lock(submit_mu);
    io_uring_unregister_buffers(&ring);  // fails harmlessly when none are registered
    const int rc = io_uring_register_buffers(&ring, iov.data(), static_cast<unsigned>(iov.size()));
    if (rc != 0) {
      STRATA_LOG(kWarn, "io_uring_register_buffers failed ({}); transfers use unregistered buffers", errno_text(-rc));
      return;
    }
    for (const iovec& v : iov) fixed_buffers.emplace_back(static_cast<char*>(v.iov_base), v.iov_len);
  }

  ~Impl() { teardown(); }

  void teardown() noexcept {
    if (ring_ready) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return inflight == 0; });
      }
      {
        std::lock_guard<std::mutex> lock(submit_mu);
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        if (sqe != nullptr) {
          io_uring_prep_nop(sqe);
          io_uring_sqe_set_data(sqe, nullptr);  // tells the reaper to stop
          int rc;
          do rc = io_uring_submit(&ring);
          while (rc == -EINTR || rc == -EAGAIN);
        }
      }
      if (reaper.joinable()) reaper.join();
      io_uring_queue_exit(&ring);
      ring_ready = false;
    }
    for (char* p : staging) {
      if (staging_pinned) cuda::host_unregister(p);
      std::free(p);
    }
    staging.clear();
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i] >= 0) ::close(fds[i]);
      if (::unlink(paths[i].c_str()) != 0) {
        STRATA_LOG(kWarn, "could not remove NVMe store file {}: {}", paths[i], errno_text(errno));
      }
    }
    fds.clear();
  }

  void reclaim_leftovers() {
    DIR* d = ::opendir(opt.directory.c_str());
    STRATA_CHECK(d != nullptr, "cannot list NVMe store directory ", opt.directory, ": ", errno_text(errno));
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("strata-store-", 0) != 0 || name.size() < 4 || name.substr(name.size() - 4) != ".bin") continue;
      const std::string path = opt.directory + "/" + name;
      const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      // A live store holds a lock on each of its files. A file nobody locks,
      // or whose owner (the pid in its name) is gone, belongs to a run that
      // did not shut down; the owner's io_uring can hold the lock for a
      // moment after the process died, hence the pid check.
      const pid_t owner = static_cast<pid_t>(std::atol(name.c_str() + std::strlen("strata-store-")));
      const bool owner_gone = owner > 0 && ::kill(owner, 0) != 0 && errno == ESRCH;
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0 || owner_gone) {
        struct stat st {};
        ::fstat(fd, &st);
        leftovers.push_back({path, static_cast<uint64_t>(st.st_size)});
        ::unlink(path.c_str());
        STRATA_LOG(kWarn, "reclaimed NVMe store file {} ({}) left by a run that did not shut down", path,
                   format_bytes(st.st_size));
      }
      ::close(fd);
    }
    ::closedir(d);
  }

  void create_files() {
    const int id = g_store_counter++;
    std::vector<uint64_t> sizes;
    uint64_t remaining = round_up(opt.capacity, kAlignment);
    const uint64_t max_file = std::max<uint64_t>(round_up(opt.max_file_bytes, kAlignment), kAlignment);
    for (int i = 0; remaining > 0; ++i) {
      const uint64_t bytes = std::min(remaining, max_file);
      const std::string path = opt.directory + "/strata-store-" + std::to_string(::getpid()) + "-" +
                               std::to_string(id) + "-" + std::to_string(i) + ".bin";
      const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (opt.direct_io ? O_DIRECT : 0);
      const int fd = ::open(path.c_str(), flags, 0600);
      STRATA_CHECK(fd >= 0, "cannot create NVMe store file ", path, ": ", errno_text(errno),
                   errno == EINVAL && opt.direct_io ? " (the file system may not support O_DIRECT)" : "");
      paths.push_back(path);
      fds.push_back(fd);
      STRATA_CHECK(::flock(fd, LOCK_EX | LOCK_NB) == 0, "cannot lock NVMe store file ", path, ": ",
                   errno_text(errno));
      int rc;
      do rc = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
      while (rc != 0 && errno == EINTR);
      STRATA_CHECK(rc == 0, "cannot preallocate ", format_bytes(bytes), " for NVMe store file ", path, ": ",
                   errno_text(errno), "; lower the nvme budget or choose a directory with more free space");
      sizes.push_back(bytes);
      remaining -= bytes;
    }
    alloc = std::make_unique<ExtentAllocator>(sizes, kAlignment);
  }

  void start_ring() {
    const int rc = io_uring_queue_init(opt.queue_depth, &ring, 0);
    STRATA_CHECK(rc == 0, "io_uring is unavailable (io_uring_queue_init: ", errno_text(-rc),
                 "); the NVMe tier needs it (see `strata info`)");
    ring_ready = true;
    if (!fds.empty()) {
      const int reg = io_uring_register_files(&ring, fds.data(), static_cast<unsigned>(fds.size()));
      fixed_files = reg == 0;
      if (!fixed_files) STRATA_LOG(kInfo, "io_uring_register_files failed ({}); using plain fds", errno_text(-reg));
    }
    reaper = std::thread([this] { reap(); });
  }

  int buffer_index(const char* p, size_t len) const {
    for (size_t i = 0; i < fixed_buffers.size(); ++i) {
      if (p >= fixed_buffers[i].first && p + len <= fixed_buffers[i].first + fixed_buffers[i].second) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  void reap() {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring, &cqe);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) {
        STRATA_LOG(kError, "io_uring_wait_cqe failed: {}", errno_text(-rc));
        continue;
      }
      auto* block = static_cast<Block*>(io_uring_cqe_get_data(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      if (block == nullptr) return;
      complete(block, res);
    }
  }

  std::string where(const IoOp& op, const Block& b) const {
    return paths[op.extent.file] + " offset " + std::to_string(b.file_offset) + " (block of " +
           std::to_string(b.len) + " bytes)";
  }

  void complete(Block* b, int res) {
    STRATA_TSAN_ACQUIRE(b);
    {
      // Taken first: the block travelled through the kernel, and this lock is
      // what orders its fields (written before submit() took it) for this thread.
      std::lock_guard<std::mutex> lock(mu);
      IoOp& op = *b->op;
      if (b->fate.error != 0) res = -b->fate.error;
      if (b->fate.shorten && res > 0) res = res / 2;
      if (b->fate.corrupt && op.is_read && res > 0) b->buf[b->fate.byte % b->len] ^= 0x5a;
      --inflight;
      ++stats.requests;
      if (op.error.empty()) {
        if (res < 0) {
          op.error = std::string("NVMe ") + (op.is_read ? "read" : "write") + " of chunk " + std::to_string(op.key) +
                     " failed at " + where(op, *b) + ": errno " + std::to_string(-res) + " (" + errno_text(-res) + ")";
        } else if (static_cast<size_t>(res) != b->len) {
          op.error = std::string("short NVMe ") + (op.is_read ? "read" : "write") + " of chunk " +
                     std::to_string(op.key) + " at " + where(op, *b) + ": " + std::to_string(res) + " of " +
                     std::to_string(b->len) + " bytes";
        }
      }
      if (res > 0) (op.is_read ? stats.bytes_read : stats.bytes_written) += static_cast<uint64_t>(res);
      if (--op.pending == 0) finish(op);
    }
    cv.notify_all();
    delete b;
  }

  // Called with `mu` held once every block of `op` completed.
  void finish(IoOp& op) {
    if (!op.is_read && !op.raw) {
      if (op.error.empty()) {
        const auto it = records.find(op.key);
        if (it != records.end()) alloc->free(it->second.extent);
        records[op.key] = Record{op.extent, op.checksum, op.bytes};
      } else {
        alloc->free(op.extent);  // the previous copy, if any, stays the chunk's record
      }
      stats.used = alloc->used();
      stats.chunks = records.size();
    }
    op.done = true;
  }

  void submit(const IoTicket& op) {
    std::vector<Block*> blocks;
    for (size_t done = 0; done < op->bytes; done += opt.block_bytes) {
      const size_t len = std::min(opt.block_bytes, op->bytes - done);
      auto* b = new Block{op, op->extent.offset + done, len, op->buf + done, buffer_index(op->buf + done, len),
                          opt.faults ? opt.faults->next() : FaultInjector::Fate{}};
      blocks.push_back(b);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      op->pending = static_cast<int>(blocks.size());
    }
    size_t next = 0;
    while (next < blocks.size()) {
      unsigned n;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return inflight < opt.queue_depth; });
        n = static_cast<unsigned>(std::min<size_t>(opt.queue_depth - inflight, blocks.size() - next));
        inflight += n;
      }
      std::lock_guard<std::mutex> lock(submit_mu);
      for (unsigned k = 0; k < n; ++k) {
        Block* b = blocks[next + k];
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        STRATA_ASSERT(sqe != nullptr, "submission queue full with ", inflight, " of ", opt.queue_depth, " in flight");
        const int fd = fixed_files ? op->extent.file : fds[op->extent.file];
        if (op->is_read) {
          if (b->buf_index >= 0) {
            io_uring_prep_read_fixed(sqe, fd, b->buf, static_cast<unsigned>(b->len), b->file_offset, b->buf_index);
          } else {
            io_uring_prep_read(sqe, fd, b->buf, static_cast<unsigned>(b->len), b->file_offset);
          }
        } else if (b->buf_index >= 0) {
          io_uring_prep_write_fixed(sqe, fd, b->buf, static_cast<unsigned>(b->len), b->file_offset, b->buf_index);
        } else {
          io_uring_prep_write(sqe, fd, b->buf, static_cast<unsigned>(b->len), b->file_offset);
        }
        if (fixed_files) sqe->flags |= IOSQE_FIXED_FILE;
        io_uring_sqe_set_data(sqe, b);
        STRATA_TSAN_RELEASE(b);
      }
      int rc;
      do rc = io_uring_submit(&ring);
      while (rc == -EINTR || rc == -EAGAIN);
      STRATA_CHECK_NEG_ERRNO(rc, "submitting NVMe requests for chunk ", op->key);
      next += n;
    }
  }

  void check_buffer(const void* p, size_t bytes, const char* what, int64_t key) const {
    STRATA_CHECK(bytes > 0, "NVMe ", what, " of chunk ", key, " with zero bytes");
    if (opt.direct_io) {
      STRATA_CHECK(reinterpret_cast<uintptr_t>(p) % kAlignment == 0 && bytes % kAlignment == 0, "NVMe ", what,
                   " of chunk ", key, ": O_DIRECT needs a 4096-byte aligned buffer and size, got ", p, " and ", bytes,
                   " bytes");
    }
  }
};

NvmeStore::NvmeStore(NvmeStoreOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.opt = std::move(options);
  STRATA_CHECK(s.opt.queue_depth >= 1 && s.opt.queue_depth <= 4096, "NVMe queue depth must be in [1, 4096], got ",
               s.opt.queue_depth);
  STRATA_CHECK(s.opt.block_bytes >= kAlignment && s.opt.block_bytes % kAlignment == 0,
               "NVMe block size must be a multiple of 4096 bytes, got ", s.opt.block_bytes);
  make_private_dir(s.opt.directory);
  s.reclaim_leftovers();
  s.create_files();
  s.start_ring();
  s.stats.capacity = s.alloc->capacity();
  STRATA_CHECK(s.opt.staging_blocks >= 2, "the NVMe store needs at least 2 staging blocks, got ", s.opt.staging_blocks);
  s.staging_pinned = true;
  for (unsigned i = 0; i < s.opt.staging_blocks; ++i) {
    char* p = static_cast<char*>(std::aligned_alloc(kAlignment, s.opt.block_bytes));
    STRATA_CHECK(p != nullptr, "cannot allocate NVMe staging buffers");
    s.staging.push_back(p);
    s.staging_pinned = cuda::host_register(p, s.opt.block_bytes) && s.staging_pinned;
  }
  s.register_all_buffers();
}

NvmeStore::~NvmeStore() = default;

IoTicket NvmeStore::write_async(int64_t key, const void* src, size_t bytes) {
  Impl& s = *impl_;
  s.check_buffer(src, bytes, "write", key);
  auto op = make_op(false, key, const_cast<void*>(src), bytes);
  op->checksum = XXH3_64bits(src, bytes);
  op->extent = s.allocate_extent(key, bytes);
  s.submit(op);
  return op;
}

IoTicket NvmeStore::read_async(int64_t key, void* dst, size_t bytes) {
  Impl& s = *impl_;
  s.check_buffer(dst, bytes, "read", key);
  auto op = make_op(true, key, dst, bytes);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const auto it = s.records.find(key);
    STRATA_CHECK(it != s.records.end(), "NVMe read of chunk ", key, ": the chunk is not in the store");
    STRATA_CHECK(it->second.bytes == bytes, "NVMe read of chunk ", key, " asks for ", bytes, " bytes but ",
                 it->second.bytes, " are stored");
    op->extent = it->second.extent;
    op->checksum = it->second.checksum;
  }
  s.submit(op);
  return op;
}

void NvmeStore::wait(const IoTicket& ticket) {
  Impl& s = *impl_;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    s.cv.wait(lock, [&] { return ticket->done; });
  }
  test(ticket);
}

bool NvmeStore::test(const IoTicket& op) {
  Impl& s = *impl_;
  bool verify = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!op->done) return false;
    verify = op->is_read && !op->raw && op->error.empty() && !op->verified;
  }
  if (verify) {
    // See Note [NVMe store integrity].
    const uint64_t got = XXH3_64bits(op->buf, op->bytes);
    std::lock_guard<std::mutex> lock(s.mu);
    op->verified = true;
    if (got != op->checksum) {
      char hex[64];
      std::snprintf(hex, sizeof(hex), "%016llx, read %016llx", static_cast<unsigned long long>(op->checksum),
                    static_cast<unsigned long long>(got));
      op->error = "NVMe chunk " + std::to_string(op->key) + " is corrupt: checksum mismatch reading " +
                  s.paths[op->extent.file] + " offset " + std::to_string(op->extent.offset) + " (" +
                  std::to_string(op->bytes) + " bytes): stored xxh3 " + hex;
    }
  }
  std::lock_guard<std::mutex> lock(s.mu);
  STRATA_CHECK(op->error.empty(), op->error);
  return true;
}

void NvmeStore::discard(int64_t key) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto it = impl_->records.find(key);
  if (it == impl_->records.end()) return;
  impl_->alloc->free(it->second.extent);
  impl_->records.erase(it);
  impl_->stats.used = impl_->alloc->used();
  impl_->stats.chunks = impl_->records.size();
}

bool NvmeStore::contains(int64_t key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->records.count(key) != 0;
}

void NvmeStore::register_buffers(const std::vector<std::pair<void*, size_t>>& regions) {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    STRATA_CHECK(s.inflight == 0, "register NVMe store buffers before starting I/O");
  }
  s.user_buffers.insert(s.user_buffers.end(), regions.begin(), regions.end());
  s.register_all_buffers();
}

void NvmeStore::read_streamed(int64_t key, size_t bytes, const BlockSink& sink) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> stream(s.stream_mu);
  Extent whole;
  uint64_t checksum = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const auto it = s.records.find(key);
    STRATA_CHECK(it != s.records.end(), "NVMe read of chunk ", key, ": the chunk is not in the store");
    STRATA_CHECK(it->second.bytes == bytes, "NVMe read of chunk ", key, " asks for ", bytes, " bytes but ",
                 it->second.bytes, " are stored");
    whole = it->second.extent;
    checksum = it->second.checksum;
  }
  const size_t block = s.opt.block_bytes, k = s.staging.size();
  const size_t n = (bytes + block - 1) / block;
  std::vector<IoTicket> slots(k);
  auto issue = [&](size_t i) {
    const size_t off = i * block;
    slots[i % k] = s.submit_raw(true, key, whole, off, s.staging[i % k], std::min(block, bytes - off));
  };
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  try {
    for (size_t i = 0; i < std::min(k, n); ++i) issue(i);
    for (size_t i = 0; i < n; ++i) {
      const size_t off = i * block, len = std::min(block, bytes - off);
      wait(slots[i % k]);
      slots[i % k].reset();
      XXH3_64bits_update(state, s.staging[i % k], len);
      sink(off, s.staging[i % k], len);
      if (i + k < n) issue(i + k);
    }
  } catch (...) {
    s.drain(slots);  // reads still landing in the staging blocks must finish first
    XXH3_freeState(state);
    throw;
  }
  const uint64_t got = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  STRATA_CHECK(got == checksum, "NVMe chunk ", key, " is corrupt: checksum mismatch streaming ",
               s.paths[whole.file], " offset ", whole.offset, " (", bytes, " bytes)");
}

void NvmeStore::write_streamed(int64_t key, size_t bytes, const BlockSource& source) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> stream(s.stream_mu);
  s.check_buffer(s.staging[0], bytes, "write", key);
  const Extent whole = s.allocate_extent(key, bytes);
  const size_t block = s.opt.block_bytes, k = s.staging.size();
  std::vector<IoTicket> slots(k);
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::string error;
  try {
    for (size_t off = 0, i = 0; off < bytes; off += block, ++i) {
      const size_t len = std::min(block, bytes - off);
      if (slots[i % k]) {
        std::vector<IoTicket> one{slots[i % k]};
        error = s.drain(one);
        slots[i % k].reset();
        if (!error.empty()) break;
      }
      source(off, s.staging[i % k], len);
      XXH3_64bits_update(state, s.staging[i % k], len);
      slots[i % k] = s.submit_raw(false, key, whole, off, s.staging[i % k], len);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string rest = s.drain(slots);
  if (error.empty()) error = rest;
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  std::lock_guard<std::mutex> lock(s.mu);
  if (!error.empty()) {
    s.alloc->free(whole);  // the previous copy, if any, stays the chunk's record
    STRATA_FAIL(error);
  }
  const auto it = s.records.find(key);
  if (it != s.records.end()) s.alloc->free(it->second.extent);
  s.records[key] = Impl::Record{whole, digest, bytes};
  s.stats.used = s.alloc->used();
  s.stats.chunks = s.records.size();
}

NvmeStoreStats NvmeStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

const std::vector<LeftoverFile>& NvmeStore::reclaimed_leftovers() const { return impl_->leftovers; }
const std::vector<std::string>& NvmeStore::files() const { return impl_->paths; }

std::string NvmeStore::describe() const {
  return "NVMe store in " + impl_->opt.directory + " (" + std::to_string(impl_->paths.size()) + " files, " +
         format_bytes(impl_->alloc ? impl_->alloc->capacity() : 0) + ")";
}

}  // namespace strata::offload
