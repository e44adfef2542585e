#pragma once
// NvmeStore: chunk payloads on local disk, through io_uring and O_DIRECT.
//
// Files: the store lives in a user-chosen directory (created 0700), in one or
// a few files (0600) preallocated with fallocate; an ExtentAllocator inside
// them hands out one extent per stored chunk and reuses freed ones.
//
// I/O: one io_uring of `queue_depth` entries. A transfer is split into blocks
// of `block_bytes`, each one request, so many requests are in flight and the
// device queue stays full; submissions are batched. Files are registered with
// the ring (IOSQE_FIXED_FILE), and buffers registered with register_buffers()
// are used with READ_FIXED / WRITE_FIXED. A reaper thread owns the completion
// queue; callers hold an IoTicket and wait() on it or test() it.
//
// Note [NVMe store integrity]
// Every write records an xxh3-64 of the bytes; every read recomputes it and
// compares. A checksum mismatch, a short transfer or an error completion
// (EIO, ENOSPC, ...) makes wait() throw strata::Error naming the file, the
// offset and the chunk: a wrong value is never returned silently. Writes go to
// a fresh extent and replace the chunk's record only when every block has
// completed, so a failed write leaves the previous copy readable.
//
// Cleanup: files are removed by the destructor. Each file is flock()ed while
// its store lives, so a new store finds files of crashed runs (lockable
// strata-store-*.bin), reports them and deletes them.
//
// Fault injection: a FaultInjector fails the Nth request with a chosen errno,
// shortens it, or flips a byte of a read, for tests.
//
// Sources by job: nvme_store.cpp (records, checksums, transfers and streamed
// staging), nvme_files.cpp (the directory, the files, their locks and the
// leftovers), nvme_ring.cpp (the io_uring and its reaper), fault_injector.cpp.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace strata::offload {

/// Test hooks counting block requests (one per io_uring submission entry),
/// reads and writes together, from the moment each is armed.
class FaultInjector {
 public:
  /// The nth request from now (1 = the next) completes with -error.
  void fail_request(int64_t nth, int error);
  /// The nth request from now completes with half its bytes.
  void shorten_request(int64_t nth);
  /// The nth request from now, if a read, has byte `byte` of its data flipped.
  void corrupt_request(int64_t nth, size_t byte = 0);

  struct Fate {
    int error = 0;
    bool shorten = false;
    bool corrupt = false;
    size_t byte = 0;
  };
  /// Called by the store once per submitted request.
  Fate next();

 private:
  std::atomic<int64_t> seen_{0};
  std::atomic<int64_t> fail_at_{-1}, short_at_{-1}, corrupt_at_{-1};
  std::atomic<int> error_{0};
  std::atomic<size_t> byte_{0};
};

struct NvmeStoreOptions {
  std::string directory;
  uint64_t capacity = 0;              // bytes of preallocated space
  uint64_t max_file_bytes = 1ull << 34;  // capacity is split over files of at most this size
  unsigned queue_depth = 32;
  size_t block_bytes = 1 << 20;       // transfers are split into blocks of this size
  bool direct_io = true;              // O_DIRECT (needs 4 KiB-aligned buffers and sizes)
  unsigned staging_blocks = 4;        // pinned, registered blocks for read_streamed / write_streamed
  std::shared_ptr<FaultInjector> faults;
};

struct LeftoverFile {
  std::string path;
  uint64_t bytes = 0;
};

struct NvmeStoreStats {
  uint64_t capacity = 0;
  uint64_t used = 0;
  uint64_t chunks = 0;
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t requests = 0;        // block requests completed
  uint64_t fixed_requests = 0;  // of the requests submitted, those through registered buffers (READ/WRITE_FIXED)
  size_t registered_buffers = 0;  // regions registered with the ring now: staging blocks and register_buffers()
};

struct IoOp;
/// A transfer in flight. Copyable; keeps the transfer's state alive.
using IoTicket = std::shared_ptr<IoOp>;

class NvmeStore {
 public:
  static constexpr size_t kAlignment = 4096;

  explicit NvmeStore(NvmeStoreOptions options);
  /// Waits for every transfer in flight, then removes the store's files.
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  /// Starts storing `bytes` from `src` under `key`. `src` must stay valid and
  /// unchanged until the ticket completes.
  IoTicket write_async(int64_t key, const void* src, size_t bytes);
  /// Starts reading the bytes stored under `key` into `dst` (exactly `bytes`).
  IoTicket read_async(int64_t key, void* dst, size_t bytes);
  /// Blocks until the transfer has completed; throws strata::Error if it failed.
  void wait(const IoTicket& ticket);
  /// True once complete (throws if it failed); never blocks.
  bool test(const IoTicket& ticket);

  void write(int64_t key, const void* src, size_t bytes) { wait(write_async(key, src, bytes)); }
  void read(int64_t key, void* dst, size_t bytes) { wait(read_async(key, dst, bytes)); }
  /// Called with each block of a streamed transfer, in order.
  using BlockSink = std::function<void(size_t offset, const void* data, size_t len)>;
  using BlockSource = std::function<void(size_t offset, void* data, size_t len)>;

  /// Note [Streamed transfers]
  /// Reads the chunk block by block into the store's staging buffers (pinned,
  /// registered with the ring) and hands block i to `sink` while blocks
  /// i+1.. are being read, so a copy onward (to a GPU) overlaps the disk. The
  /// checksum is computed on the fly and checked at the end: on a mismatch
  /// this throws after `sink` saw the blocks, and the caller must discard
  /// what it copied. One streamed transfer runs at a time per store.
  void read_streamed(int64_t key, size_t bytes, const BlockSink& sink);
  /// Stores `bytes` under `key`, asking `source` to fill each block while the
  /// previous blocks are written. Same guarantees as write(): on any failure
  /// the previous copy stays.
  void write_streamed(int64_t key, size_t bytes, const BlockSource& source);

  /// Frees the key's extent. Must not race with a transfer of the same key.
  void discard(int64_t key) noexcept;
  bool contains(int64_t key) const;
  /// True when `key` holds `bytes` bytes whose recorded xxh3-64 equals that
  /// of `src[0, bytes)`: the stored copy is the same bytes, but for a 2^-64
  /// chance per call (the odds Note [NVMe store integrity] already takes for
  /// a corrupt read). Never reads the disk. Must not race with a write of `key`.
  bool holds_same(int64_t key, const void* src, size_t bytes) const;

  /// Registers host memory for READ_FIXED / WRITE_FIXED (once, before I/O).
  void register_buffers(const std::vector<std::pair<void*, size_t>>& regions);

  NvmeStoreStats stats() const;
  const std::vector<LeftoverFile>& reclaimed_leftovers() const;
  const std::vector<std::string>& files() const;
  /// The bytes stored under `key`, mapped read-only (mmap of its extent,
  /// MAP_SHARED): valid while held and until `key` is written again or
  /// discarded. Not checksummed: readers that need the integrity guarantee
  /// use read(). Null when `key` is not stored or the mapping fails.
  std::shared_ptr<const void> view(int64_t key) const;
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::offload
