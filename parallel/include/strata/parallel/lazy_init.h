#pragma once
// Lazy construction: building a module whose weights do not fit in memory.
//
//   std::optional<Gpt> model;
//   {
//     strata::parallel::LazyInit lazy;  // parameters made on this thread take no memory
//     model.emplace(config);            // the module's own constructor and initialisers run
//   }
//   strata::parallel::Engine engine = strata::parallel::attach(*model, ...);  // each parameter
//                                     // materialised straight into its chunk slot
//
// While a LazyInit is alive on a thread, the floating-point CPU tensors that
// thread creates with empty, zeros, ones or full (what torch::nn modules make
// their parameters and buffers with) are lazy: real tensors, of the right
// sizes, dtype and device, whose storage has no memory. In-place operators on
// them (the initialisers: uniform_, normal_, zero_, fill_, copy_ from a real
// tensor, through views too) are recorded instead of run, each random one with
// the state of its generator (Note [Replaying initialisers]). Materialising
// runs the record into memory given then, so a lazily constructed module
// holds, parameter for parameter, what the same code constructs eagerly from
// the same seed, and the random generators end where eager construction
// leaves them.
//
// `attach` materialises each lazy parameter into its chunk slots, one at a
// time, with chunks spilling to NVMe as the host tier fills, and
// EngineOptions::init_weights reads a lazy parameter's tensor from the file
// as it is materialised. Any other operator that reads a lazy tensor's values
// gives it memory first (and works as it would eagerly), so nothing reads an
// unset value; materialize(module) does that for a whole module used
// without an engine.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <memory>

namespace strata::parallel {

/// Makes tensors created on this thread lazy while it lives (nests; not movable).
class LazyInit {
 public:
  LazyInit();
  ~LazyInit();
  LazyInit(const LazyInit&) = delete;
  LazyInit& operator=(const LazyInit&) = delete;

 private:
  struct Guard;
  std::unique_ptr<Guard> guard_;
};

/// Whether `t`'s storage is lazy (has no memory yet).
bool is_lazy(const torch::Tensor& t);

/// A new tensor with memory holding the values lazy tensor `t` stands for
/// (`t` itself stays lazy); `t` itself when it is not lazy.
torch::Tensor materialized_copy(const torch::Tensor& t);

/// Gives lazy tensor `t`'s storage memory holding its values, in place
/// (every view of it sees them); nothing when `t` is not lazy.
void materialize(const torch::Tensor& t);

/// Gives every lazy parameter and buffer of `module` its memory and values,
/// in place (for a module used without attach).
void materialize(torch::nn::Module& module);

/// From now on, `t` (lazy, and all of its storage) materialises as what `fill`
/// writes into a tensor of `t`'s sizes, replacing what was recorded for it
/// (safetensors import reads the file then).
void defer_fill(const torch::Tensor& t, std::function<void(torch::Tensor&)> fill);

}  // namespace strata::parallel
