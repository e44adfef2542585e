#pragma once
// Communicator: collectives between ranks, on contiguous buffers (chunks) and
// on tensors, with asynchronous handles and a timeout on every operation.
//
// Backends: Gloo (host memory, TCP; make_gloo_communicator) and NCCL (device
// memory, on a CUDA stream; make_nccl_communicator, built with CUDA and
// NCCL). Ranks find each other through a Rendezvous (rendezvous.h); the
// process groups of a job come from its DeviceMesh (device_mesh.h).
//
// Note [Collectives are issued in order]
// Every rank must issue the same collectives in the same order. A
// communicator runs its operations one at a time, in the order they were
// issued, on a thread of its own: the caller gets a Work handle at once and
// overlaps the collective with whatever it does next (backward, the next
// chunk). A collective that does not complete within the timeout (a peer died
// or is stuck before the same collective) fails with an Error naming the
// operation, its size, this rank and the world; the communicator is then
// broken, and every later operation fails at once with the same message.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/parallel/rendezvous.h"

namespace strata::parallel {

enum class ReduceOp { kSum, kMax, kMin };
inline const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until the operation completes; rethrows its Error.
  virtual void wait() = 0;
  /// Whether it has completed (successfully or not).
  virtual bool done() const = 0;
};
using WorkHandle = std::shared_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;
  /// Whether its collectives work on device memory (NCCL). The engine then
  /// keeps the chunks it communicates (gradients, parameter shards) on the
  /// device tier (Note [Chunks where the communicator reads them]). Host
  /// buffers still work, staged.
  virtual bool device_buffers() const { return false; }

  /// In place: `count` elements of `buf` become the reduction over ranks.
  /// Reductions take fp32, fp16 and bf16 (Gloo: Note [bf16 over Gloo]).
  virtual WorkHandle all_reduce(void* buf, size_t count, DType dtype, ReduceOp op = ReduceOp::kSum) = 0;
  /// `in` holds world_size blocks of `count` elements; block r of the
  /// reduction over ranks lands in rank r's `out` (`count` elements).
  virtual WorkHandle reduce_scatter(const void* in, void* out, size_t count, DType dtype,
                                    ReduceOp op = ReduceOp::kSum) = 0;
  /// Every rank's `count` elements of `in`, in rank order, into `out`
  /// (world_size * count elements). `in` may lie inside `out` (in place).
  virtual WorkHandle all_gather(const void* in, void* out, size_t count, DType dtype) = 0;
  /// Root's `count` elements of `buf` to every rank's `buf`.
  virtual WorkHandle broadcast(void* buf, size_t count, DType dtype, int root) = 0;
  /// Block r (of `count` elements) of `in` goes to rank r; block r of `out`
  /// comes from rank r.
  virtual WorkHandle all_to_all(const void* in, void* out, size_t count, DType dtype) = 0;
  /// Point to point: `bytes` to or from `peer`, matched by `tag`.
  virtual WorkHandle send(const void* buf, size_t bytes, int peer, uint32_t tag) = 0;
  virtual WorkHandle recv(void* buf, size_t bytes, int peer, uint32_t tag) = 0;
  virtual WorkHandle barrier() = 0;

  /// A communicator for the group of `ranks` (ranks of this communicator; the
  /// new one numbers them in the order given). Every member calls it with the
  /// same list and a `name` unique to the group; other ranks do not. A name
  /// may be used again: each split is a new group.
  virtual std::unique_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name) = 0;
};

/// Every rank's `mine` (the same length on every rank), in rank order, and
/// waited for: small host-side agreements (partial sums, layout checks) as
/// fp64 values, which travel bit for bit as pairs of fp32 words.
inline std::vector<double> all_gather_values(Communicator& comm, const std::vector<double>& mine) {
  std::vector<double> all(mine.size() * static_cast<size_t>(comm.world_size()));
  comm.all_gather(mine.data(), all.data(), mine.size() * sizeof(double) / sizeof(float), DType::kFloat32)->wait();
  return all;
}

struct CommunicatorOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  /// The interface Gloo binds: loopback unless set (STRATA_COMM_HOST), e.g.
  /// the node's address for a multi-node job.
  std::string bind_host = "127.0.0.1";
};

/// A Gloo communicator for `r`: meets the other ranks through a c10d TCPStore
/// at master_addr:master_port (rank 0 serves it) and connects a full mesh.
std::unique_ptr<Communicator> make_gloo_communicator(const Rendezvous& r, CommunicatorOptions options = {});

/// An NCCL communicator over `bootstrap`'s ranks, on CUDA device `device`
/// (usually the local rank): collectives on device buffers, fp32, fp16 and
/// bf16 (Note [NCCL communicator] in nccl_communicator.cpp). `bootstrap`
/// (Gloo) carries the unique id and later splits. Throws in a build without
/// NCCL.
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, int device,
                                                     CommunicatorOptions options = {});
/// Whether this build has NCCL and the process sees a GPU.
bool nccl_available();

}  // namespace strata::parallel
