// The Gloo communicator (communicator.h): Gloo's collectives on host buffers
// over TCP, rendezvous through LibTorch's c10d::TCPStore.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fmt/format.h>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "strata/core/error.h"
#include "strata/kernels/optim.h"
#include "strata/parallel/communicator.h"
#include "../torch_compat.h"

namespace strata::parallel {
namespace {

// Gloo's store interface over c10d's TCPStore (the same store torchrun's
// processes meet at), so strata does not run a store of its own.
class C10dStore final : public gloo::rendezvous::Store {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::vector<uint8_t> v = store_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

class GlooWork final : public Work {
 public:
  explicit GlooWork(std::shared_future<void> f) : f_(std::move(f)) {}
  void wait() override { f_.get(); }
  bool done() const override { return f_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }

 private:
  std::shared_future<void> f_;
};

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

template <typename T>
ReduceFn reduce_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &gloo::sum<T>;
    case ReduceOp::kMax: return &gloo::max<T>;
    case ReduceOp::kMin: return &gloo::min<T>;
  }
  STRATA_FAIL("unknown reduce op");
}

// Note [bf16 over Gloo]
// Gloo has no bf16 type, so bf16 reductions use a reduce function of our own
// over raw 16-bit words: each pair is widened to fp32, combined and rounded
// back to bf16 (round to nearest even, as kernels::cast), block by block
// through kernels::cast. Every partial sum is rounded to bf16, as NCCL's own
// bf16 reductions do; a sum is the same on every rank, since the blocks meet
// in the same order everywhere.
template <ReduceOp Op>
void reduce_bf16(void* c, const void* a, const void* b, size_t n) {
  constexpr size_t kBlock = 2048;
  float fa[kBlock], fb[kBlock];
  for (size_t at = 0; at < n; at += kBlock) {
    const size_t len = std::min(kBlock, n - at);
    const auto* pa = static_cast<const uint16_t*>(a) + at;
    const auto* pb = static_cast<const uint16_t*>(b) + at;
    kernels::cast(pa, DType::kBFloat16, fa, DType::kFloat32, static_cast<int64_t>(len));
    kernels::cast(pb, DType::kBFloat16, fb, DType::kFloat32, static_cast<int64_t>(len));
    for (size_t i = 0; i < len; ++i) {
      fa[i] = Op == ReduceOp::kSum ? fa[i] + fb[i] : Op == ReduceOp::kMax ? std::max(fa[i], fb[i]) : std::min(fa[i], fb[i]);
    }
    kernels::cast(fa, DType::kFloat32, static_cast<uint16_t*>(c) + at, DType::kBFloat16, static_cast<int64_t>(len));
  }
}

ReduceFn reduce_fn_of(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kFloat32: return reduce_fn<float>(op);
    case DType::kFloat16: return reduce_fn<gloo::float16>(op);
    case DType::kBFloat16:
      switch (op) {
        case ReduceOp::kSum: return &reduce_bf16<ReduceOp::kSum>;
        case ReduceOp::kMax: return &reduce_bf16<ReduceOp::kMax>;
        case ReduceOp::kMin: return &reduce_bf16<ReduceOp::kMin>;
      }
  }
  STRATA_FAIL("unknown dtype or reduce op");
}

// See Note [Collectives are issued in order].
class GlooCommunicator final : public Communicator {
 public:
  // What every communicator of a job shares: the rendezvous store and the
  // TCP device. Groups made by split() connect their own contexts through it.
  struct World {
    c10::intrusive_ptr<c10d::Store> store;
    std::shared_ptr<gloo::transport::Device> device;
  };

  // Connects this rank's context of the group `prefix` (`size` ranks).
  GlooCommunicator(std::shared_ptr<World> world, int rank, int size, std::string prefix, CommunicatorOptions o)
      : rank_(rank), size_(size), options_(o), world_(std::move(world)), prefix_(std::move(prefix)) {
    C10dStore store(world_->store);
    gloo::rendezvous::PrefixStore prefixed(prefix_, store);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(o.timeout);
    context->connectFullMesh(prefixed, world_->device);
    context_ = context;
    worker_ = std::thread([this] { run(); });
  }

  static std::unique_ptr<Communicator> connect(const Rendezvous& r, CommunicatorOptions o) {
    STRATA_CHECK(r.world_size >= 1 && r.rank >= 0 && r.rank < r.world_size, "rank ", r.rank, " of world size ",
                 r.world_size, " is not a valid rank (RANK, WORLD_SIZE)");
    STRATA_CHECK(r.master_port > 0 && r.master_port < 65536, "MASTER_PORT ", r.master_port, " is not a TCP port");
    try {
      c10d::TCPStoreOptions so;
      so.port = static_cast<uint16_t>(r.master_port);
      so.isServer = r.rank == 0;
      so.numWorkers = static_cast<size_t>(r.world_size);
      so.waitWorkers = false;
      so.timeout = o.timeout;
      auto world = std::make_shared<World>();
      // One rank meets no one: an in-process store, no port (two single
      // processes on one machine would otherwise both bind MASTER_PORT).
      world->store = r.world_size == 1 ? c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::HashStore>())
                                       : c10::intrusive_ptr<c10d::Store>(torch_compat::start_tcp_store(r.master_addr, so));
      gloo::transport::tcp::attr attr;
      attr.hostname = o.bind_host;
      world->device = gloo::transport::tcp::CreateDevice(attr);
      return std::make_unique<GlooCommunicator>(world, r.rank, r.world_size, "strata-gloo", o);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      STRATA_FAIL("rank ", r.rank, " of ", r.world_size, " could not meet the others at ", r.master_addr, ":",
                  r.master_port, " within ", o.timeout.count(), " ms: ", e.what(),
                  " (are all ranks started, with the same MASTER_ADDR and MASTER_PORT?)");
    }
  }

  std::unique_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name) override {
    const auto me = std::find(ranks.begin(), ranks.end(), rank_);
    STRATA_CHECK(me != ranks.end(), "rank ", rank_, " is not in the group \"", name, "\" it tries to join");
    for (size_t i = 0; i < ranks.size(); ++i) {
      STRATA_CHECK(ranks[i] >= 0 && ranks[i] < size_, "group \"", name, "\": rank ", ranks[i], " is not a rank of ",
                   size_);
      STRATA_CHECK(std::count(ranks.begin(), ranks.end(), ranks[i]) == 1, "group \"", name, "\" lists rank ",
                   ranks[i], " twice");
    }
    try {
      // A name used again is a new group: every member counts its joins in
      // the store, and since no member can finish forming a group before all
      // have joined it, join / size is the same generation on every member.
      const std::string group = prefix_ + "/" + name;
      const int64_t joins = world_->store->add(group + "/joins", 1);
      const int64_t generation = (joins - 1) / static_cast<int64_t>(ranks.size());
      return std::make_unique<GlooCommunicator>(world_, static_cast<int>(me - ranks.begin()),
                                                static_cast<int>(ranks.size()),
                                                group + "#" + std::to_string(generation), options_);
    } catch (const std::exception& e) {
      STRATA_FAIL("rank ", rank_, " could not form the group \"", name, "\" of ", ranks.size(), " ranks within ",
                  options_.timeout.count(), " ms: ", e.what(), " (does every member create it?)");
    }
  }

  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string backend() const override { return "gloo"; }

  WorkHandle all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) override {
    const std::string what = fmt::format("all_reduce ({}) of {} {}", reduce_op_name(op), count, dtype_name(dtype));
    check_reducible(dtype, what);
    return submit(what, count, [=](uint32_t tag) {
      gloo::AllreduceOptions o(context_);
      o.setTag(tag);
      o.setTimeout(options_.timeout);
      if (dtype == DType::kFloat32) {
        o.setOutput(static_cast<float*>(buf), count);
      } else {  // fp16, or bf16 as 16-bit words (Note [bf16 over Gloo])
        o.setOutput(static_cast<gloo::float16*>(buf), count);
      }
      o.setReduceFunction(reduce_fn_of(dtype, op));
      gloo::allreduce(o);
    });
  }

  // Gloo's all_to_all moves block r of every rank to rank r, which then
  // reduces the world_size blocks it received: each rank sends and receives
  // (world_size - 1) / world_size of the buffer, as a ring reduce-scatter
  // does. (Gloo's ReduceScatterHalvingDoubling leaves the blocks of some ranks
  // in bit-reversed places for world sizes above 2; the tests caught it.)
  WorkHandle reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op) override {
    const std::string what = fmt::format("reduce_scatter ({}) of {} x {} {}", reduce_op_name(op), size_, count, dtype_name(dtype));
    check_reducible(dtype, what);
    const size_t esize = dtype_size(dtype);
    return submit(what, count, [=](uint32_t tag) {
      std::vector<uint8_t> blocks(count * esize * size_);
      gloo::AlltoallOptions o(context_);
      o.setTag(tag);
      o.setTimeout(options_.timeout);
      o.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), blocks.size());
      o.setOutput(blocks.data(), blocks.size());
      gloo::alltoall(o);
      const ReduceFn fn = reduce_fn_of(dtype, op);
      std::memcpy(out, blocks.data(), count * esize);
      for (int r = 1; r < size_; ++r) fn(out, out, blocks.data() + r * count * esize, count);
    });
  }

  WorkHandle all_gather(const void* in, void* out, size_t count, DType dtype) override {
    const size_t bytes = count * dtype_size(dtype);
    return submit(fmt::format("all_gather of {} x {} {}", size_, count, dtype_name(dtype)), count, [=](uint32_t tag) {
      // In place (`in` inside `out`, as ZeRO gathers a chunk from its own
      // shard): Gloo's input and output buffers must not overlap.
      const auto* src = static_cast<const uint8_t*>(in);
      const auto* dst = static_cast<const uint8_t*>(out);
      std::vector<uint8_t> copy;
      if (bytes > 0 && src < dst + bytes * size_ && dst < src + bytes) {
        copy.assign(src, src + bytes);
        src = copy.data();
      }
      gloo::AllgatherOptions o(context_);
      o.setTag(tag);
      o.setTimeout(options_.timeout);
      o.setInput(const_cast<uint8_t*>(src), bytes);
      o.setOutput(static_cast<uint8_t*>(out), bytes * size_);
      gloo::allgather(o);
    });
  }

  WorkHandle broadcast(void* buf, size_t count, DType dtype, int root) override {
    STRATA_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of ", size_);
    const size_t bytes = count * dtype_size(dtype);
    return submit(fmt::format("broadcast from rank {} of {} {}", root, count, dtype_name(dtype)), count,
                  [=](uint32_t tag) {
                    gloo::BroadcastOptions o(context_);
                    o.setTag(tag);
                    o.setTimeout(options_.timeout);
                    o.setRoot(root);
                    o.setOutput(static_cast<uint8_t*>(buf), bytes);
                    gloo::broadcast(o);
                  });
  }

  WorkHandle all_to_all(const void* in, void* out, size_t count, DType dtype) override {
    const size_t bytes = count * dtype_size(dtype);
    return submit(fmt::format("all_to_all of {} x {} {}", size_, count, dtype_name(dtype)), count, [=](uint32_t tag) {
      gloo::AlltoallOptions o(context_);
      o.setTag(tag);
      o.setTimeout(options_.timeout);
      o.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), bytes * size_);
      o.setOutput(static_cast<uint8_t*>(out), bytes * size_);
      gloo::alltoall(o);
    });
  }

  WorkHandle send(const void* buf, size_t bytes, int peer, uint32_t tag) override {
    return point_to_point(true, const_cast<void*>(buf), bytes, peer, tag);
  }
  WorkHandle recv(void* buf, size_t bytes, int peer, uint32_t tag) override {
    return point_to_point(false, buf, bytes, peer, tag);
  }

  WorkHandle barrier() override {
    return submit("barrier", 1, [=](uint32_t tag) {
      gloo::BarrierOptions o(context_);
      o.setTag(tag);
      o.setTimeout(options_.timeout);
      gloo::barrier(o);
    });
  }

 private:
  struct Op {
    std::string what;
    std::function<void(uint32_t)> fn;
    std::promise<void> done;
  };

  void check_reducible(DType dtype, const std::string& what) const {
    STRATA_CHECK(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16, what,
                 ": unknown dtype");
  }
  WorkHandle point_to_point(bool send, void* buf, size_t bytes, int peer, uint32_t tag) {
    STRATA_CHECK(peer >= 0 && peer < size_ && peer != rank_, "peer ", peer, " is not another rank of ", size_);
    const std::string what =
        fmt::format("{} of {} bytes {} rank {} (tag {})", send ? "send" : "recv", bytes, send ? "to" : "from", peer, tag);
    return submit(what, bytes, [=](uint32_t) {
      auto b = context_->createUnboundBuffer(buf, bytes);
      if (send) {
        b->send(peer, tag);
        STRATA_CHECK(b->waitSend(options_.timeout), "no progress");
      } else {
        b->recv(peer, tag);
        STRATA_CHECK(b->waitRecv(options_.timeout), "no progress");
      }
    });
  }

  WorkHandle submit(std::string what, size_t elements, std::function<void(uint32_t)> fn) {
    auto op = std::make_unique<Op>();
    op->what = std::move(what);
    std::shared_future<void> f = op->done.get_future().share();
    if (elements == 0) {
      // Nothing to exchange: every rank skips the same operation, so the order holds.
      op->done.set_value();
      return std::make_shared<GlooWork>(f);
    }
    op->fn = std::move(fn);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(op));
    }
    cv_.notify_one();
    return std::make_shared<GlooWork>(f);
  }

  void run() {
    for (;;) {
      std::unique_ptr<Op> op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!broken_.empty()) {
        op->done.set_exception(std::make_exception_ptr(Error(fmt::format("{}: {}", op->what, broken_), __FILE__, __LINE__)));
        continue;
      }
      try {
        op->fn(next_tag_++);
        op->done.set_value();
      } catch (const std::exception& e) {
        const std::string failed = fmt::format("{} on rank {} of {} failed or timed out (timeout {} ms): {}; a peer "
                                               "has died, or is stuck before issuing the same collective",
                                               op->what, rank_, size_, options_.timeout.count(), e.what());
        broken_ = "the communicator broke at an earlier " + failed;
        op->done.set_exception(std::make_exception_ptr(Error(failed, __FILE__, __LINE__)));
      }
    }
  }

  int rank_, size_;
  CommunicatorOptions options_;
  std::shared_ptr<World> world_;
  std::string prefix_;
  std::shared_ptr<gloo::Context> context_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  bool stop_ = false;
  std::string broken_;  // set by the worker only
  uint32_t next_tag_ = 1;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const Rendezvous& r, CommunicatorOptions options) {
  if (const char* host = std::getenv("STRATA_COMM_HOST"); host != nullptr && *host != '\0') options.bind_host = host;
  if (const char* t = std::getenv("STRATA_COMM_TIMEOUT"); t != nullptr && *t != '\0') {  // empty: unset
    const int seconds = env_int("STRATA_COMM_TIMEOUT", 300);
    STRATA_CHECK(seconds > 0, "STRATA_COMM_TIMEOUT must be a number of seconds above 0, got ", seconds);
    options.timeout = std::chrono::seconds(seconds);
  }
  return GlooCommunicator::connect(r, options);
}

}  // namespace strata::parallel
