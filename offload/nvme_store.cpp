#include "strata/offload/nvme_store.h"

// The store proper: chunk records and their checksums (Note [NVMe store
// integrity]), transfers split into block requests, and streamed transfers
// through the staging blocks. Its files are nvme_files.cpp, its io_uring
// nvme_ring.cpp, its fault injection fault_injector.cpp.
#include <sys/mman.h>
#include <xxhash.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "nvme_files.h"
#include "nvme_ring.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/offload/cuda_runtime.h"
#include "strata/offload/extent_allocator.h"

namespace strata::offload {

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
  FaultInjector::Fate fate;
};

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
  std::optional<detail::StoreFiles> files;
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

  std::mutex stream_mu;  // one streamed transfer at a time: it owns the staging blocks
  std::vector<char*> staging;
  bool staging_pinned = false;
  std::vector<std::pair<void*, size_t>> user_buffers;
  // Last: stopped first, while everything its completions touch still lives.
  std::optional<detail::IoRing> ring;

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
    std::vector<std::pair<char*, size_t>> regions;
    for (char* p : staging) regions.emplace_back(p, opt.block_bytes);
    for (const auto& [p, n] : user_buffers) regions.emplace_back(static_cast<char*>(p), n);
    ring->register_buffers(regions);
  }

  ~Impl() {
    if (ring) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return inflight == 0; });
    }
    ring.reset();
    for (char* p : staging) {
      if (staging_pinned) cuda::host_unregister(p);
      std::free(p);
    }
  }

  std::string where(const IoOp& op, const Block& b) const {
    return files->paths()[op.extent.file] + " offset " + std::to_string(b.file_offset) + " (block of " +
           std::to_string(b.len) + " bytes)";
  }

  void complete(Block* b, int res) {
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
                     " failed at " + where(op, *b) + ": " + errno_text(-res) + " (errno " + std::to_string(-res) + ")";
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
    std::vector<detail::IoRequest> requests;
    for (size_t done = 0; done < op->bytes; done += opt.block_bytes) {
      const size_t len = std::min(opt.block_bytes, op->bytes - done);
      auto* b = new Block{op, op->extent.offset + done, len, op->buf + done,
                          opt.faults ? opt.faults->next() : FaultInjector::Fate{}};
      requests.push_back({op->is_read, static_cast<int>(op->extent.file), b->file_offset, b->buf, len, b});
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      op->pending = static_cast<int>(requests.size());
    }
    size_t next = 0;
    while (next < requests.size()) {
      unsigned n;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return inflight < opt.queue_depth; });
        n = static_cast<unsigned>(std::min<size_t>(opt.queue_depth - inflight, requests.size() - next));
        inflight += n;
      }
      ring->submit(requests.data() + next, n);
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
  s.files.emplace(s.opt.directory, s.opt.capacity, s.opt.max_file_bytes, s.opt.direct_io, kAlignment);
  s.alloc = std::make_unique<ExtentAllocator>(s.files->sizes(), kAlignment);
  s.ring.emplace(s.opt.queue_depth, s.files->fds(),
                 [&s](void* block, int res) { s.complete(static_cast<Block*>(block), res); });
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
                  s.files->paths()[op->extent.file] + " offset " + std::to_string(op->extent.offset) + " (" +
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

bool NvmeStore::holds_same(int64_t key, const void* src, size_t bytes) const {
  uint64_t recorded = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    const auto it = impl_->records.find(key);
    if (it == impl_->records.end() || it->second.bytes != bytes) return false;
    recorded = it->second.checksum;
  }
  return XXH3_64bits(src, bytes) == recorded;  // hashed without the lock: completions take it
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
               s.files->paths()[whole.file], " offset ", whole.offset, " (", bytes, " bytes)");
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
  NvmeStoreStats s = impl_->stats;
  s.fixed_requests = impl_->ring->fixed_requests();
  s.registered_buffers = impl_->ring->registered_buffers();
  return s;
}

const std::vector<LeftoverFile>& NvmeStore::reclaimed_leftovers() const { return impl_->files->leftovers(); }
const std::vector<std::string>& NvmeStore::files() const { return impl_->files->paths(); }

std::shared_ptr<const void> NvmeStore::view(int64_t key) const {
  Impl& s = *impl_;
  Extent e;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);  // not held across the mmap: completions take it
    const auto it = s.records.find(key);
    if (it == s.records.end()) return nullptr;
    e = it->second.extent;
    bytes = it->second.bytes;
  }
  void* p = nullptr;
  const int fd = s.files->fds()[e.file];
  if (STRATA_SYSCALL_ERRNO(p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(e.offset))) != 0) {
    return nullptr;  // a view is an addition: the chunk stays readable through read()
  }
  return std::shared_ptr<const void>(p, [bytes](const void* q) { ::munmap(const_cast<void*>(q), bytes); });
}

std::string NvmeStore::describe() const {
  return "NVMe store in " + impl_->opt.directory + " (" + std::to_string(impl_->files->paths().size()) + " files, " +
         format_bytes(impl_->alloc ? impl_->alloc->capacity() : 0) + ")";
}

}  // namespace strata::offload
