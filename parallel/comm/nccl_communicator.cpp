// The NCCL communicator (communicator.h): NCCL's collectives on device
// buffers, enqueued on a CUDA stream of the communicator's own.
//
// Note [NCCL communicator]
// - Rendezvous: rank 0 creates the NCCL unique id and broadcasts it over a
//   bootstrap communicator (Gloo, which has a store and timeouts), then every
//   rank calls ncclCommInitRank on its device. split() splits the bootstrap
//   the same way and builds a new NCCL communicator over the group.
// - Order: operations are enqueued on the communicator's stream in issue
//   order (Note [Collectives are issued in order]). The NCCL communicator is
//   non-blocking (config.blocking = 0), so initialisation and the enqueueing
//   of an operation return at once and are polled to completion within the
//   timeout: a peer that never joins is an error too, not a hang. The stream is a blocking
//   one, so it runs after work already queued on the legacy default stream
//   (where LibTorch computes unless told otherwise); callers that compute on
//   other streams must synchronise them first.
// - Completion and timeouts: each operation records a CUDA event. Work::wait
//   polls it and ncclCommGetAsyncError; an operation not done within the
//   timeout aborts the NCCL communicator (ncclCommAbort, which also frees
//   kernels waiting for a dead peer) and fails with an Error naming it; the
//   communicator is then broken, as the Gloo one.
// - Dtypes: fp32, fp16 and bf16 (NCCL reduces all three natively).
// - Buffers: device memory as it is; host memory staged (Note [Host buffers
//   on NCCL]).
// - send/recv match by order between a pair of ranks; the tag is checked by
//   nobody (NCCL has none).
// Built when CUDA and NCCL are found (STRATA_HAVE_NCCL); it needs a GPU per
// rank to run, and its test skips without one.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "strata/core/error.h"
#include "strata/parallel/communicator.h"

#if defined(STRATA_HAVE_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace strata::parallel {

#if defined(STRATA_HAVE_NCCL)
namespace {

#define STRATA_CUDA_OK(expr)                                                                   \
  do {                                                                                         \
    const cudaError_t err_ = (expr);                                                           \
    STRATA_CHECK(err_ == cudaSuccess, #expr, " failed: ", cudaGetErrorString(err_));           \
  } while (0)

ncclDataType_t nccl_dtype(DType d) {
  switch (d) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
  }
  STRATA_FAIL("unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  STRATA_FAIL("unknown reduction");
}


// Device buffers for staging host memory (Note [Host buffers on NCCL]),
// kept for the next operation instead of a cudaMalloc and cudaFree each.
// Reuse needs no event: every operation runs on the communicator's one
// stream, so a buffer's next collective queues after its last one.
class StagingPool {
 public:
  StagingPool() = default;
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  ~StagingPool() {
    for (auto& [bytes, p] : free_) cudaFree(p);
  }
  /// A buffer of at least `bytes` (rounded up to a power of two, at least 1 MiB).
  std::pair<void*, size_t> take(size_t bytes) {
    size_t size = size_t{1} << 20;
    while (size < bytes) size *= 2;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = free_.find(size);
      if (it != free_.end()) {
        void* p = it->second;
        cached_ -= size;
        free_.erase(it);
        return {p, size};
      }
    }
    void* p = nullptr;
    STRATA_CUDA_OK(cudaMalloc(&p, size));
    return {p, size};
  }
  /// Keeps it while the pool holds at most kCachedBytes; frees it otherwise.
  void give(void* p, size_t size) noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + size <= kCachedBytes) {
        free_.emplace(size, p);
        cached_ += size;
        return;
      }
    }
    cudaFree(p);
  }

 private:
  static constexpr size_t kCachedBytes = size_t{256} << 20;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  size_t cached_ = 0;
};

// What the communicator and its Work handles share: the NCCL communicator,
// its stream, and the broken state after a failure or timeout.
struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::mutex mu;
  std::string broken;  // non-empty once an operation failed
  StagingPool staging;  // freed after the body below destroyed the stream (cudaFree waits for the device)

  ~NcclState() {
    if (comm != nullptr) {
      if (broken.empty()) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

// Note [Host buffers on NCCL]
// NCCL reads and writes device memory. A buffer in host memory (the
// engine's chunks on the host tier, a vector of flags) goes through a device
// buffer of the operation's own: the input is copied in on the
// communicator's stream before the collective, and the result copied back
// to the host buffer when the operation is waited for (Work::wait), so a
// dead peer is still a timeout, not a copy that never returns. Device
// buffers are used as they are. The staging buffers come from a pool of the
// communicator's (StagingPool).
struct Staging {
  std::shared_ptr<NcclState> state;  // whose pool the buffer goes back to
  void* device = nullptr;   // the operation's device buffer, or null: none needed
  size_t device_bytes = 0;
  void* host_out = nullptr;  // where the result goes back
  size_t out_offset = 0;     // of the result in `device`
  size_t out_bytes = 0;
  explicit Staging(std::shared_ptr<NcclState> s) : state(std::move(s)) {}
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (device != nullptr) state->staging.give(device, device_bytes);
  }
};

bool on_device(const void* p) {
  if (p == nullptr) return true;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, cudaEvent_t event, std::string what,
           std::unique_ptr<Staging> staging = nullptr)
      : state_(std::move(state)), event_(event), what_(std::move(what)), staging_(std::move(staging)) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  void wait() override {
    if (done_) return rethrow();
    const auto deadline = std::chrono::steady_clock::now() + state_->timeout;
    for (;;) {
      const cudaError_t q = cudaEventQuery(event_);
      if (q == cudaSuccess) {
        done_ = true;
        if (staging_ && staging_->host_out != nullptr && staging_->out_bytes > 0) {
          const cudaError_t back = cudaMemcpy(staging_->host_out,
                                              static_cast<const char*>(staging_->device) + staging_->out_offset,
                                              staging_->out_bytes, cudaMemcpyDeviceToHost);
          if (back != cudaSuccess) {
            done_ = false;
            return fail(fmt::format("copying the result back to host memory: {}", cudaGetErrorString(back)));
          }
        }
        staging_.reset();
        return;
      }
      if (q != cudaErrorNotReady) {
        return fail(fmt::format("CUDA error {}", cudaGetErrorString(q)));
      }
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard<std::mutex> lock(state_->mu);
        if (state_->comm == nullptr) return fail(state_->broken);  // aborted by an earlier failure
        ncclCommGetAsyncError(state_->comm, &async);
      }
      if (async != ncclSuccess && async != ncclInProgress) return fail(ncclGetErrorString(async));
      if (std::chrono::steady_clock::now() >= deadline) {
        return fail(fmt::format("timed out (timeout {} ms); a peer has died, or is stuck before issuing the same "
                                "collective", state_->timeout.count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  bool done() const override { return done_ || cudaEventQuery(event_) != cudaErrorNotReady; }

 private:
  void fail(const std::string& why) {
    done_ = true;
    error_ = fmt::format("{} on rank {} of {} failed: {}", what_, state_->rank, state_->size, why);
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->broken.empty()) {
      state_->broken = fmt::format("the communicator broke at an earlier {}", what_);
      ncclCommAbort(state_->comm);  // frees kernels still waiting for peers
      state_->comm = nullptr;
    }
    rethrow();
  }
  void rethrow() const {
    if (!error_.empty()) throw Error(error_, __FILE__, __LINE__);
  }

  std::shared_ptr<NcclState> state_;
  cudaEvent_t event_ = nullptr;
  std::string what_;
  std::unique_ptr<Staging> staging_;  // Note [Host buffers on NCCL]
  bool done_ = false;
  std::string error_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, int device, CommunicatorOptions options)
      : bootstrap_(std::move(bootstrap)), options_(options), state_(std::make_shared<NcclState>()) {
    NcclState& s = *state_;
    s.device = device;
    s.rank = bootstrap_->rank();
    s.size = bootstrap_->world_size();
    s.timeout = options.timeout;
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (s.rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      STRATA_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(r));
    }
    static_assert(sizeof(ncclUniqueId) % sizeof(float) == 0, "the id travels as fp32 words");
    bootstrap_->broadcast(&id, sizeof id / sizeof(float), DType::kFloat32, 0)->wait();
    STRATA_CUDA_OK(cudaSetDevice(device));
    STRATA_CUDA_OK(cudaStreamCreate(&s.stream));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&s.comm, s.size, id, s.rank, &config);
    const std::string what = fmt::format("ncclCommInitRank on rank {} of {} (device {})", s.rank, s.size, device);
    STRATA_CHECK(r == ncclSuccess || r == ncclInProgress, what, " failed: ", ncclGetErrorString(r),
                 "; every rank needs a GPU of its own");
    settle(what);
  }

  int rank() const override { return state_->rank; }
  int world_size() const override { return state_->size; }
  std::string backend() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  WorkHandle all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) override {
    const size_t bytes = count * dtype_size(dtype);
    return enqueue(fmt::format("all_reduce ({}) of {} {}", reduce_op_name(op), count, dtype_name(dtype)),
                   buf, bytes, buf, bytes, /*in_place=*/true, [&](const void* in, void* out, ncclComm_t c, cudaStream_t st) {
      return ncclAllReduce(in, out, count, nccl_dtype(dtype), nccl_op(op), c, st);
    });
  }
  WorkHandle reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op) override {
    const size_t bytes = count * dtype_size(dtype);
    return enqueue(fmt::format("reduce_scatter ({}) of {} x {} {}", reduce_op_name(op), world_size(), count, dtype_name(dtype)),
                   in, bytes * world_size(), out, bytes, false, [&](const void* i, void* o, ncclComm_t c, cudaStream_t st) {
                     return ncclReduceScatter(i, o, count, nccl_dtype(dtype), nccl_op(op), c, st);
                   });
  }
  WorkHandle all_gather(const void* in, void* out, size_t count, DType dtype) override {
    const size_t bytes = count * dtype_size(dtype);
    return enqueue(fmt::format("all_gather of {} x {} {}", world_size(), count, dtype_name(dtype)),
                   in, bytes, out, bytes * world_size(), false, [&](const void* i, void* o, ncclComm_t c, cudaStream_t st) {
                     return ncclAllGather(i, o, count, nccl_dtype(dtype), c, st);
                   });
  }
  WorkHandle broadcast(void* buf, size_t count, DType dtype, int root) override {
    STRATA_CHECK(root >= 0 && root < world_size(), "broadcast root ", root, " is not a rank of ", world_size());
    const size_t bytes = count * dtype_size(dtype);
    return enqueue(fmt::format("broadcast from rank {} of {} {}", root, count, dtype_name(dtype)),
                   buf, bytes, buf, bytes, true, [&](const void* i, void* o, ncclComm_t c, cudaStream_t st) {
                     return ncclBroadcast(i, o, count, nccl_dtype(dtype), root, c, st);
                   });
  }
  WorkHandle all_to_all(const void* in_buf, void* out_buf, size_t count, DType dtype) override {
    const size_t bytes = count * dtype_size(dtype);
    return enqueue(fmt::format("all_to_all of {} x {} {}", world_size(), count, dtype_name(dtype)),
                   in_buf, bytes * world_size(), out_buf, bytes * world_size(), false,
                   [&](const void* in, void* out, ncclComm_t c, cudaStream_t st) {
                     ncclResult_t r = ncclGroupStart();
                     for (int peer = 0; peer < world_size() && r == ncclSuccess; ++peer) {
                       r = ncclSend(static_cast<const char*>(in) + peer * bytes, count, nccl_dtype(dtype), peer, c, st);
                       if (r == ncclSuccess) {
                         r = ncclRecv(static_cast<char*>(out) + peer * bytes, count, nccl_dtype(dtype), peer, c, st);
                       }
                     }
                     const ncclResult_t end = ncclGroupEnd();
                     return r != ncclSuccess ? r : end;
                   });
  }
  WorkHandle send(const void* buf, size_t bytes, int peer, uint32_t tag) override {
    check_peer(peer);
    return enqueue(fmt::format("send of {} bytes to rank {} (tag {})", bytes, peer, tag), buf, bytes, nullptr, 0, false,
                   [&](const void* in, void*, ncclComm_t c, cudaStream_t st) {
                     return ncclSend(in, bytes, ncclUint8, peer, c, st);
                   });
  }
  WorkHandle recv(void* buf, size_t bytes, int peer, uint32_t tag) override {
    check_peer(peer);
    return enqueue(fmt::format("recv of {} bytes from rank {} (tag {})", bytes, peer, tag), nullptr, 0, buf, bytes,
                   false, [&](const void*, void* out, ncclComm_t c, cudaStream_t st) {
                     return ncclRecv(out, bytes, ncclUint8, peer, c, st);
                   });
  }
  WorkHandle barrier() override {
    if (scratch_ == nullptr) {
      STRATA_CUDA_OK(cudaSetDevice(state_->device));
      STRATA_CUDA_OK(cudaMalloc(&scratch_, sizeof(float)));
    }
    return enqueue("barrier", scratch_, sizeof(float), scratch_, sizeof(float), true,
                   [&](const void* in, void* out, ncclComm_t c, cudaStream_t st) {
                     return ncclAllReduce(in, out, 1, ncclFloat32, ncclSum, c, st);
                   });
  }

  std::unique_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name) override {
    std::shared_ptr<Communicator> group = bootstrap_->split(ranks, name);
    return std::make_unique<NcclCommunicator>(std::move(group), state_->device, options_);
  }

  ~NcclCommunicator() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
  }

 private:
  // Polls the non-blocking communicator until the call in progress is
  // through; past the timeout the NCCL communicator is aborted.
  void settle(const std::string& what) {
    NcclState& s = *state_;
    const auto deadline = std::chrono::steady_clock::now() + s.timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(s.comm, &state);
      if (state == ncclSuccess) return;
      const bool late = std::chrono::steady_clock::now() >= deadline;
      if (state != ncclInProgress || late) {
        s.broken = fmt::format("the communicator broke at an earlier {}", what);
        ncclCommAbort(s.comm);
        s.comm = nullptr;
        STRATA_FAIL(what, " on rank ", s.rank, " of ", s.size, " failed: ",
                    late ? fmt::format("not through within the timeout of {} ms; a peer has died or not joined",
                                       s.timeout.count())
                         : std::string(ncclGetErrorString(state)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void check_peer(int peer) const {
    STRATA_CHECK(peer >= 0 && peer < world_size() && peer != rank(), "peer ", peer, " is not another rank of ",
                 world_size());
  }

  // Issues fn(in, out) on the communicator's stream, with host buffers
  // staged through a device buffer (Note [Host buffers on NCCL]). `in` is
  // read (in_bytes), `out` written (out_bytes); in place, they are the same.
  template <typename Fn>
  WorkHandle enqueue(const std::string& what, const void* in, size_t in_bytes, void* out, size_t out_bytes,
                     bool in_place, Fn fn) {
    std::lock_guard<std::mutex> lock(state_->mu);
    STRATA_CHECK(state_->broken.empty(), what, ": ", state_->broken, " on rank ", state_->rank, " of ",
                 state_->size);
    STRATA_CUDA_OK(cudaSetDevice(state_->device));
    std::unique_ptr<Staging> staging;
    const bool stage_in = in_bytes > 0 && !on_device(in), stage_out = out_bytes > 0 && !on_device(out);
    if (stage_in || stage_out) {
      staging = std::make_unique<Staging>(state_);
      const size_t in_room = in_place ? 0 : (in_bytes + 255) / 256 * 256;
      std::tie(staging->device, staging->device_bytes) = state_->staging.take(in_room + std::max(in_bytes, out_bytes));
      char* dev_in = static_cast<char*>(staging->device);
      char* dev_out = dev_in + in_room;
      if (stage_in) {
        STRATA_CUDA_OK(cudaMemcpyAsync(dev_in, in, in_bytes, cudaMemcpyHostToDevice, state_->stream));
        in = dev_in;
      }
      if (stage_out) {
        staging->host_out = out;
        staging->out_offset = in_room;
        staging->out_bytes = out_bytes;
        out = dev_out;
      }
    }
    const ncclResult_t r = fn(in, out, state_->comm, state_->stream);
    STRATA_CHECK(r == ncclSuccess || r == ncclInProgress, what, " on rank ", state_->rank, " of ", state_->size,
                 " could not be issued: ", ncclGetErrorString(r));
    if (r == ncclInProgress) settle(what);
    cudaEvent_t event = nullptr;
    STRATA_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    STRATA_CUDA_OK(cudaEventRecord(event, state_->stream));
    return std::make_shared<NcclWork>(state_, event, what, std::move(staging));
  }

  std::shared_ptr<Communicator> bootstrap_;
  CommunicatorOptions options_;
  std::shared_ptr<NcclState> state_;
  void* scratch_ = nullptr;
};

}  // namespace

bool nccl_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, int device,
                                                     CommunicatorOptions options) {
  STRATA_CHECK(bootstrap != nullptr, "the NCCL communicator needs a bootstrap communicator (Gloo)");
  return std::make_unique<NcclCommunicator>(std::move(bootstrap), device, options);
}

#undef STRATA_CUDA_OK  // a unity batch's later files (Note [Unity builds of the LibTorch targets])

#else  // no NCCL in this build

bool nccl_available() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator>, int, CommunicatorOptions) {
  STRATA_FAIL("this strata was built without NCCL (CUDA and NCCL were not found at configure time); use the Gloo "
              "communicator");
}

#endif

}  // namespace strata::parallel
