#pragma once
// What the tensor- and sequence-parallel autograd functions share: a
// communicator group carried through AutogradContext, host buffers Gloo can
// move, and GroupFunction, an autograd function that applies one collective
// forward and its transpose backward. Private to strata_parallel.

#include <torch/autograd.h>
#include <torch/types.h>

#include "strata/parallel/communicator.h"

namespace strata::parallel::group_ops {

/// The group as an IValue (AutogradContext::saved_data holds IValues), and back.
inline c10::IValue to_value(Communicator& g) { return c10::IValue(static_cast<int64_t>(reinterpret_cast<intptr_t>(&g))); }
inline Communicator& from_context(torch::autograd::AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
}

/// An owned, contiguous host copy of `x` in a dtype Gloo moves (fp32 or fp16).
inline torch::Tensor host_buffer(const torch::Tensor& x) {
  torch::Tensor h = x.detach().to(torch::kCPU).contiguous().clone();
  if (h.scalar_type() != torch::kFloat32 && h.scalar_type() != torch::kFloat16) h = h.to(torch::kFloat32);
  return h;
}

using Collective = torch::Tensor (*)(const torch::Tensor&, Communicator&);

/// `Forward(x, group)` forward, `Backward(grad, group)` backward: each
/// collective's autograd function names the pair (Backward the transpose of Forward).
template <Collective Forward, Collective Backward>
struct GroupFunction : torch::autograd::Function<GroupFunction<Forward, Backward>> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, Communicator* g, const torch::Tensor& x) {
    ctx->saved_data["group"] = to_value(*g);
    return Forward(x, *g);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {torch::Tensor(), Backward(grads[0], from_context(ctx))};
  }
};

}  // namespace strata::parallel::group_ops
