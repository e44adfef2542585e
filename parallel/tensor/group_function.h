#pragma once
// What the tensor- and sequence-parallel autograd functions share: a
// communicator group carried through AutogradContext, host buffers Gloo can
// move, and GroupFunction, an autograd function that applies one collective
// forward and its transpose backward. Private to strata_parallel.

#include <torch/autograd.h>
#include <torch/types.h>

#include "strata/parallel/communicator.h"
#include "strata/parallel/tensor_collectives.h"
#include "strata/parallel/tensor_parallel.h"

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

// The collectives on tensors, each returning a new tensor on x's device and
// dtype (through a host buffer: Gloo moves host memory).
inline torch::Tensor identity(const torch::Tensor& x, Communicator&) { return x; }

inline torch::Tensor all_reduce_over(const torch::Tensor& x, Communicator& group, ReduceOp op = ReduceOp::kSum) {
  if (group.world_size() == 1) return x;
  torch::Tensor h = host_buffer(x);
  all_reduce(group, h, op)->wait();
  return h.to(x.device(), x.scalar_type());
}
inline torch::Tensor all_reduce_sum(const torch::Tensor& x, Communicator& group) { return all_reduce_over(x, group); }

/// Every rank's x stacked along a new first dimension.
inline torch::Tensor all_gather_stacked(const torch::Tensor& x, Communicator& group) {
  torch::Tensor h = host_buffer(x);
  std::vector<int64_t> shape{group.world_size()};
  for (int64_t s : h.sizes()) shape.push_back(s);
  torch::Tensor out = torch::empty(shape, h.options());
  all_gather(group, h, out)->wait();
  return out.to(x.device(), x.scalar_type());
}
inline torch::Tensor all_gather_last(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  return torch::cat(all_gather_stacked(x, group).unbind(0), -1);
}
inline torch::Tensor all_gather_first(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  return all_gather_stacked(x, group).flatten(0, 1);
}

/// `stacked` [world_size, ...]: this rank's block of the sum over ranks.
inline torch::Tensor reduce_scatter_stacked(const torch::Tensor& stacked, Communicator& group) {
  const torch::Tensor h = host_buffer(stacked);
  torch::Tensor out = torch::empty(h.sizes().slice(1), h.options());
  reduce_scatter(group, h, out)->wait();
  return out.to(stacked.device(), stacked.scalar_type());
}
/// The sum over ranks of x, this rank's slice of its last dimension.
inline torch::Tensor reduce_scatter_last(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  return reduce_scatter_stacked(torch::stack(x.chunk(group.world_size(), -1), 0), group);
}
/// The sum over ranks of x, this rank's slice of its first dimension.
inline torch::Tensor reduce_scatter_first(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  std::vector<int64_t> shape{group.world_size(), x.size(0) / group.world_size()};
  for (int64_t i = 1; i < x.dim(); ++i) shape.push_back(x.size(i));
  return reduce_scatter_stacked(x.reshape(shape), group);
}

/// All-gather along dimension Dim (Megatron's sequence parallelism).
template <int Dim>
torch::Tensor all_gather_dim(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  return torch::cat(all_gather_stacked(x, group).unbind(0), Dim);
}
/// The sum over ranks of x, this rank's slice of dimension Dim.
template <int Dim>
torch::Tensor reduce_scatter_dim(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  slice_of(x.size(Dim), group, "the sequence dimension");  // a clear error when the group does not divide it
  return reduce_scatter_stacked(torch::stack(x.chunk(group.world_size(), Dim), 0), group);
}

inline torch::Tensor own_slice_last(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  const auto [begin, end] = slice_of(x.size(-1), group, "the last dimension");
  return x.narrow(-1, begin, end - begin).contiguous();
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
