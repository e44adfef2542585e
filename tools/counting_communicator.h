#pragma once
// A communicator wrapper that counts what this rank sends and how many
// collectives it joins, for the parallelism benchmarks (bench sequence, bench
// tp). Bytes follow the ring algorithms: all-reduce 2(n-1)/n of the buffer,
// all-gather and reduce-scatter (n-1) blocks, broadcast (n-1)/n of the buffer
// (scatter then all-gather), all-to-all the n-1 blocks that leave, point to
// point the payload. Groups split from it count into the same totals, or
// into those `counts_for_split` picks by the group's name.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/parallel/communicator.h"

namespace strata::tools {

class CountingCommunicator final : public parallel::Communicator {
 public:
  struct Counts {
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> calls{0};
  };
  explicit CountingCommunicator(parallel::Communicator& inner, std::shared_ptr<Counts> counts = nullptr)
      : inner_(inner), counts_(counts ? std::move(counts) : std::make_shared<Counts>()) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string backend() const override { return inner_.backend(); }
  parallel::WorkHandle all_reduce(void* buf, size_t count, DType dtype, parallel::ReduceOp op) override {
    add(2 * count * dtype_size(dtype) * (world_size() - 1) / world_size());
    return inner_.all_reduce(buf, count, dtype, op);
  }
  parallel::WorkHandle reduce_scatter(const void* in, void* out, size_t count, DType dtype,
                                      parallel::ReduceOp op) override {
    add(count * dtype_size(dtype) * (world_size() - 1));
    return inner_.reduce_scatter(in, out, count, dtype, op);
  }
  parallel::WorkHandle all_gather(const void* in, void* out, size_t count, DType dtype) override {
    add(count * dtype_size(dtype) * (world_size() - 1));
    return inner_.all_gather(in, out, count, dtype);
  }
  parallel::WorkHandle broadcast(void* buf, size_t count, DType dtype, int root) override {
    add(count * dtype_size(dtype) * (world_size() - 1) / world_size());
    return inner_.broadcast(buf, count, dtype, root);
  }
  parallel::WorkHandle all_to_all(const void* in, void* out, size_t count, DType dtype) override {
    add(count * dtype_size(dtype) * (world_size() - 1));
    return inner_.all_to_all(in, out, count, dtype);
  }
  parallel::WorkHandle send(const void* buf, size_t bytes, int peer, uint32_t tag) override {
    add(bytes);
    return inner_.send(buf, bytes, peer, tag);
  }
  parallel::WorkHandle recv(void* buf, size_t bytes, int peer, uint32_t tag) override {
    return inner_.recv(buf, bytes, peer, tag);
  }
  parallel::WorkHandle barrier() override { return inner_.barrier(); }
  /// The group, counting into this communicator's totals.
  std::unique_ptr<parallel::Communicator> split(const std::vector<int>& ranks, const std::string& name) override;
  /// Where groups split from this one count, by the group's name (null: here).
  std::function<std::shared_ptr<Counts>(const std::string& name)> counts_for_split;
  /// Bytes sent since the last take(), and resets them; the same for collectives.
  uint64_t take() { return counts_->bytes.exchange(0); }
  uint64_t take_calls() { return counts_->calls.exchange(0); }

 private:
  void add(uint64_t n) {
    counts_->bytes += n;
    counts_->calls += 1;
  }
  parallel::Communicator& inner_;
  std::shared_ptr<Counts> counts_;
};

// A group split from a CountingCommunicator: owns its inner communicator.
struct CountingGroup final : parallel::Communicator {
  CountingGroup(std::unique_ptr<parallel::Communicator> inner, std::shared_ptr<CountingCommunicator::Counts> counts)
      : inner(std::move(inner)), counting(*this->inner, std::move(counts)) {}
  std::unique_ptr<parallel::Communicator> inner;
  CountingCommunicator counting;
  int rank() const override { return counting.rank(); }
  int world_size() const override { return counting.world_size(); }
  std::string backend() const override { return counting.backend(); }
  parallel::WorkHandle all_reduce(void* b, size_t c, DType d, parallel::ReduceOp op) override {
    return counting.all_reduce(b, c, d, op);
  }
  parallel::WorkHandle reduce_scatter(const void* i, void* o, size_t c, DType d, parallel::ReduceOp op) override {
    return counting.reduce_scatter(i, o, c, d, op);
  }
  parallel::WorkHandle all_gather(const void* i, void* o, size_t c, DType d) override {
    return counting.all_gather(i, o, c, d);
  }
  parallel::WorkHandle broadcast(void* b, size_t c, DType d, int root) override {
    return counting.broadcast(b, c, d, root);
  }
  parallel::WorkHandle all_to_all(const void* i, void* o, size_t c, DType d) override {
    return counting.all_to_all(i, o, c, d);
  }
  parallel::WorkHandle send(const void* b, size_t n, int peer, uint32_t tag) override {
    return counting.send(b, n, peer, tag);
  }
  parallel::WorkHandle recv(void* b, size_t n, int peer, uint32_t tag) override {
    return counting.recv(b, n, peer, tag);
  }
  parallel::WorkHandle barrier() override { return counting.barrier(); }
  std::unique_ptr<parallel::Communicator> split(const std::vector<int>& ranks, const std::string& name) override {
    return counting.split(ranks, name);
  }
};

inline std::unique_ptr<parallel::Communicator> CountingCommunicator::split(const std::vector<int>& ranks,
                                                                           const std::string& name) {
  std::shared_ptr<Counts> counts = counts_for_split ? counts_for_split(name) : nullptr;
  return std::make_unique<CountingGroup>(inner_.split(ranks, name), counts ? std::move(counts) : counts_);
}

}  // namespace strata::tools
