#pragma once
// Parameter all-gathers of ZeRO (Note [ZeRO over chunks]):
// - OperatorGathers, stage 3: before each operator, the full parameter
//   chunks of a window of operators are gathered from the ranks' shards
//   straight into the device tier, ahead of the operators that need them.
// - StepGathers, stages 1 and 2: after a family's shard is updated, its
//   parameter chunk is all-gathered in place while the next family updates.

#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "../engine/context.h"

namespace strata::parallel {

// Note [Gathers checked by chunk]
// Stage-3 gathers pair across ranks by order: the k-th gather of every rank
// meets the k-th of every other. Ranks that run different operators on
// parameters (a data-dependent branch: MoE routing, a layer skipped on some
// batches) would pair gathers of different chunks and read one another's
// shards as their own, corrupting parameters with no error. So every data
// gather is preceded, on the same communicator, by an all-gather of the chunk
// id each rank gathers; before a gathered chunk is used the ids are compared,
// and since every rank receives the same ids, every rank finds a mismatch at
// the same gather and fails with the same error, naming the chunks and their
// parameters. The check costs one small collective per gather, issued
// asynchronously with it. Making such models train at stage 3 (an agreed
// gather schedule across ranks) is not done; stage 2 trains them.
class OperatorGathers {
 public:
  /// Gathers run on a communicator split from ctx.comm (Note [ZeRO over chunks]).
  explicit OperatorGathers(EngineContext& ctx);

  /// A train_step's forward and backward begin: the operator sequence is followed (or recorded).
  void begin_step();
  /// A step that threw: the sequence it saw is incomplete; record it again next step.
  void abort_step() { recording_ = true; rec_.clear(); }
  /// After backward: a recorded sequence becomes the plan; a step that
  /// departed from it records again next time.
  void end_step();
  /// Before an operator on parameter chunks `chunks`: releases gathered
  /// chunks outside the window, issues the gathers the window lacks, and
  /// waits for this operator's own. `in_step`: inside a train_step's forward
  /// or backward, where the sequence is planned.
  void before_operator(const std::vector<ChunkId>& chunks, bool in_step);
  /// After backward (and evaluation): every gathered chunk is released.
  void release_all();

  int64_t gathers() const { return gathers_; }
  /// Of gathers(), those issued for a later operator than the one about to run.
  int64_t gathers_ahead() const { return gathers_ahead_; }

 private:
  struct Gather {
    WorkHandle work;  // null once complete
    ChunkId shard = -1;
    // Note [Gathers checked by chunk]: [this rank's chunk id, every rank's].
    WorkHandle ids_work;
    std::shared_ptr<std::vector<float>> ids;
  };
  void check_paired(const Gather& g) const;
  void start(ChunkId c);
  void finish(Gather& g, ChunkId c);

  EngineContext& ctx_;
  std::unique_ptr<Communicator> comm_;
  std::vector<std::pair<ChunkId, Gather>> gathered_;  // full parameter chunks held now, in gather order
  std::vector<std::vector<ChunkId>> plan_, rec_;      // the operator sequence's parameter chunks
  bool recording_ = true;
  bool diverged_ = false;
  int64_t cursor_ = 0;
  int64_t gathers_ = 0;
  int64_t gathers_ahead_ = 0;
};

class StepGathers {
 public:
  explicit StepGathers(EngineContext& ctx) : ctx_(ctx) {}
  /// Starts the all-gather of family `f`'s parameter chunk from every rank's
  /// updated shard; the chunk stays pinned on host until it is through.
  void start(memory::FamilyId f);
  /// Waits for the oldest gathers until at most `keep` are in flight; the
  /// first failure is rethrown after all of those are waited for.
  void finish(size_t keep);

 private:
  struct ParamGather {
    WorkHandle work;
    ChunkId chunk = -1;
  };
  EngineContext& ctx_;
  std::deque<ParamGather> in_flight_;
};

}  // namespace strata::parallel
