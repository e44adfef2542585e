#pragma once
// Engine::Impl, shared by the engine's translation units (engine.cpp: attach,
// the hooks and the step; engine_checkpoint.cpp: save, load and weights).
// Private to strata_parallel: not installed, not included by users.

#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/core/log.h"
#include "strata/kernels/optim.h"
#include "strata/memory/nvme_swap_store.h"
#include "strata/memory/trace.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/memory_counter.h"
#include "strata/parallel/op_hook.h"

namespace strata::parallel {

using memory::ChunkId;
using memory::Tier;
using memory::TensorState;

namespace detail {

inline torch::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::kFloat32: return torch::kFloat32;
    case DType::kBFloat16: return torch::kBFloat16;
    case DType::kFloat16: return torch::kFloat16;
  }
  STRATA_FAIL("unknown dtype");
}

// Note [Gradients go straight to their chunk]
// A tensor hook (Tensor::register_hook) cannot drop a gradient: an undefined
// return value means "unchanged", so AccumulateGrad would still store it in
// .grad and every parameter's gradient would exist twice until backward ends.
// Instead a pre-hook sits on the parameter's AccumulateGrad node (the same
// node in LibTorch 1.13 and 2.x, which both run Node::pre_hooks before
// apply): it adds the gradient into the gradient chunk and returns an
// undefined gradient, which AccumulateGrad ignores. The engine keeps the
// node alive, since the parameter itself only holds it weakly.
class GradToChunk final : public torch::autograd::FunctionPreHook {
 public:
  explicit GradToChunk(std::function<void(const torch::Tensor&)> sink) : sink_(std::move(sink)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!grads.empty() && grads[0].defined()) sink_(grads[0]);
    return {torch::Tensor()};
  }

 private:
  std::function<void(const torch::Tensor&)> sink_;
};

}  // namespace detail

using detail::GradToChunk;
using detail::scalar_type_of;

// Note [Recording a trace]
// While a traced step runs, the operator hook reports every operator (not
// only those touching parameters). Each becomes a TraceOp: the parameter
// chunks it touched and where they were when it began, chunk bytes per tier
// after it, non-model bytes (NonModelCounter) live after it and their peak
// during it, and the chunk moves started and finished (and how many bytes of
// those were moved on demand) and the stall time since the previous record,
// so that moves between operators (prefetches) are counted once. The
// optimizer step is one more record, "strata::optimizer_step". After
// trace_steps steps the trace is written (write_trace: temporary file and
// rename) and recording stops.
struct TraceRecorder {
  using Clock = std::chrono::steady_clock;
  memory::Trace trace;
  std::string path;
  int steps_wanted = 0;
  bool recording = false;  // inside a traced train_step
  bool done = false;
  std::string phase;
  NonModelCounter* counter = nullptr;
  Clock::time_point t0, op_t0, step_t0;
  memory::MoveStats last;
  memory::TraceOp current;
  int64_t step_first_op = 0;
  std::mutex mu;

  double since(Clock::time_point a) const { return std::chrono::duration<double>(Clock::now() - a).count(); }

  void begin_op(const std::string& name, std::vector<memory::TraceTouch> touches) {
    current = memory::TraceOp{};
    current.index = static_cast<int64_t>(trace.ops.size());
    current.step = static_cast<int>(trace.steps.size());
    current.name = name;
    current.phase = phase;
    current.start = since(t0);
    current.chunks = std::move(touches);
    counter->reset_peak();
    op_t0 = Clock::now();
  }

  void end_op(const memory::ChunkManager& mgr) {
    current.seconds = since(op_t0);
    for (int t = 0; t < memory::kNumTiers; ++t) current.model_bytes[t] = mgr.tier_stats(static_cast<memory::Tier>(t)).used;
    current.non_model_bytes = counter->current();
    current.non_model_peak = std::max(counter->peak(), current.non_model_bytes);
    const memory::MoveStats now = mgr.move_stats();
    for (int a = 0; a < memory::kNumTiers; ++a) {
      for (int b = 0; b < memory::kNumTiers; ++b) {
        const uint64_t bytes = now.bytes[a][b] - last.bytes[a][b];
        const uint64_t count = now.count[a][b] - last.count[a][b];
        const char* from = memory::tier_name(static_cast<memory::Tier>(a));
        const char* to = memory::tier_name(static_cast<memory::Tier>(b));
        if (count > 0) current.moves.push_back({from, to, bytes, count, now.demand_bytes[a][b] - last.demand_bytes[a][b]});
        const uint64_t started = now.started_count[a][b] - last.started_count[a][b];
        if (started > 0) {
          current.started.push_back({from, to, now.started_bytes[a][b] - last.started_bytes[a][b], started, 0});
        }
      }
    }
    current.stall_seconds = now.stall_seconds - last.stall_seconds;
    current.stall_bytes = now.stall_bytes - last.stall_bytes;
    last = now;
    trace.ops.push_back(std::move(current));
  }
};

// Note [Parameter storages follow their chunk]
// At attach every trainable parameter gets a StorageImpl of its own with a
// non-owning DataPtr; the original storage is released (attaching does not
// double memory). The chunk manager's placement listener sets that DataPtr to
// the parameter's slot whenever its chunk lands on the device tier and to null
// when it leaves. Because the StorageImpl object never changes, every view of
// the parameter, including the views autograd saved for backward (linear
// saves weight.t()), follows the chunk too: the hook sees them in backward by
// their storage and makes the chunk resident before the operator reads them.
//
// Note [The step pipeline]
// Before backward, the optimizer state on NVMe starts coming back to host,
// family by family, as far as the host's free bytes allow after reserving
// room for the gradient and parameter chunks (read_optimizer_state_early), so
// those reads overlap backward. The step visits chunk families in order. With family i pinned on host it
// starts (on the chunk manager's copy engine) the reads of family i+1's chunks
// that are not on host, when they fit in the host tier's free bytes; after
// updating family i it starts the write-back to NVMe of its optimizer state
// when that state lives there. So while the kernel updates
// family i, family i+1 is read and family i-1 written: the optimizer waits on
// NVMe only when the disk is slower than the update. Budgets still hold: the
// reads and write-backs are ordinary chunk moves, evicting as they need.
struct Engine::Impl : OpObserver {
  struct Param {
    std::string name;
    torch::Tensor tensor;
    c10::intrusive_ptr<c10::StorageImpl> storage;
    torch::Device original_device{torch::kCPU};
    std::shared_ptr<torch::autograd::Node> accumulator;
    memory::FamilyId family = 0;
    size_t slot = 0;
    int64_t offset = 0;
    int64_t numel = 0;
    int64_t steps = 0;
    bool has_grad = false;
  };
  // A frozen parameter or floating buffer cast to the compute precision.
  struct Cast {
    torch::Tensor tensor;
    torch::ScalarType original;
  };

  AdamWConfig opt;
  EngineOptions options;
  torch::ScalarType compute = torch::kFloat32;
  std::unique_ptr<memory::ChunkManager> mgr;
  std::vector<Param> params;
  std::vector<Cast> casts;
  std::vector<std::pair<std::string, torch::Tensor>> frozen;  // frozen parameters, for export_weights
  std::unordered_map<ChunkId, std::vector<size_t>> params_of_chunk;  // param chunks only
  std::vector<memory::FamilyId> families;
  std::vector<bool> optim_on_nvme;  // parallel to families
  std::unique_ptr<OpHook> hook;
  torch::Device device{torch::kCPU};
  int micro_steps = 0;
  // A load that failed after it began changing chunks left the state mixed:
  // training refuses until a load succeeds (Note [Loading a checkpoint]).
  std::string poisoned;
  double scale = 1.0;  // the loss scale
  int clean_steps = 0;
  int64_t skipped = 0;
  std::mutex grad_mu;
  std::unique_ptr<TraceRecorder> recorder;  // null: no trace
  // Note [Data parallel gradients]
  // With a communicator of more than one rank, every rank trains a replica on
  // its own batch and the gradient chunks are averaged before the step. On the
  // micro-step that ends an accumulation, a family's gradient chunk is
  // all-reduced as soon as all its parameters' gradients are in, while the
  // rest of backward runs. Reductions are issued in descending family order
  // on every rank (backward reaches the last families first), so the ranks
  // issue the same collectives in the same order whatever their timing: a
  // family whose gradients are not all in yet holds back the ones after it.
  // Parameters a rank did not use this step (another branch) never deliver a
  // gradient there, so after backward the remaining families are reduced with
  // zeros for them, and one more all-reduce (max) of per-parameter "has a
  // gradient" flags tells every rank which parameters any rank used, so all
  // update the same ones. Accumulation micro-steps communicate nothing.
  std::shared_ptr<Communicator> comm;  // null: a single process
  // Note [ZeRO over chunks]
  // Stage s >= 1 registers sharded chunk families (Note [Sharded chunk
  // families] in chunk.h): each rank keeps elements [rank * S, (rank + 1) *
  // S) of every family's optimizer state and master (stage 1), gradient
  // (stage 2) and parameters (stage 3), S = chunk capacity / world size.
  // - Gradients: stages 0 and 1 all-reduce the full gradient chunk; stages 2
  //   and 3 reduce-scatter it into the rank's gradient shard during backward
  //   (same order and overlap as Note [Data parallel gradients]) and release
  //   the full chunk as soon as its collective completes. With accumulation
  //   the full chunk collects the micro-steps and is reduced once.
  // - Step: each rank updates only the elements of its shard, parameter by
  //   parameter (a parameter may span shards: each rank updates its part, and
  //   every rank counts its step). The norm and overflow check over gradient
  //   shards sum the ranks' partial sums. Stages 1 and 2 then all-gather each
  //   parameter chunk in place while the next family updates; stage 3
  //   writes the parameter shard.
  // - Stage 3 operators: before an operator its parameter chunks are gathered
  //   (all-gather of the shards into the full chunk, on a communicator of its
  //   own so gathers never interleave with gradient reductions) and pinned
  //   there; gathered chunks outside the window (this operator's chunks and,
  //   once a step has recorded the operator sequence, the next
  //   kPrefetchLookaheadOps operators', within the device budget) are
  //   released. Gathers for the window are issued ahead, so they overlap the
  //   operators before them. Every decision is a function of the operator
  //   sequence and the chunk sizes, never of timing or free bytes, so every
  //   rank issues the same gathers in the same order. Gathered chunks are not
  //   evictable; after backward all are released (the step changes the shards).
  //   Like DeepSpeed's ZeRO-3, this needs every rank to run the same operators
  //   on parameters; a rank that does not stalls the others until the timeout.
  int stage = 0;
  int rank = 0;
  std::unique_ptr<Communicator> gather_comm;  // stage 3
  struct Gather {
    WorkHandle work;  // null once complete
    ChunkId shard = -1;
  };
  std::vector<std::pair<ChunkId, Gather>> gathered;  // full parameter chunks held now, in gather order
  std::vector<std::vector<ChunkId>> gather_plan, gather_rec;  // the operator sequence's parameter chunks
  bool gather_recording = true;
  bool gather_diverged = false;
  int64_t gather_cursor = 0;
  int64_t gathers = 0;
  int64_t gathers_ahead = 0;  // of those, issued for a later operator than the one about to run
  std::vector<size_t> grads_arrived;  // per family position; complete at params_of_chunk[its param chunk].size()
  // Per family position: null before it is issued (positions below
  // reduce_cursor) and again once settled.
  std::vector<WorkHandle> reductions;
  std::unordered_map<memory::FamilyId, size_t> family_pos;
  size_t reduce_cursor = 0;  // families at positions >= this have been issued
  bool boundary = false;     // this micro-step ends an accumulation
  int64_t collectives = 0;
  bool data_parallel() const { return comm != nullptr && comm->world_size() > 1; }
  // Note [Belady over the recorded operator sequence] (eviction_policy.h).
  memory::TracePolicy* planner = nullptr;  // owned by the manager; null unless policy "auto"
  // Note [Static placement] (eviction_policy.h): the streamed chunks of the
  // last operator with parameters, returned to host before the next one.
  memory::StaticPolicy* placement = nullptr;  // owned by the manager; null unless policy "static"
  std::vector<ChunkId> streamed;
  bool in_step = false;                    // forward/backward of a train_step is running
  bool planning = true;                    // this step records the plan
  bool diverged = false;
  int64_t cursor = 0;
  std::vector<std::vector<ChunkId>> plan_rec;
  std::vector<offload::CopyTicket> prefetches;
  int64_t replans = 0;
  Engine::DataWait wait;
  // Note [Device capacity]
  // With EngineOptions::device_capacity, chunks and activations share the
  // device. At every operator that touches parameters, the chunk budget is set
  // (ChunkManager::set_budget, which evicts) to capacity x safety ratio minus
  // the larger of the non-model bytes live now and the peak the planning step
  // saw between this operator and the next one. When activations grow past the
  // plan (a longer sequence, a bigger batch), the live figure is the larger
  // and more chunks are evicted; the operator's own chunks always stay (they
  // are pinned), and when even they do not fit beside the live activations,
  // the error says how much activation memory left how little room.
  // Between two operators with parameters, every other operator checks the
  // live bytes too (relieve_capacity): activations that grew past the room the
  // budget leaves (a bulge the plan did not see) evict chunks before that
  // operator runs. No operator's own allocation can be anticipated, so the
  // capacity holds at operator boundaries.
  NonModelCounter* nm_counter = nullptr;
  std::vector<uint64_t> plan_nm_rec, plan_nm;  // non-model peak after each planned operator
  std::vector<uint64_t> plan_live_rec, plan_live;  // non-model bytes live as each planned operator began
  bool nm_stale = false;  // this step's activations departed from the plan's
  uint64_t capacity_floor = UINT64_MAX;        // lowest chunk budget set, for tests and reports
  using Clock = std::chrono::steady_clock;
  static double seconds_since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  }

  bool observes_all_ops() const override { return tracing() || nm_counter != nullptr; }
  bool tracing() const { return recorder && recorder->recording; }

  ChunkId param_chunk(const Param& p) const { return mgr->family(p.family).param; }
  size_t elem_size() const { return dtype_size(options.precision); }
  int world() const { return comm ? comm->world_size() : 1; }
  // See Note [ZeRO over chunks]: where a family's parameters and gradients
  // are between steps and in the step.
  ChunkId step_param(memory::FamilyId f) const {
    const memory::ChunkFamily& fam = mgr->family(f);
    return fam.param_shard ? *fam.param_shard : fam.param;
  }
  ChunkId step_grad(memory::FamilyId f) const {
    const memory::ChunkFamily& fam = mgr->family(f);
    return fam.grad_shard ? *fam.grad_shard : fam.grad;
  }
  // The element of the family layout a chunk's first element holds.
  int64_t origin(ChunkId c) const {
    const memory::Chunk& chunk = mgr->chunk(c);
    return chunk.shard() ? rank * mgr->family(chunk.family()).layout->shards.shard_elems : 0;
  }
  // The address of family-layout element `elem` in chunk `c` (payload on host or device).
  char* at(ChunkId c, int64_t elem) const {
    return static_cast<char*>(mgr->data(c)) + (elem - origin(c)) * dtype_size(mgr->chunk(c).dtype());
  }
  // The elements of parameter `p` this rank updates: all of them at stage 0,
  // its shard's part from stage 1.
  std::pair<int64_t, int64_t> owned(const Param& p) const {
    if (stage == 0) return {p.offset, p.offset + p.numel};
    return mgr->family(p.family).layout->slot_in_shard(p.slot, rank);
  }

  // See Note [Parameter storages follow their chunk]. Runs under the manager's lock.
  void on_placed(const memory::Chunk& c, std::optional<Tier> tier, void* ptr) {
    const auto it = params_of_chunk.find(c.id());
    if (it == params_of_chunk.end()) return;
    for (size_t i : it->second) {
      Param& p = params[i];
      if (!p.storage) continue;  // still being attached
      void* at = tier == Tier::kDevice ? static_cast<char*>(ptr) + p.offset * elem_size() : nullptr;
      p.storage->set_data_ptr_noswap(c10::DataPtr(at, device));
    }
  }

  // Makes `chunk` resident on `tier` and pins the given slots (HOLD -> COMPUTE).
  void pin(ChunkId chunk, Tier tier, const std::vector<size_t>& slots) {
    mgr->access(chunk, tier);
    size_t done = 0;
    try {
      for (; done < slots.size(); ++done) mgr->transition(chunk, slots[done], TensorState::kCompute);
    } catch (...) {
      for (size_t k = 0; k < done; ++k) mgr->transition(chunk, slots[k], TensorState::kHold);
      throw;
    }
  }
  void unpin(ChunkId chunk, const std::vector<size_t>& slots) {
    for (size_t s : slots) mgr->transition(chunk, s, TensorState::kHold);
  }
  std::vector<size_t> all_slots(ChunkId chunk) const {
    std::vector<size_t> s(mgr->chunk(chunk).num_tensors());
    for (size_t i = 0; i < s.size(); ++i) s[i] = i;
    return s;
  }

  void before_op(const c10::OperatorHandle& op, const std::vector<int64_t>& ids) override {
    if (tracing()) {
      std::vector<memory::TraceTouch> touches;
      for (int64_t id : ids) {
        const ChunkId c = param_chunk(params[id]);
        bool seen = false;
        for (const auto& t : touches) seen = seen || t.chunk == c;
        if (seen) continue;
        const auto at = mgr->chunk(c).location();
        touches.push_back({c, at ? memory::tier_name(*at) : "none"});
      }
      std::lock_guard<std::mutex> lock(recorder->mu);
      recorder->begin_op(op.schema().name(), std::move(touches));
    }
    if (ids.empty()) {
      if (nm_counter != nullptr) relieve_capacity();
      return;
    }
    // The operator's working set on the device: every distinct chunk it touches.
    std::vector<ChunkId> chunks;
    uint64_t needed = 0;
    for (int64_t id : ids) {
      const ChunkId c = param_chunk(params[id]);
      if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) continue;
      chunks.push_back(c);
      needed += mgr->chunk(c).alloc_bytes();
    }
    if (stage == 3) gather_window(chunks);
    if (planner != nullptr && in_step) follow_plan(op, chunks);
    if (placement != nullptr && stage < 3) return_streamed(chunks);
    if (nm_counter != nullptr) apply_capacity(op, needed);
    const uint64_t budget = mgr->tier_stats(Tier::kDevice).budget;
    STRATA_CHECK(needed <= budget, "operator ", op.schema().name(), " on parameter '", params[ids.front()].name,
                 "' needs ", format_bytes(needed), " of parameter chunks on the device tier at once (", chunks.size(),
                 " chunks), more than the device budget of ", format_bytes(budget),
                 "; raise the device budget or lower the chunk size");
    std::vector<std::pair<ChunkId, size_t>> pinned;
    const auto waited_from = Clock::now();
    try {
      for (int64_t id : ids) {
        const Param& p = params[id];
        const ChunkId c = param_chunk(p);
        pin(c, Tier::kDevice, {p.slot});
        pinned.emplace_back(c, p.slot);
      }
    } catch (...) {
      for (const auto& [c, s] : pinned) mgr->transition(c, s, TensorState::kHold);
      throw;
    }
    wait.operators += seconds_since(waited_from);
    if (planner != nullptr && in_step && !planning && !diverged && options.prefetch) prefetch_upcoming();
  }

  // See Note [ZeRO over chunks]: releases the gathered chunks outside this
  // operator's window, issues the gathers the window lacks, and waits for
  // this operator's own.
  void gather_window(const std::vector<ChunkId>& chunks) {
    std::vector<ChunkId> window = chunks;
    if (in_step) {
      if (gather_recording) {
        gather_rec.push_back(chunks);
      } else if (!gather_diverged &&
                 (gather_cursor >= static_cast<int64_t>(gather_plan.size()) || gather_plan[gather_cursor] != chunks)) {
        gather_diverged = true;
      }
      gather_cursor += 1;
      if (!gather_recording && !gather_diverged && options.prefetch) {
        // At stage 3 gathered chunks are all the device tier holds; with
        // device_capacity the budget moves with activations, so prefetch
        // keeps to half of it.
        const uint64_t room = options.device_capacity > 0 ? options.budgets.device / 2 : options.budgets.device;
        uint64_t bytes = 0;
        for (ChunkId c : window) bytes += mgr->chunk(c).alloc_bytes();
        const int64_t end = std::min<int64_t>(gather_cursor + memory::kPrefetchLookaheadOps - 1,
                                              static_cast<int64_t>(gather_plan.size()));
        for (int64_t k = gather_cursor; k < end; ++k) {
          for (ChunkId c : gather_plan[k]) {
            if (std::find(window.begin(), window.end(), c) != window.end()) continue;
            bytes += mgr->chunk(c).alloc_bytes();
            if (bytes > room) break;
            window.push_back(c);
          }
        }
      }
    }
    for (size_t i = 0; i < gathered.size();) {
      const ChunkId c = gathered[i].first;
      if (std::find(window.begin(), window.end(), c) != window.end()) {
        ++i;
        continue;
      }
      finish_gather(gathered[i].second, c);
      if (!mgr->chunk(c).movable()) {  // an enclosing operator still computes on it
        ++i;
        continue;
      }
      mgr->release(c);
      gathered.erase(gathered.begin() + static_cast<std::ptrdiff_t>(i));
    }
    for (ChunkId c : window) {
      const bool held = std::any_of(gathered.begin(), gathered.end(), [&](const auto& g) { return g.first == c; });
      if (held) continue;
      start_gather(c);
      if (std::find(chunks.begin(), chunks.end(), c) == chunks.end()) gathers_ahead += 1;
    }
    for (auto& [c, g] : gathered) {
      if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) finish_gather(g, c);
    }
  }
  // Materialises the full chunk where operators read it (the device; on
  // CUDA, host first, since Gloo moves host memory) and all-gathers every
  // rank's shard into it.
  void start_gather(ChunkId c) {
    const ChunkId shard = *mgr->family(mgr->chunk(c).family()).param_shard;
    const Tier where = mgr->device().kind() == offload::DeviceKind::kCuda ? Tier::kHost : Tier::kDevice;
    pin(shard, Tier::kHost, {0});
    try {
      pin(c, where, all_slots(c));
    } catch (...) {
      unpin(shard, {0});
      throw;
    }
    Gather g;
    g.shard = shard;
    g.work = gather_comm->all_gather(mgr->data(shard), mgr->data(c),
                                     static_cast<size_t>(mgr->chunk(shard).capacity_elems()), options.precision);
    gathered.emplace_back(c, std::move(g));
    gathers += 1;
  }
  void finish_gather(Gather& g, ChunkId c) {
    if (!g.work) return;
    WorkHandle work = std::move(g.work);
    g.work = nullptr;
    std::exception_ptr failure;
    try {
      work->wait();
    } catch (...) {
      failure = std::current_exception();
    }
    unpin(c, all_slots(c));
    unpin(g.shard, {0});
    if (failure) std::rethrow_exception(failure);
  }
  // After backward (and evaluation): every gathered chunk is released.
  void release_gathered() {
    std::exception_ptr failure;
    for (auto& [c, g] : gathered) {
      try {
        finish_gather(g, c);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      if (mgr->chunk(c).movable()) mgr->release(c);
    }
    gathered.clear();
    if (failure) std::rethrow_exception(failure);
  }
  void begin_gather_step() {
    gather_cursor = 0;
    gather_diverged = false;
    if (gather_recording) gather_rec.clear();
  }
  void end_gather_step() {
    if (gather_recording) {
      gather_plan = std::move(gather_rec);
      gather_rec.clear();
      gather_recording = false;
    } else if (gather_diverged || gather_cursor != static_cast<int64_t>(gather_plan.size())) {
      gather_recording = true;
    }
  }

  // Moves the plan's cursor to this operator, or records it while planning;
  // an operator that is not the plan's next one ends the plan for this step.
  void follow_plan(const c10::OperatorHandle& op, const std::vector<ChunkId>& chunks) {
    if (planning) {
      plan_rec.push_back(chunks);
    } else if (!diverged) {
      if (planner->plan_op(cursor) != chunks) {
        diverged = true;
        planner->set_cursor(-1);
        STRATA_LOG(kInfo, "operator #{} ({}) is not the planned one: LRU for the rest of this step, re-planning "
                   "next step", cursor, op.schema().name());
      } else {
        planner->set_cursor(cursor);
      }
    }
    cursor += 1;
  }

  // Starts moves to the device of the chunks the next operators use, only
  // when all of them fit in the device tier's free bytes and no earlier
  // prefetch is still queued (its bytes are reserved only when it starts): a
  // prefetch must never cause an eviction, or it could move more than LRU.
  void prefetch_upcoming() {
    for (const auto& t : prefetches) {
      if (!offload::CopyEngine::test(t)) return;
    }
    std::vector<ChunkId> wanted;
    uint64_t bytes = 0;
    for (int64_t k = cursor; k < cursor + memory::kPrefetchLookaheadOps; ++k) {
      for (ChunkId c : planner->plan_op(k)) {
        const memory::Chunk& chunk = mgr->chunk(c);
        if (chunk.resident_on(Tier::kDevice) || !chunk.location()) continue;
        if (std::find(wanted.begin(), wanted.end(), c) != wanted.end()) continue;
        wanted.push_back(c);
        bytes += chunk.alloc_bytes();
      }
    }
    const memory::TierStats dev = mgr->tier_stats(Tier::kDevice);
    if (wanted.empty() || dev.used + bytes > dev.budget) return;
    for (ChunkId c : wanted) prefetches.push_back(mgr->prefetch(c, Tier::kDevice));
  }

  // See Note [Static placement]: the previous operator's streamed chunks that
  // this one does not use go back to host; this one's become the next to go.
  void return_streamed(const std::vector<ChunkId>& chunks) {
    for (ChunkId c : streamed) {
      if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) continue;
      const memory::Chunk& chunk = mgr->chunk(c);
      if (chunk.resident_on(Tier::kDevice) && chunk.movable()) mgr->move(c, Tier::kHost);
    }
    streamed.clear();
    for (ChunkId c : chunks) {
      if (!placement->held(c)) streamed.push_back(c);
    }
  }

  // See Note [Device capacity].
  void apply_capacity(const c10::OperatorHandle& op, uint64_t needed) {
    const uint64_t interval = nm_counter->interval_peak();  // since the previous operator with parameters
    nm_counter->reset_interval_peak();
    const uint64_t live = nm_counter->current();
    uint64_t predicted = 0;
    if (planner != nullptr && in_step) {
      const int64_t k = cursor - 1;  // follow_plan counted this operator
      if (planning) {
        if (!plan_nm_rec.empty()) plan_nm_rec.back() = std::max(plan_nm_rec.back(), interval);
        plan_nm_rec.push_back(0);
        plan_live_rec.push_back(live);
      } else if (!diverged && k >= 0 && k < static_cast<int64_t>(plan_nm.size())) {
        // Activations unlike the planning step's (another sequence length or
        // batch): the peaks ahead are assumed to grow by as much, and the
        // next step records them again.
        const uint64_t planned = plan_live[k];
        predicted = plan_nm[k] + (live > planned ? live - planned : 0);
        const uint64_t gap = live > planned ? live - planned : planned - live;
        if (!nm_stale && gap > std::max<uint64_t>(64 << 10, planned / 4)) {
          nm_stale = true;
          STRATA_LOG(kInfo, "operator #{} ({}) starts with {} of activations where the plan had {}: re-planning "
                     "next step", k, op.schema().name(), format_bytes(live), format_bytes(planned));
        }
      }
    }
    const uint64_t non_model = std::max(live, predicted);
    const uint64_t usable = usable_capacity();
    STRATA_CHECK(usable >= live + needed, "operator ", op.schema().name(), " needs ", format_bytes(needed),
                 " of parameter chunks on the device, but ", format_bytes(live),
                 " of live activations and workspace leave ", format_bytes(usable > live ? usable - live : 0),
                 " of the ", format_bytes(usable), " usable device capacity; raise device_capacity or lower the batch");
    // The operator's own chunks stay even when the peak expected after it
    // leaves less room: relieve_capacity() evicts them once they are unpinned.
    const uint64_t budget = std::max(needed, usable > non_model ? usable - non_model : 0);
    capacity_floor = std::min(capacity_floor, mgr->set_budget(Tier::kDevice, budget));
  }

  // See Note [Device capacity]: before an operator without parameters,
  // activations that outgrew the room the chunk budget leaves evict chunks.
  void relieve_capacity() {
    const uint64_t live = nm_counter->current();
    const uint64_t usable = usable_capacity();
    if (live + mgr->tier_stats(Tier::kDevice).budget <= usable) return;
    capacity_floor = std::min(capacity_floor, mgr->set_budget(Tier::kDevice, usable > live ? usable - live : 0));
  }
  uint64_t usable_capacity() const {
    return static_cast<uint64_t>(static_cast<double>(options.device_capacity) * options.device_safety_ratio);
  }

  void begin_plan_step() {
    in_step = true;
    cursor = 0;
    diverged = false;
    nm_stale = false;
    if (planning) {
      plan_rec.clear();
      plan_nm_rec.clear();
      plan_live_rec.clear();
    }
  }

  // After backward: a recorded plan takes effect; a step that diverged, or
  // ended before the plan did, records a new one next time.
  void end_plan_step() {
    in_step = false;
    settle(prefetches);
    if (planner == nullptr) return;
    if (planning) {
      if (nm_counter != nullptr && !plan_nm_rec.empty()) {
        plan_nm_rec.back() = std::max(plan_nm_rec.back(), nm_counter->interval_peak());
      }
      plan_nm = std::move(plan_nm_rec);
      plan_nm_rec.clear();
      plan_live = std::move(plan_live_rec);
      plan_live_rec.clear();
      planner->set_plan(std::move(plan_rec));
      plan_rec.clear();
      planning = false;
    } else if (diverged || nm_stale || cursor != static_cast<int64_t>(planner->plan_size())) {
      planner->clear_plan();
      planning = true;
      replans += 1;
    }
    planner->set_cursor(static_cast<int64_t>(planner->plan_size()));  // the optimizer step: next step's order
  }

  void after_op(const c10::OperatorHandle&, const std::vector<int64_t>& ids) override {
    for (int64_t id : ids) mgr->transition(param_chunk(params[id]), params[id].slot, TensorState::kHold);
    if (tracing()) {
      std::lock_guard<std::mutex> lock(recorder->mu);
      recorder->end_op(*mgr);
    }
  }

  // Non-model bytes where operators run: LibTorch's CPU allocator on the
  // emulated device, the CUDA caching allocator on a GPU.
  NonModelCounter* non_model_counter() const {
    if (device.is_cpu()) return &cpu_non_model_counter();
    NonModelCounter* c = cuda_non_model_counter(device.index());
    STRATA_CHECK(c != nullptr, "tracing and device_capacity on CUDA read the CUDA caching allocator's statistics, "
                 "but this LibTorch has no CUDA; build strata against a LibTorch with CUDA");
    return c;
  }

  void start_trace() {
    recorder = std::make_unique<TraceRecorder>();
    TraceRecorder& r = *recorder;
    r.path = options.trace_path;
    if (rank > 0) {
      // Data parallel: each rank records its own run; rank 0 keeps the name given.
      const std::filesystem::path given(options.trace_path);
      r.path = (given.parent_path() / (given.stem().string() + ".rank" + std::to_string(rank) +
                                        given.extension().string())).string();
    }
    r.steps_wanted = options.trace_steps;
    r.counter = non_model_counter();
    r.trace.device = mgr->device().name();
    r.trace.non_model_source = r.counter->source();
    r.trace.policy = options.policy;
    r.trace.prefetch = options.prefetch;
    r.trace.nvme_optim_fraction = options.nvme_optim_fraction;
    for (int t = 0; t < memory::kNumTiers; ++t) r.trace.budgets[t] = options.budgets.of(static_cast<Tier>(t));
    for (size_t id = 0; id < mgr->num_chunks(); ++id) {
      const memory::Chunk& c = mgr->chunk(static_cast<ChunkId>(id));
      r.trace.chunks.push_back({c.id(), c.family(), memory::chunk_role_name(c.role()), dtype_name(c.dtype()),
                                c.alloc_bytes(), c.capacity_elems(), c.layout().used_elems});
    }
    r.t0 = TraceRecorder::Clock::now();
  }

  void begin_traced_step() {
    if (!recorder || recorder->done) return;
    TraceRecorder& r = *recorder;
    r.recording = true;
    r.phase = "forward";
    r.step_first_op = static_cast<int64_t>(r.trace.ops.size());
    r.step_t0 = TraceRecorder::Clock::now();
    r.last = mgr->move_stats();
  }

  void end_traced_step() {
    if (!tracing()) return;
    TraceRecorder& r = *recorder;
    r.recording = false;
    memory::TraceStep st;
    st.index = static_cast<int>(r.trace.steps.size());
    st.first_op = r.step_first_op;
    st.end_op = static_cast<int64_t>(r.trace.ops.size());
    st.seconds = r.since(r.step_t0);
    r.trace.steps.push_back(st);
    if (static_cast<int>(r.trace.steps.size()) >= r.steps_wanted) {
      r.done = true;
      memory::write_trace(r.trace, r.path);
      STRATA_LOG(kInfo, "wrote the memory trace of {} steps ({} operators) to {}", r.trace.steps.size(),
                 r.trace.ops.size(), r.path);
    }
  }

  // Adds a gradient into the parameter's slot of its gradient chunk (Note
  // [Gradients go straight to their chunk]).
  void accumulate_grad(size_t index, const torch::Tensor& grad) {
    std::lock_guard<std::mutex> lock(grad_mu);
    Param& p = params[index];
    const ChunkId gc = mgr->family(p.family).grad;
    pin(gc, Tier::kHost, {p.slot});
    try {
      torch::NoGradGuard no_grad;
      torch::Tensor dst = torch::from_blob(static_cast<char*>(mgr->data(gc)) + p.offset * elem_size(), {p.numel},
                                           torch::TensorOptions().dtype(compute));
      dst.add_(grad.detach().to(torch::kCPU, compute).reshape({p.numel}));
    } catch (...) {
      unpin(gc, {p.slot});
      throw;
    }
    unpin(gc, {p.slot});
    p.has_grad = true;
    if (data_parallel() && boundary) {
      const size_t pos = family_pos.at(p.family);
      grads_arrived[pos] += 1;
      issue_ready_reductions();
      if (stage >= 2) settle_done_reductions();
    }
  }

  // See Note [Data parallel gradients]. Called with grad_mu held.
  // Stages 0 and 1 all-reduce the gradient chunk; stages 2 and 3
  // reduce-scatter it into the gradient shard (Note [ZeRO over chunks]).
  void issue_reduction(size_t pos) {
    const memory::ChunkFamily& fam = mgr->family(families[pos]);
    const ChunkId gc = fam.grad;
    pin(gc, Tier::kHost, all_slots(gc));  // stays on host, unmoved, while the collective reads it
    if (fam.grad_shard) {
      try {
        pin(*fam.grad_shard, Tier::kHost, {0});
      } catch (...) {
        unpin(gc, all_slots(gc));
        throw;
      }
      reductions[pos] = comm->reduce_scatter(mgr->data(gc), mgr->data(*fam.grad_shard),
                                             static_cast<size_t>(mgr->chunk(*fam.grad_shard).capacity_elems()),
                                             options.precision, ReduceOp::kSum);
    } else {
      reductions[pos] = comm->all_reduce(mgr->data(gc), static_cast<size_t>(mgr->chunk(gc).capacity_elems()),
                                         options.precision, ReduceOp::kSum);
    }
    collectives += 1;
  }
  // Waits for family position `pos`'s reduction and unpins its chunks; with
  // a gradient shard the full gradient chunk is no longer needed.
  void settle_reduction(size_t pos) {
    if (!reductions[pos]) return;
    const WorkHandle work = std::move(reductions[pos]);
    reductions[pos] = nullptr;
    const memory::ChunkFamily& fam = mgr->family(families[pos]);
    std::exception_ptr failure;
    try {
      work->wait();
    } catch (...) {
      failure = std::current_exception();
    }
    unpin(fam.grad, all_slots(fam.grad));
    if (fam.grad_shard) {
      unpin(*fam.grad_shard, {0});
      if (!failure) mgr->release(fam.grad);
    }
    if (failure) std::rethrow_exception(failure);
  }
  // Stages 2 and 3: full gradient chunks whose reduce-scatter has completed
  // are released during backward, so few exist at once.
  void settle_done_reductions() {
    for (size_t pos = reduce_cursor; pos < reductions.size(); ++pos) {
      if (reductions[pos] && reductions[pos]->done()) settle_reduction(pos);
    }
  }
  void issue_ready_reductions() {
    while (reduce_cursor > 0 &&
           grads_arrived[reduce_cursor - 1] == params_of_chunk.at(mgr->family(families[reduce_cursor - 1]).param).size()) {
      issue_reduction(--reduce_cursor);
    }
  }
  void begin_reductions() {
    std::fill(grads_arrived.begin(), grads_arrived.end(), 0);
    reductions.assign(families.size(), nullptr);
    reduce_cursor = families.size();
  }
  // After backward on an accumulation boundary: the rest of the families,
  // the "has a gradient" flags, then every reduction waited for.
  void finish_reductions() {
    {
      std::lock_guard<std::mutex> lock(grad_mu);
      while (reduce_cursor > 0) issue_reduction(--reduce_cursor);
    }
    std::vector<float> used(params.size());
    for (size_t i = 0; i < params.size(); ++i) used[i] = params[i].has_grad ? 1.0f : 0.0f;
    WorkHandle flags = comm->all_reduce(used.data(), used.size(), DType::kFloat32, ReduceOp::kMax);
    collectives += 1;
    std::exception_ptr failure;
    for (size_t pos = 0; pos < reductions.size(); ++pos) {
      try {
        settle_reduction(pos);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    try {
      flags->wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    if (failure) std::rethrow_exception(failure);
    for (size_t i = 0; i < params.size(); ++i) params[i].has_grad = used[i] > 0.0f;
  }

  // Every rank must pack the parameters into the same chunk families and plan
  // the same stage-3 gathers, or their collectives would pair the wrong
  // buffers: the layout and the options the gather schedule depends on are
  // compared across ranks at attach.
  void check_same_layout_on_every_rank() {
    std::vector<double> mine = {static_cast<double>(families.size()), static_cast<double>(stage),
                                static_cast<double>(options.budgets.device), options.prefetch ? 1.0 : 0.0,
                                options.device_capacity > 0 ? 1.0 : 0.0};
    double weighted = 0, total = 0;
    for (size_t i = 0; i < families.size(); ++i) {
      const double cap = static_cast<double>(mgr->family(families[i]).layout->capacity_elems);
      total += cap;
      weighted += cap * static_cast<double>(i + 1);
    }
    mine.push_back(total);
    mine.push_back(weighted);
    double numel = 0;
    for (const Param& p : params) numel += static_cast<double>(p.numel);
    mine.push_back(static_cast<double>(params.size()));
    mine.push_back(numel);
    const std::vector<double> all = all_gather_values(*comm, mine);
    for (int r = 0; r < world(); ++r) {
      const double* theirs = all.data() + static_cast<size_t>(r) * mine.size();
      STRATA_CHECK(std::equal(mine.begin(), mine.end(), theirs), "rank ", rank, " packs ", params.size(),
                   " parameters (", static_cast<int64_t>(numel), " elements) into ", families.size(),
                   " chunk families of ", static_cast<int64_t>(total),
                   " elements (ZeRO stage ", stage, ", device budget ", format_bytes(options.budgets.device),
                   ") but rank ", r, " packs ", static_cast<int64_t>(theirs[7]), " (", static_cast<int64_t>(theirs[8]),
                   " elements) into ", static_cast<int64_t>(theirs[0]), " of ",
                   static_cast<int64_t>(theirs[5]), " (stage ", static_cast<int>(theirs[1]), ", device budget ",
                   format_bytes(static_cast<uint64_t>(theirs[2])), "); every rank needs the same model, chunk_elems, "
                   "zero_stage, device budget, prefetch and device_capacity setting");
    }
  }

  // Gradient chunks are dropped, not zeroed: the next backward materialises
  // them zero-filled on host, and a chunk evicted to NVMe is never read back
  // only to be cleared.
  void zero_grads() {
    for (memory::FamilyId f : families) {
      const memory::ChunkFamily& fam = mgr->family(f);
      mgr->release(fam.grad);
      if (fam.grad_shard) mgr->release(*fam.grad_shard);
    }
    for (Param& p : params) p.has_grad = false;
  }

  // The optimizer state of a family: exp_avg, exp_avg_sq and the fp32 master.
  std::vector<ChunkId> optim_members(memory::FamilyId f) const {
    const memory::ChunkFamily& fam = mgr->family(f);
    std::vector<ChunkId> m = {fam.optim_states[0], fam.optim_states[1]};
    if (fam.master) m.push_back(*fam.master);
    return m;
  }
  // Everything the update of a family touches: its optimizer state, parameters and gradients.
  std::vector<ChunkId> step_members(memory::FamilyId f) const {
    std::vector<ChunkId> m = optim_members(f);
    m.push_back(step_param(f));
    m.push_back(step_grad(f));
    return m;
  }

  // Starts reads to host of the chunks not there yet (Note [The step pipeline]).
  // With `only_into_free`, only when they fit in the host tier's free bytes:
  // a read-ahead that had to evict would push out chunks the step needs.
  void read_ahead(const std::vector<ChunkId>& chunks, std::vector<offload::CopyTicket>& tickets,
                  bool only_into_free = false) {
    std::vector<ChunkId> wanted;
    uint64_t bytes = 0;
    for (ChunkId c : chunks) {
      const memory::Chunk& chunk = mgr->chunk(c);
      const auto at = chunk.location();
      if ((at && *at != Tier::kHost) || (!at && chunk.role() != memory::ChunkRole::kGrad)) {
        wanted.push_back(c);
        bytes += chunk.alloc_bytes();
      }
    }
    const memory::TierStats host = mgr->tier_stats(Tier::kHost);
    if (only_into_free && host.used + bytes > host.budget) return;
    for (ChunkId c : wanted) tickets.push_back(mgr->prefetch(c, Tier::kHost));
  }
  // Waits for read-ahead and prefetch tickets. A failed one left the chunk
  // where it was; the access that needed it moved it again and reported any
  // error itself.
  static void settle(std::vector<offload::CopyTicket>& tickets) {
    for (auto& t : tickets) {
      try {
        offload::CopyEngine::wait(t);
      } catch (const std::exception& e) {
        STRATA_LOG(kDebug, "read-ahead failed, the access retried it: {}", e.what());
      }
    }
    tickets.clear();
  }

  // Before backward: starts reading the optimizer state that lives on NVMe
  // back to host, family by family in step order, while it fits in the host
  // tier's free bytes less what backward and the step will place there
  // (gradient and parameter chunks), so the reads overlap backward instead
  // of the optimizer waiting for them (Note [The step pipeline]).
  std::vector<offload::CopyTicket> early;
  void read_optimizer_state_early() {
    const memory::TierStats host = mgr->tier_stats(Tier::kHost);
    uint64_t reserve = 0;
    for (memory::FamilyId f : families) {
      for (ChunkId c : {step_grad(f), step_param(f)}) {
        if (!mgr->chunk(c).resident_on(Tier::kHost)) reserve += mgr->chunk(c).alloc_bytes();
      }
    }
    uint64_t planned = host.used + reserve;
    for (size_t i = 0; i < families.size(); ++i) {
      if (!optim_on_nvme[i]) continue;
      std::vector<ChunkId> wanted;
      uint64_t bytes = 0;
      for (ChunkId c : optim_members(families[i])) {
        if (mgr->chunk(c).resident_on(Tier::kNvme)) {
          wanted.push_back(c);
          bytes += mgr->chunk(c).alloc_bytes();
        }
      }
      if (planned + bytes > host.budget) break;
      planned += bytes;
      for (ChunkId c : wanted) early.push_back(mgr->prefetch(c, Tier::kHost));
    }
  }

  // Global grad norm and overflow check: one read of every gradient chunk.
  kernels::GradStats grad_stats() {
    kernels::GradStats total;
    std::vector<offload::CopyTicket> ahead;
    for (size_t i = 0; i < families.size(); ++i) {
      const ChunkId gc = step_grad(families[i]);
      if (mgr->chunk(gc).location()) {  // never materialised: no gradient, zero
        const auto slots = all_slots(gc);
        const auto waited_from = Clock::now();
        pin(gc, Tier::kHost, slots);
        wait.optimizer += seconds_since(waited_from);
        if (i + 1 < families.size() && options.prefetch) {
          read_ahead({step_grad(families[i + 1])}, ahead, /*only_into_free=*/true);
        }
        total.merge(kernels::grad_stats(mgr->data(gc), options.precision, mgr->chunk(gc).capacity_elems()));
        unpin(gc, slots);
      }
    }
    settle(ahead);
    if (stage >= 2) {
      // Each rank holds its shard of the gradients: every rank sums all the
      // partial sums in rank order, so all get the same norm.
      const std::vector<double> all = all_gather_values(*comm, {total.sum_sq, total.finite ? 0.0 : 1.0});
      collectives += 1;
      total = kernels::GradStats{};
      for (int r = 0; r < world(); ++r) total.merge({all[2 * r], all[2 * r + 1] == 0.0});
    }
    return total;
  }

  // Pins family `index` on host, calls `pinned_hook` (the read-ahead of the
  // next family, which must not evict this one), then updates it.
  void update_family(size_t index, float grad_scale, const std::function<void()>& pinned_hook) {
    const memory::FamilyId f = families[index];
    const memory::ChunkFamily& fam = mgr->family(f);
    const auto waited_from = Clock::now();
    with_family_on_host(step_members(f), [&] {
      wait.optimizer += seconds_since(waited_from);  // the pins above waited for the chunks
      pinned_hook();
      const ChunkId pc = step_param(f), gc = step_grad(f);
      const ChunkId mc = fam.master ? *fam.master : pc;  // fp32 values: the master, or the fp32 parameters
      kernels::AdamParams ap;
      ap.lr = opt.lr;
      ap.beta1 = opt.beta1;
      ap.beta2 = opt.beta2;
      ap.eps = opt.eps;
      ap.weight_decay = opt.weight_decay;
      ap.grad_scale = grad_scale;
      ap.grads_known_finite = true;  // grad_stats() checked every chunk
      for (size_t i : params_of_chunk[fam.param]) {
        Param& p = params[i];
        if (!p.has_grad) continue;  // unused this step: no update, as torch.optim
        ap.step = ++p.steps;
        const auto [begin, end] = owned(p);  // Note [ZeRO over chunks]: this rank's part
        if (begin >= end) continue;
        kernels::OptimSpans s;
        s.n = end - begin;
        s.master = reinterpret_cast<float*>(at(mc, begin));
        s.grad = at(gc, begin);
        s.grad_dtype = options.precision;
        s.state0 = reinterpret_cast<float*>(at(fam.optim_states[0], begin));
        s.state1 = reinterpret_cast<float*>(at(fam.optim_states[1], begin));
        if (fam.master) {
          s.param_copy = at(pc, begin);
          s.param_dtype = options.precision;
        }
        kernels::adam_step(ap, s);
      }
    });
  }

  // Stages 1 and 2: every rank updated its shard of family f's parameter
  // chunk; the all-gather of the rest runs while the next family updates
  // (the chunk stays pinned on host until it is through).
  struct ParamGather {
    WorkHandle work;
    ChunkId chunk = -1;
  };
  std::deque<ParamGather> param_gathers;
  void start_param_gather(memory::FamilyId f) {
    const memory::ChunkFamily& fam = mgr->family(f);
    pin(fam.param, Tier::kHost, all_slots(fam.param));
    const int64_t shard = fam.layout->shards.shard_elems;
    ParamGather g;
    g.chunk = fam.param;
    try {
      g.work = comm->all_gather(at(fam.param, rank * shard), mgr->data(fam.param), static_cast<size_t>(shard),
                                options.precision);
    } catch (...) {
      unpin(fam.param, all_slots(fam.param));
      throw;
    }
    param_gathers.push_back(std::move(g));
    collectives += 1;
  }
  // Waits for the oldest gathers until at most `keep` are in flight.
  void finish_param_gathers(size_t keep) {
    std::exception_ptr failure;
    while (param_gathers.size() > keep) {
      ParamGather g = std::move(param_gathers.front());
      param_gathers.pop_front();
      try {
        g.work->wait();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      unpin(g.chunk, all_slots(g.chunk));
    }
    if (failure) std::rethrow_exception(failure);
  }

  // Returns false when the step was skipped for overflow.
  bool step(double& grad_norm) {
    const double average = 1.0 / (options.grad_accumulation * (data_parallel() ? comm->world_size() : 1));
    const kernels::GradStats total = grad_stats();
    if (!total.finite) {
      skipped += 1;
      clean_steps = 0;
      if (options.precision == DType::kFloat16) {
        const double next = std::max(scale * options.loss_scale.backoff, options.loss_scale.min_scale);
        STRATA_LOG(kInfo, "fp16 gradients overflowed at loss scale {}: step skipped, scale now {}", scale, next);
        scale = next;
      } else {
        STRATA_LOG(kWarn, "gradients hold inf or nan in a {} run: step skipped", dtype_name(options.precision));
      }
      settle(early);
      zero_grads();
      return false;
    }
    grad_norm = std::sqrt(total.sum_sq) * average / scale;
    double multiplier = average / scale;
    if (options.clip_norm > 0) multiplier *= kernels::clip_coefficient(grad_norm, options.clip_norm);

    std::vector<offload::CopyTicket> ahead, behind;
    try {
      for (size_t i = 0; i < families.size(); ++i) {
        update_family(i, static_cast<float>(multiplier), [&] {
          if (i + 1 < families.size() && options.prefetch) {
            read_ahead(step_members(families[i + 1]), ahead, /*only_into_free=*/true);
          }
        });
        if (optim_on_nvme[i]) {
          for (ChunkId c : optim_members(families[i])) behind.push_back(mgr->prefetch(c, Tier::kNvme));
        }
        if (stage == 1 || stage == 2) {
          start_param_gather(families[i]);
          finish_param_gathers(1);  // the previous family's gather overlapped this family's update
        }
      }
      finish_param_gathers(0);
    } catch (...) {
      try {
        finish_param_gathers(0);
      } catch (...) {  // the first failure is the one reported
      }
      settle(ahead);
      settle(early);
      for (auto& t : behind) t.wait();
      throw;
    }
    settle(ahead);
    settle(early);  // started before backward; the accesses above waited for them (counted) or retried them
    for (auto& t : behind) offload::CopyEngine::wait(t);  // a failed write-back is the step's error
    zero_grads();
    if (options.precision == DType::kFloat16 && ++clean_steps >= options.loss_scale.growth_interval) {
      scale *= options.loss_scale.growth_factor;
      clean_steps = 0;
    }
    return true;
  }

  void place_optimizer_state() {
    optim_on_nvme.assign(families.size(), false);
    if (options.budgets.nvme == 0) return;
    std::vector<uint64_t> bytes;
    for (memory::FamilyId f : families) {
      uint64_t b = 0;
      for (ChunkId c : optim_members(f)) b += mgr->chunk(c).alloc_bytes();
      bytes.push_back(b);
    }
    const size_t n = families.size();
    const size_t on_nvme = memory::nvme_optim_families(bytes, options.nvme_optim_fraction, options.budgets.host);
    for (size_t i = n - on_nvme; i < n; ++i) optim_on_nvme[i] = true;
  }

  // Trainable parameters in the order their bytes lie in chunk families.
  std::vector<size_t> params_in_chunk_order() const {
    std::unordered_map<memory::FamilyId, size_t> rank;
    for (size_t i = 0; i < families.size(); ++i) rank[families[i]] = i;
    std::vector<size_t> order(params.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const Param& pa = params[a];
      const Param& pb = params[b];
      return rank[pa.family] != rank[pb.family] ? rank[pa.family] < rank[pb.family] : pa.offset < pb.offset;
    });
    return order;
  }

  // Visits the chunk families in step order, each with `chunks(f)` pinned on
  // host; `each(param, family)` runs for its parameters in chunk order, after
  // `pinned(i)` for family i. Checkpoint save, load and weight export stream
  // through it, one family at a time.
  template <typename Chunks, typename Each>
  void stream_families(Chunks chunks, Each each, const std::function<void(size_t)>& pinned = nullptr) {
    const std::vector<size_t> order = params_in_chunk_order();
    size_t next = 0;
    for (size_t i = 0; i < families.size(); ++i) {
      const memory::FamilyId f = families[i];
      const memory::ChunkFamily& fam = mgr->family(f);
      with_family_on_host(chunks(f), [&] {
        if (pinned) pinned(i);
        for (; next < order.size() && params[order[next]].family == f; ++next) each(params[order[next]], fam);
      });
    }
  }

  // Pins the given chunks on host for `fn`, unpinning however it ends.
  template <typename Fn>
  void with_family_on_host(const std::vector<ChunkId>& chunks, Fn fn) {
    std::vector<ChunkId> pinned;
    try {
      for (ChunkId c : chunks) {
        pin(c, Tier::kHost, all_slots(c));
        pinned.push_back(c);
      }
      fn();
    } catch (...) {
      for (ChunkId c : pinned) unpin(c, all_slots(c));
      throw;
    }
    for (ChunkId c : pinned) unpin(c, all_slots(c));
  }

  // A family's fp32 values over its whole layout: the master weights in mixed
  // precision, else the parameters. Sharded (stage 1 or 2 in mixed precision,
  // stage 3) they are all-gathered, so every rank must call this for the same
  // families in the same order.
  std::vector<float> family_values(memory::FamilyId f) {
    const memory::ChunkFamily& fam = mgr->family(f);
    const ChunkId c = fam.master ? *fam.master : step_param(f);
    const memory::Chunk& chunk = mgr->chunk(c);
    std::vector<float> full(static_cast<size_t>(fam.layout->capacity_elems));
    std::vector<float> part(chunk.shard() ? static_cast<size_t>(chunk.capacity_elems()) : 0);
    float* dst = chunk.shard() ? part.data() : full.data();
    if (chunk.location()) mgr->read(c, dst, static_cast<size_t>(chunk.capacity_elems()) * sizeof(float));
    if (chunk.shard()) gather_shards(c, part.data(), full.data());
    return full;
  }
  // Every rank's shard of sharded chunk `c` (this rank's at `shard`, on host)
  // into `whole`, which holds the family layout's capacity in c's dtype.
  void gather_shards(ChunkId c, const void* shard, void* whole) {
    const memory::Chunk& chunk = mgr->chunk(c);
    comm->all_gather(shard, whole, static_cast<size_t>(chunk.capacity_elems()), chunk.dtype())->wait();
  }

  void detach_all() noexcept {
    try {
      for (Param& p : params) {
        if (!p.accumulator) continue;
        auto& hooks = p.accumulator->pre_hooks();
        hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                   [](const auto& h) { return dynamic_cast<GradToChunk*>(h.get()) != nullptr; }),
                    hooks.end());
        p.accumulator.reset();
      }
      if (hook) {
        for (Param& p : params) hook->untrack(p.tensor);
      }
      std::unordered_map<memory::FamilyId, std::vector<float>> copies;
      for (memory::FamilyId f : families) copies[f] = family_values(f);
      for (Param& p : params) {
        const std::vector<float>& data = copies[p.family];
        torch::NoGradGuard no_grad;
        torch::Tensor owned = torch::from_blob(const_cast<float*>(data.data()) + p.offset, p.tensor.sizes(), torch::kFloat32)
                                  .clone()
                                  .to(p.original_device);
        p.tensor.set_data(owned);
      }
      torch::NoGradGuard no_grad;
      for (Cast& c : casts) c.tensor.set_data(c.tensor.to(c.original));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[strata error] could not give parameters their memory back: %s\n", e.what());
    }
  }
};


/// Copies the tensors of a safetensors file into `module`'s parameters,
/// matched by named_parameters() name (EngineOptions::init_weights).
void import_weights(torch::nn::Module& module, const std::string& path);

}  // namespace strata::parallel
