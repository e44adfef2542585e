#pragma once
// SwapStore: the interface the `nvme` tier plugs into.
//
// The chunk manager keeps a chunk's bytes on the nvme tier by handing them to
// a SwapStore under the chunk's id. The real store is offload's NvmeStore
// (preallocated files, O_DIRECT io_uring, xxhash per chunk, fault
// injection; memory/nvme_swap_store.h adapts it); this header fixes what the
// manager relies on:
//  - write() either stores all bytes under `key` or throws strata::Error, and a
//    failed write leaves any earlier copy under `key` readable;
//  - read() returns exactly the bytes last written, or throws (short read,
//    checksum mismatch, EIO), naming the file, offset and chunk. It never
//    returns wrong data silently;
//  - host buffers passed in are aligned to alignment() and sizes are multiples of it;
//  - read_streamed / write_streamed move a chunk block by block through the
//    store's own staging buffers, handing each block to a callback while the
//    next ones are in flight (device <-> nvme without a host-tier copy), with
//    the same integrity and failure guarantees;
//  - view() maps the bytes stored under `key` read-only into memory, for
//    readers outside the manager (Note [Parameters on NVMe stay readable]);
//  - a stored copy stays readable after read() until it is written again or
//    discarded, and holds_same() tells whether it still equals a payload.
// The calls block the calling thread; the ChunkManager runs them without its
// lock held and on the copy engine for prefetches.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace strata::memory {

class SwapStore {
 public:
  virtual ~SwapStore() = default;

  virtual void write(int64_t key, const void* src, size_t bytes) = 0;
  virtual void read(int64_t key, void* dst, size_t bytes) = 0;
  /// Forgets `key`; its space can be reused. Never throws.
  virtual void discard(int64_t key) noexcept = 0;
  virtual size_t alignment() const noexcept = 0;
  virtual void read_streamed(int64_t key, size_t bytes,
                             const std::function<void(size_t offset, const void* data, size_t len)>& sink) = 0;
  virtual void write_streamed(int64_t key, size_t bytes,
                              const std::function<void(size_t offset, void* data, size_t len)>& source) = 0;
  /// The bytes stored under `key`, mapped read-only, valid while the mapping
  /// is held and `key` is neither written again nor discarded; null when the
  /// store cannot map them. Reads through it are not checksummed.
  virtual std::shared_ptr<const void> view(int64_t key) const {
    (void)key;
    return nullptr;
  }
  /// True when the bytes stored under `key` are known to equal `src[0,
  /// bytes)` without reading them (the store's checksum of the stored copy
  /// against one of `src`), so a chunk evicted unchanged need not be written
  /// again (Note [Clean copies on NVMe] in chunk_manager.h). False when
  /// unknown: a store that cannot tell never has a copy kept.
  virtual bool holds_same(int64_t key, const void* src, size_t bytes) const {
    (void)key, (void)src, (void)bytes;
    return false;
  }
  /// Whether holds_same() can ever answer true.
  virtual bool compares_copies() const noexcept { return false; }
  /// For messages: "nvme store at /scratch/strata (3 files)".
  virtual std::string describe() const = 0;
};

}  // namespace strata::memory
