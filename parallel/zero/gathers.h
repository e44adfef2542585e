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

#include "../runtime/context.h"

namespace strata::parallel {

// Note [Gathers agreed in rounds]
// Collectives pair across ranks by order: the k-th all-gather of every rank
// meets the k-th of every other. Ranks that run different operators on
// parameters (a data-dependent branch: MoE routing, a layer skipped on some
// batches) need different chunks at different times, so gathers issued
// straight from each rank's own operators would pair different chunks and
// read one another's shards as their own: parameters corrupted, no error.
// So a rank never issues a data gather alone. When an operator's window
// lacks chunks, the rank enters a round: one small all-gather in which every
// rank states the chunks it wants now (at most kRoundChunks; more take more
// rounds), or that it is done for this step. Every rank receives the same
// lists and gathers the union, in the same order (by rank, then as listed),
// one all-gather per chunk: into the chunk on the device for a rank that
// wants it, into a transient host buffer for a rank that only serves it. A
// rank whose forward and backward ended (or whose evaluation or single
// operator between steps ended) keeps entering rounds as "done", serving the
// others, until every rank is done. Rounds are entered only by a rank that
// wants something or is done, so every round makes progress, and ranks that
// run the same operators want the same chunks in the same rounds, which
// costs one small all-gather per round over gathering directly. A rank that
// stops taking part (an exception, a different number of steps) leaves the
// others waiting in a round until their communicator times out: an error,
// never a mismatched pair.
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
  /// chunks outside the window, takes part in rounds for those the window
  /// lacks, and waits for this operator's own. `in_step`: inside a
  /// train_step's forward or backward, where the sequence is planned.
  void before_operator(const std::vector<ChunkId>& chunks, bool in_step);
  /// After this rank's last operator of a step, evaluation or operator
  /// between steps: serves the other ranks' rounds until every rank is done.
  void finish_rounds();
  /// After finish_rounds: every gathered chunk is released.
  void release_all();

  int64_t gathers() const { return gathers_; }
  /// Of gathers(), those issued for a later operator than the one about to run.
  int64_t gathers_ahead() const { return gathers_ahead_; }
  /// Rounds taken part in, and gathers this rank served without wanting the chunk.
  int64_t rounds() const { return rounds_; }
  int64_t served() const { return served_; }
  static constexpr int kRoundChunks = 16;

 private:
  struct Gather {
    WorkHandle work;  // null once complete
    ChunkId shard = -1;
  };
  /// One round: `want` (at most kRoundChunks) or done. Returns whether every rank was done.
  bool round(const std::vector<ChunkId>& want, bool done);
  void start(ChunkId c);
  void serve(ChunkId c);
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
  int64_t rounds_ = 0;
  int64_t served_ = 0;
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
  /// Waits for the oldest gather in flight and unpins its chunk; false when
  /// none is in flight. EngineContext::make_room calls it: a family's step
  /// that finds no room on host waits for the gathers holding it.
  bool settle_oldest();

 private:
  struct ParamGather {
    WorkHandle work;
    ChunkId chunk = -1;
  };
  EngineContext& ctx_;
  std::deque<ParamGather> in_flight_;
};

}  // namespace strata::parallel
