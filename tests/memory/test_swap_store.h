#pragma once
// An in-memory SwapStore for tests of the chunk manager, until the offload
// issue's NvmeStore lands: it keeps the SwapStore contract (aligned buffers,
// whole-block transfers, a failed write keeps the previous copy) and can fail
// the Nth write or read, so the manager's failure paths are exercised.

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "strata/core/error.h"
#include "strata/memory/swap_store.h"

namespace strata::memory::testing {

class TestSwapStore final : public SwapStore {
 public:
  void write(int64_t key, const void* src, size_t bytes) override {
    check_aligned(src, bytes);
    ++writes_;
    STRATA_CHECK(writes_ != fail_write_at_, "injected write failure for chunk ", key);
    const auto* p = static_cast<const unsigned char*>(src);
    blocks_[key].assign(p, p + bytes);
  }
  void read(int64_t key, void* dst, size_t bytes) override {
    check_aligned(dst, bytes);
    ++reads_;
    STRATA_CHECK(reads_ != fail_read_at_, "injected read failure for chunk ", key);
    const auto it = blocks_.find(key);
    STRATA_CHECK(it != blocks_.end(), "chunk ", key, " is not in the store");
    STRATA_CHECK(it->second.size() == bytes, "short read of chunk ", key);
    std::memcpy(dst, it->second.data(), bytes);
  }
  void discard(int64_t key) noexcept override { blocks_.erase(key); }
  size_t alignment() const noexcept override { return 4096; }
  std::string describe() const override { return "test swap store"; }

  void fail_write_at(int n) { fail_write_at_ = writes_ + n; }
  void fail_read_at(int n) { fail_read_at_ = reads_ + n; }
  size_t stored_chunks() const { return blocks_.size(); }
  bool holds(int64_t key) const { return blocks_.count(key) != 0; }

 private:
  void check_aligned(const void* p, size_t bytes) const {
    STRATA_CHECK(reinterpret_cast<uintptr_t>(p) % alignment() == 0 && bytes % alignment() == 0,
                 "unaligned swap store transfer");
  }
  std::map<int64_t, std::vector<unsigned char>> blocks_;
  int64_t writes_ = 0, reads_ = 0;
  int64_t fail_write_at_ = -1, fail_read_at_ = -1;
};

}  // namespace strata::memory::testing
