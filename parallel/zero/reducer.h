#pragma once
// GradientReducer: sums gradient chunks over the data-parallel ranks during
// backward, chunk family by chunk family (Note [Data parallel gradients]):
// an all-reduce of the full gradient chunk at ZeRO stages 0 and 1, a
// reduce-scatter into the rank's gradient shard at stages 2 and 3 (Note
// [ZeRO over chunks]). The step divides by the ranks (and micro-steps).

#include <atomic>
#include <mutex>
#include <vector>

#include "../runtime/context.h"

namespace strata::parallel {

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
//
// "All its gradients are in" is learnt, not guessed, as in Note [Updates in
// backward]: a parameter's gradient may arrive more than once in one
// backward (a weight shared by two checkpointed blocks arrives once from
// each recomputation), and a family reduced at its first parameters'
// arrivals would be summed without the later ones, which then land in a
// chunk the reduction is reading. So each backward counts the arrivals of
// every parameter, and in the next one a family is ready once each of its
// trainable parameters has arrived as often as then. The first backward
// reduces every family after it ends; a parameter that then arrives less
// often holds its family back to the end of backward too. One that arrives
// more often than before after its family was sent is an error naming it,
// raised before its gradient touches the chunk.
class GradientReducer {
 public:
  explicit GradientReducer(EngineContext& ctx);

  /// Before the backward that ends an accumulation.
  void begin();
  /// Between begin() and finish(): gradients arriving are counted.
  bool active() const { return active_; }
  /// Before parameter `index`'s gradient is added to its chunk: throws when
  /// its family's reduction was issued already (see the Note).
  void check_open(size_t index);
  /// Parameter `index`'s gradient is in its chunk: issues the reductions
  /// that became ready, in order, and at stages 2-3 releases the full
  /// gradient chunks whose reduce-scatter completed.
  void arrived(size_t index);
  /// After backward: the remaining families and the "has a gradient" flags,
  /// then every reduction waited for. The first failure is rethrown.
  void finish();
  /// Waits for the oldest reduction in flight and unpins its chunks; false
  /// when none is in flight. EngineContext::make_room calls it.
  bool settle_oldest();
  /// A backward that threw (Note [A train_step that throws]): stops
  /// counting arrivals and waits for the reductions in flight, whatever their
  /// outcome, so no collective still reads a gradient chunk. Never throws.
  void abandon() noexcept;

 private:
  void issue(size_t pos);
  void settle(size_t pos);
  void settle_done();
  void issue_ready();

  EngineContext& ctx_;
  std::recursive_mutex mu_;  // settle_oldest may come from a pin inside issue()
  std::atomic<bool> active_{false};  // read by the autograd threads delivering gradients
  static constexpr int kNever = 1 << 30;  // a family that waits for finish()
  std::vector<int> arrivals_;   // per parameter, this backward
  std::vector<int> expected_;   // per parameter, the last backward that finished; empty before one
  std::vector<int> unsettled_;  // per family position: its trainable parameters short of their arrivals, or kNever
  // Per family position: null before it is issued (positions below cursor_)
  // and again once settled.
  std::vector<WorkHandle> reductions_;
  size_t cursor_ = 0;  // families at positions >= this have been issued
};

}  // namespace strata::parallel
