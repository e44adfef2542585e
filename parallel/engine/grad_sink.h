#pragma once
// GradSink: where parameters' gradients go. A pre-hook on every parameter's
// gradient accumulator adds the gradient into the parameter's slot of its
// family's gradient chunk (Note [Gradients go straight to their chunk]) and
// tells the data-parallel reducer, when there is one, that it arrived.
// Between steps the gradient chunks are dropped (zero()).

#include <functional>
#include <mutex>
#include <vector>

#include "../runtime/context.h"

namespace strata::parallel {

class GradientReducer;

// Note [Gradients go straight to their chunk]
// A tensor hook (Tensor::register_hook) cannot drop a gradient: an undefined
// return value means "unchanged", so AccumulateGrad would still store it in
// .grad and every parameter's gradient would exist twice until backward ends.
// Instead a pre-hook sits on the parameter's AccumulateGrad node (the same
// node in LibTorch 1.13 and 2.x, which both run Node::pre_hooks before
// apply): it adds the gradient into the gradient chunk and returns an
// undefined gradient, which AccumulateGrad ignores. The engine keeps the
// node alive, since the parameter itself only holds it weakly.
class GradSink {
 public:
  /// `reducer`: the data-parallel reducer told of each arrival, or null.
  GradSink(EngineContext& ctx, GradientReducer* reducer) : ctx_(ctx), reducer_(reducer) {}

  /// Puts the pre-hook on every parameter's gradient accumulator (after the
  /// parameter got its chunk storage: a change of dtype gives it a new accumulator).
  void install();
  /// Parameter `index` got a new gradient accumulator (Tensor::set_data to
  /// another dtype or device drops the old one): moves the pre-hook to it.
  void reinstall(size_t index);
  /// Takes the pre-hooks off again. Never throws.
  void uninstall() noexcept;
  /// Adds `grad` into parameter `index`'s slot of its gradient chunk, in the
  /// compute precision, on host.
  void accumulate(size_t index, const torch::Tensor& grad);
  /// Drops every gradient chunk: the next backward materialises them
  /// zero-filled on host, and a chunk evicted to NVMe is never read back
  /// only to be cleared.
  void zero();

  /// Note [Gradient statistics as families complete]: `hook(family,
  /// complete)` runs on every arrival while tracking, with the family's
  /// gradient chunk pinned where the sink wrote it; `complete` is true
  /// when every trainable parameter of the family has arrived once since
  /// track(true).
  void set_arrival_hook(std::function<void(memory::FamilyId, bool complete)> hook) { hook_ = std::move(hook); }
  /// Note [Updates in backward]: `hook(index)` runs after each arrival of
  /// parameter `index`'s gradient while tracking, once the sink has let go
  /// of the gradient chunk and of its lock, on the thread that delivered it.
  void set_settled_hook(std::function<void(size_t index)> hook) { settled_ = std::move(hook); }
  /// Starts (or stops) counting arrivals afresh: at the backward that ends
  /// an accumulation, when nothing changes the gradients after it.
  void track(bool on);

 private:
  void add(size_t index, const torch::Tensor& grad);

  EngineContext& ctx_;
  GradientReducer* reducer_;
  std::mutex mu_;
  std::function<void(memory::FamilyId, bool)> hook_;
  std::function<void(size_t)> settled_;
  bool tracking_ = false;
  std::vector<bool> arrived_;     // by parameter index, since track(true)
  std::vector<size_t> missing_;   // by family position: trainable parameters not yet arrived
};

}  // namespace strata::parallel
