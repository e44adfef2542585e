#pragma once
// EngineContext: what the engine's components share, and nothing else: the
// options, the chunk manager, the managed parameters and their chunk
// families, the communicator and the ZeRO stage. Each component (residency.h,
// grad_sink.h, step_pipeline.h, trace_recorder.h, family_stream.h,
// zero/reducer.h, zero/gathers.h) holds a reference to one context and keeps
// its own state to itself. The helpers here are the few operations every
// component needs: pinning chunks, addressing a family-layout element in a
// chunk or a shard, and the parts of a family a step touches.
// Private to strata_parallel: not installed, not included by users.

#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "strata/checkpoint/part_map.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/core/log.h"
#include "strata/memory/chunk_manager.h"
#include "strata/offload/copy_engine.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/engine_options.h"
#include "strata/parallel/optimizer.h"

namespace strata::parallel {

using memory::ChunkId;
using memory::TensorState;
using memory::Tier;

torch::ScalarType scalar_type_of(DType d);

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

/// A trainable parameter the engine manages: its slot in a chunk family and
/// the storage that follows its chunk (Note [Parameter storages follow their chunk]).
struct ManagedParam {
  std::string name;
  torch::Tensor tensor;
  std::vector<int64_t> shape;  // as attached; the tensor's own may change if user code replaces its data
  c10::intrusive_ptr<c10::StorageImpl> storage;
  torch::Device original_device{torch::kCPU};
  std::shared_ptr<torch::autograd::Node> accumulator;
  memory::FamilyId family = 0;
  size_t slot = 0;
  int64_t offset = 0;  // in the family layout, in elements
  int64_t numel = 0;
  int64_t steps = 0;      // optimizer updates applied
  size_t group = 0;       // index into EngineContext::groups
  bool has_grad = false;  // a gradient arrived since the last step
  bool constructed_lazily = false;  // lazy at attach (lazy_init.h)
  int copies = 0;         // tensor parallel: ranks of the group holding this part (tensor_copies_of); 0: not split
  int stage_copies = 1;   // pipeline ranks holding a copy (Note [Tied parameters across stages] in tied_params.h)
  // Checkpoints (Note [Checkpoints across layouts]): the parameter's name
  // there (EngineOptions::checkpoint_name) and where this rank's elements lie
  // in the whole parameter (Note [Parts of a whole parameter]).
  std::string whole_name;
  checkpoint::PartMap part;
};

/// A parameter group's hyper-parameters in effect (OptimizerConfig's, with
/// the group's own where it sets them); `lr` is the base the schedule scales.
struct GroupSettings {
  std::string name;
  double lr = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0, momentum = 0;
};

struct EngineContext {
  OptimizerConfig optimizer;
  std::vector<GroupSettings> groups;  // "default" last
  EngineOptions options;
  torch::ScalarType compute = torch::kFloat32;
  torch::Device device{torch::kCPU};  // where operators run: the device tier's
  std::unique_ptr<memory::ChunkManager> mgr;
  std::vector<ManagedParam> params;
  std::unordered_map<ChunkId, std::vector<size_t>> params_of_chunk;  // param chunks only
  std::vector<memory::FamilyId> families;                           // in step order
  std::unordered_map<memory::FamilyId, size_t> family_pos;          // position in `families`
  std::shared_ptr<Communicator> comm;  // null: a single process
  int stage = 0;                       // ZeRO stage in effect (0 with one rank)
  int rank = 0;
  int64_t collectives = 0;  // on `comm`: see Engine::collectives()
  // The tensor group the module's tensor-parallel layers split parameters
  // over (Note [Clipping across the tensor group]); null: none.
  Communicator* tensor_group = nullptr;
  // Some parameter has copies on several pipeline stages, here or on
  // another stage (Note [Tied parameters across stages] in tied_params.h).
  bool stages_tied = false;
  Engine::DataWait wait;
  // Called when a pin on `tier` finds no room: settles work that holds
  // chunks pinned there (the oldest gradient reduction in flight, on the
  // tier the communicator reads: Note [Chunks where the communicator reads
  // them]) and says whether it did; the pin is then tried again. Null:
  // nothing to settle.
  std::function<bool(Tier)> make_room;

  bool data_parallel() const { return comm != nullptr && comm->world_size() > 1; }
  /// Under tensor parallelism, this tensor rank's part of weight file `path`
  /// (<stem>.tensor-<r>-of-<P><ext>: Note [Weights across tensor ranks]); else `path`.
  std::string tensor_part_file(const std::string& path) const;
  /// Whether a parameter's storage may point at its chunk on tier `where`
  /// (Note [Parameters between steps]): the device tier, and on the emulated
  /// device the host tier too (both host memory there).
  bool addressable(std::optional<Tier> where) const {
    return where && (*where == Tier::kDevice || (*where == Tier::kHost && device.is_cpu()));
  }
  int world() const { return comm ? comm->world_size() : 1; }
  // Note [Chunks where the communicator reads them]
  // Gradients are accumulated into their chunk, reduced over the ranks and
  // read by the optimizer; ZeRO's parameter shards are gathered. With a
  // communicator of device buffers (NCCL) those chunks are pinned on the
  // device tier, so gradients stay on the GPU from the operator that makes
  // them to the reduction, which reads them in place, overlapped with the
  // rest of backward; the optimizer brings what it updates on the CPU to
  // host afterwards (ZeRO-Offload). Otherwise (Gloo, one process) they are
  // pinned on host, where the CPU optimizer and Gloo read them.
  Tier comm_tier() const { return comm && comm->device_buffers() ? Tier::kDevice : Tier::kHost; }
  size_t elem_size() const { return dtype_size(options.precision); }
  ChunkId param_chunk(const ManagedParam& p) const { return mgr->family(p.family).param; }
  // See Note [ZeRO over chunks]: where a family's parameters and gradients
  // are between steps and in the step.
  ChunkId step_param(memory::FamilyId f) const;
  ChunkId step_grad(memory::FamilyId f) const;
  /// The optimizer state of a family: exp_avg, exp_avg_sq and the fp32 master.
  std::vector<ChunkId> optim_members(memory::FamilyId f) const;
  /// Everything the update of a family touches: its optimizer state, parameters and gradients.
  std::vector<ChunkId> step_members(memory::FamilyId f) const;
  /// The element of the family layout a chunk's first element holds.
  int64_t origin(ChunkId c) const;
  /// The address of family-layout element `elem` in chunk `c` (payload on host or device).
  char* at(ChunkId c, int64_t elem) const;
  /// The elements of parameter `p` this rank updates: all of them at stage 0,
  /// its shard's part from stage 1.
  std::pair<int64_t, int64_t> owned(const ManagedParam& p) const;

  /// Makes `chunk` resident on `tier` and pins the given slots (HOLD -> COMPUTE).
  void pin(ChunkId chunk, Tier tier, const std::vector<size_t>& slots);
  void unpin(ChunkId chunk, const std::vector<size_t>& slots);
  std::vector<size_t> all_slots(ChunkId chunk) const;
  /// Pins the given chunks on host for `fn`, unpinning however it ends.
  template <typename Fn>
  void with_on_host(const std::vector<ChunkId>& chunks, Fn fn) {
    with_on(Tier::kHost, chunks, std::move(fn));
  }
  /// The same on `tier` (host or device).
  template <typename Fn>
  void with_on(Tier tier, const std::vector<ChunkId>& chunks, Fn fn) {
    std::vector<ChunkId> pinned;
    try {
      for (ChunkId c : chunks) {
        pin(c, tier, all_slots(c));
        pinned.push_back(c);
      }
      fn();
    } catch (...) {
      for (ChunkId c : pinned) unpin(c, all_slots(c));
      throw;
    }
    for (ChunkId c : pinned) unpin(c, all_slots(c));
  }

  /// Starts reads to host of the chunks not there yet (Note [The step
  /// pipeline]). With `only_into_free`, only when they fit in the host tier's
  /// free bytes: a read-ahead that had to evict would push out chunks the
  /// step needs.
  void read_ahead(const std::vector<ChunkId>& chunks, std::vector<offload::CopyTicket>& tickets,
                  bool only_into_free = false) const;
  /// Waits for read-ahead and prefetch tickets. A failed one left the chunk
  /// where it was; the access that needed it moved it again and reported any
  /// error itself.
  static void settle(std::vector<offload::CopyTicket>& tickets);
};

/// `t` on ctx.device, a floating `t` in ctx.compute (Engine::to_device).
torch::Tensor to_compute(const EngineContext& ctx, const torch::Tensor& t);

/// A chunk manager for `options` (budgets, the NVMe store, `policy` for the
/// device tier, null: LRU) over `world` ranks; sets ctx.mgr and ctx.device.
void make_chunk_manager(EngineContext& ctx, std::unique_ptr<memory::EvictionPolicy> policy);

/// Assigns every parameter of ctx.params (names and tensors set) to the
/// first of ctx.optimizer.groups that selects it, or to "default", and fills
/// ctx.groups with each group's settings.
void assign_groups(EngineContext& ctx);

/// Every rank's `mine` (lengths may differ), in rank order: a collective over `comm`.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

/// Registers ctx.params (name, tensor and numel set; fp32, contiguous) with
/// the chunk manager as chunk families (ZeRO-sharded from stage 1): sets
/// ctx.families, family_pos, params_of_chunk and each parameter's family,
/// slot and offset. Moves no data.
void register_parameters(EngineContext& ctx);

/// Copies every parameter's values into its slots on host (the master in
/// fp32, the parameter chunk in the compute precision, each whole or this
/// rank's shard; data parallel, rank 0's values, broadcast first) and gives
/// its tensor a storage that follows the chunk (Note [Parameter storages
/// follow their chunk]); the original storage is released.
void move_parameters_into_chunks(EngineContext& ctx);

}  // namespace strata::parallel
