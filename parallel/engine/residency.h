#pragma once
// Residency: where parameter chunks are while operators run. It keeps every
// parameter's storage on its chunk (Note [Parameter storages follow their
// chunk]), pins an operator's chunks on the device tier for the operator,
// follows the "auto" policy's plan and prefetches by it (Note [Belady over
// the recorded operator sequence]), streams the chunks static placement does
// not hold (Note [Static placement]), and budgets the device around
// activations (Note [Device capacity]). ZeRO stage 3's gathers are not here:
// zero/gathers.h materialises the chunks this then pins.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../runtime/context.h"
#include "strata/memory/eviction_policy.h"
#include "strata/parallel/memory_counter.h"

namespace strata::parallel {

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
// Note [Staging the next operators' chunks from NVMe]
// prefetch_next moves chunks to the device only into free bytes: a device
// prefetch must never evict, or it could move more than the plan's Belady
// order. Beyond memory the device and host tiers are always full, so that
// rule alone left every parameter chunk that had gone to NVMe to be read when
// its operator asked: the disk and the compute took turns (issue #32). So,
// while each operator runs, the chunks the plan's next operators use that lie
// on NVMe are read into the host tier, evicting there as the optimizer's
// read-ahead does (Note [Reading the next family ahead]). The host tier's
// victim is its least recently used chunk: in forward, the optimizer state
// the last update left; in backward, the parameters forward used first,
// whose next use is the latest. The look-ahead stops at kStageLookaheadOps
// operators or a window of 1/kStageWindowFraction of the host budget (at
// least one chunk), so what it evicts for chunks not yet needed stays a small
// part of the tier; one batch is in flight at a time. A staged read is one a
// demand read would have made an operator or a few later, so the bytes read
// are the same; the host only holds them sooner. The device copy still
// happens at the operator (or by prefetch_next, when there is room).
constexpr int64_t kStageLookaheadOps = 64;
constexpr uint64_t kStageWindowFraction = 16;

class Residency {
 public:
  explicit Residency(EngineContext& ctx) : ctx_(ctx) {}

  /// The device policy EngineOptions::policy names, for the chunk manager
  /// (null: the manager's LRU). Called once, before the manager exists.
  std::unique_ptr<memory::EvictionPolicy> make_policy();
  /// After the parameters are registered: the chunks static placement holds.
  void hold_static_chunks();
  /// See Note [Parameter storages follow their chunk]. Runs under the manager's lock.
  void on_placed(const memory::Chunk& c, std::optional<Tier> tier, void* ptr);
  /// Budgets the device around the non-model bytes `counter` sees (Note [Device capacity]).
  void enable_capacity(NonModelCounter& counter) { nm_counter_ = &counter; }
  bool capacity_enabled() const { return nm_counter_ != nullptr; }

  /// Forward and backward of a train_step: operators follow (or record) the plan.
  void begin_step();
  /// After backward: a recorded plan takes effect; a step that departed from
  /// it records a new one next time.
  void end_step();
  bool in_step() const { return in_step_; }
  /// A step that threw (Note [A train_step that throws]): waits for
  /// prefetches and records the operator sequence again next step.
  void abort_step();
  /// Operators outside a train_step (Engine::run): not the planned sequence, LRU.
  void leave_plan();

  /// The distinct parameter chunks of parameters `ids`, in first-use order, and their bytes.
  std::vector<ChunkId> chunks_of(const std::vector<int64_t>& ids, uint64_t& bytes) const;
  /// Before an operator on `chunks` (bytes `needed`): follows the plan,
  /// returns the previous operator's streamed chunks, applies the device
  /// capacity, and checks the operator fits in the device budget at all.
  void prepare(const std::string& op, const std::string& first_param, const std::vector<ChunkId>& chunks,
               uint64_t needed);
  /// Makes the chunks of parameters `ids` resident on the device and pins their slots.
  void pin_operator(const std::vector<int64_t>& ids);
  void unpin_operator(const std::vector<int64_t>& ids);
  /// Starts moves of the next operators' chunks to the device when they fit
  /// without evicting, and reads the next ones on NVMe into the host tier
  /// (Note [Staging the next operators' chunks from NVMe]).
  void prefetch_next();
  /// Before an operator without parameters: see Note [Device capacity].
  void relieve_capacity();

  int64_t replans() const { return replans_; }
  /// The lowest chunk budget the device-capacity rule set, UINT64_MAX if none.
  uint64_t capacity_floor() const { return capacity_floor_; }

 private:
  void stage_next();
  static bool all_finished(const std::vector<offload::CopyTicket>& tickets);
  void follow_plan(const std::string& op, const std::vector<ChunkId>& chunks);
  void return_streamed(const std::vector<ChunkId>& chunks);
  void apply_capacity(const std::string& op, uint64_t needed);
  uint64_t usable_capacity() const;

  EngineContext& ctx_;
  // Note [Belady over the recorded operator sequence] (eviction_policy.h).
  memory::TracePolicy* planner_ = nullptr;  // owned by the manager; null unless policy "auto"
  memory::StaticPolicy* placement_ = nullptr;  // owned by the manager; null unless policy "static"
  // Note [Static placement]: the streamed chunks of the last operator with
  // parameters, returned to host before the next one.
  std::vector<ChunkId> streamed_;
  bool in_step_ = false;  // forward/backward of a train_step is running
  bool planning_ = true;  // this step records the plan
  bool diverged_ = false;
  int64_t cursor_ = 0;
  std::vector<std::vector<ChunkId>> plan_rec_;
  std::vector<offload::CopyTicket> prefetches_;
  std::vector<offload::CopyTicket> staged_;  // NVMe -> host reads of stage_next, one batch in flight
  int64_t replans_ = 0;
  NonModelCounter* nm_counter_ = nullptr;
  std::vector<uint64_t> plan_nm_rec_, plan_nm_;      // non-model peak after each planned operator
  std::vector<uint64_t> plan_live_rec_, plan_live_;  // non-model bytes live as each planned operator began
  bool nm_stale_ = false;  // this step's activations departed from the plan's
  uint64_t capacity_floor_ = UINT64_MAX;
};

}  // namespace strata::parallel
