#pragma once
// TiedParameters: a parameter whose copies several pipeline stages hold.
// Private to strata_parallel.
//
// Note [Tied parameters across stages]
// A model may use one parameter in layers that a pipeline cuts onto
// different ranks: GPT-2's output projection is the token embedding's table.
// Each of those stages' engines then holds a copy, under the name the model
// first registers it by (pipeline.cpp, Note [Parameters across stages]). A
// copy must train exactly as the one parameter of a single process does:
//   - attach finds the copies: every stage's engine gathers its parameters'
//     checkpoint names and parts over the pipeline group, and a name that
//     several stages hold is tied over those stages (same shape and
//     optimizer group, which the pipeline selects by the first name on
//     every stage; else attach refuses, before any data moves). Each
//     rank set holding a tie gets a group of its own, split from the pipeline
//     group in the same order on every member;
//   - after backward and the data-parallel reductions, each tied gradient is
//     summed over its stages (an all-reduce over the tie's group, tied
//     parameters in name order, after one small gather of which stages used
//     each), so every copy gets the gradient one process's parameter gets,
//     and the copies update alike from equal state;
//   - the gradient norm counts each tied parameter once: each copy
//     contributes 1/stage_copies of its squares (as tensor parallelism's
//     replicated parts do, Note [Clipping across the tensor group]);
//   - a checkpoint holds it once, from the lowest pipeline rank holding it
//     (CheckpointSave::choose_pieces); every copy loads it by that name. A
//     save mid-accumulation is refused: each copy's gradient is then still
//     its own stage's part, and a checkpoint holds one.
// The sum needs the whole gradient after backward, so with tied parameters
// the step takes gradient statistics after backward, and updates in
// backward wait for the step (as with a hook before the step).

#include <memory>
#include <vector>

#include "../runtime/context.h"

namespace strata::parallel {

class ParamAccess;

class TiedParameters {
 public:
  /// Finds the tied parameters (a collective over the pipeline group, after
  /// the parameters have their checkpoint names, parts and groups) and sets
  /// their stage_copies and ctx.stages_tied. Without a pipeline of several
  /// ranks, finds none and runs no collective.
  explicit TiedParameters(EngineContext& ctx);
  bool empty() const { return ties_.empty(); }
  /// Sums each tied gradient over its stages (Note [Tied parameters across
  /// stages]); `access` has its gradients open.
  void sum_gradients(ParamAccess& access);

 private:
  struct Tie {
    std::vector<size_t> params;            // this rank's copies, by name
    std::unique_ptr<Communicator> group;   // over the pipeline ranks holding them
  };
  EngineContext& ctx_;
  std::vector<Tie> ties_;
};

}  // namespace strata::parallel
