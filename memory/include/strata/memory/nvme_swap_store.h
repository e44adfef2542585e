#pragma once
// The nvme tier for the ChunkManager: a SwapStore over offload::NvmeStore
// (io_uring, O_DIRECT, checksummed extents in preallocated files).

#include <memory>
#include <string>

#include "strata/memory/swap_store.h"
#include "strata/offload/nvme_store.h"

namespace strata::memory {

class NvmeSwapStore final : public SwapStore {
 public:
  explicit NvmeSwapStore(offload::NvmeStoreOptions options) : store_(std::move(options)) {}

  void write(int64_t key, const void* src, size_t bytes) override { store_.write(key, src, bytes); }
  void read(int64_t key, void* dst, size_t bytes) override { store_.read(key, dst, bytes); }
  void discard(int64_t key) noexcept override { store_.discard(key); }
  size_t alignment() const noexcept override { return offload::NvmeStore::kAlignment; }
  void read_streamed(int64_t key, size_t bytes,
                     const std::function<void(size_t, const void*, size_t)>& sink) override {
    store_.read_streamed(key, bytes, sink);
  }
  void write_streamed(int64_t key, size_t bytes, const std::function<void(size_t, void*, size_t)>& source) override {
    store_.write_streamed(key, bytes, source);
  }
  std::shared_ptr<const void> view(int64_t key) const override { return store_.view(key); }
  bool holds_same(int64_t key, const void* src, size_t bytes) const override {
    return store_.holds_same(key, src, bytes);
  }
  bool compares_copies() const noexcept override { return true; }
  std::string describe() const override { return store_.describe(); }

  offload::NvmeStore& store() { return store_; }

 private:
  offload::NvmeStore store_;
};

}  // namespace strata::memory
