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
/// All-gather along dimension Dim (-1: the last): every rank's x, in rank order.
template <int Dim>
torch::Tensor all_gather_dim(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  const torch::Tensor stacked = all_gather_stacked(x, group);
  if constexpr (Dim == 0) return stacked.flatten(0, 1);  // already in place: no copy
  return torch::cat(stacked.unbind(0), Dim);
}

/// `stacked` [world_size, ...]: this rank's block of the sum over ranks.
inline torch::Tensor reduce_scatter_stacked(const torch::Tensor& stacked, Communicator& group) {
  const torch::Tensor h = host_buffer(stacked);
  torch::Tensor out = torch::empty(h.sizes().slice(1), h.options());
  reduce_scatter(group, h, out)->wait();
  return out.to(stacked.device(), stacked.scalar_type());
}
/// The sum over ranks of x, this rank's slice of dimension Dim (-1: the last);
/// a clear error when the group does not divide it.
template <int Dim>
torch::Tensor reduce_scatter_dim(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  const int64_t p = group.world_size();
  slice_of(x.size(Dim), group, "the dimension reduce-scattered");
  if constexpr (Dim == 0) {  // the blocks are already contiguous: a view
    std::vector<int64_t> shape{p, x.size(0) / p};
    for (int64_t i = 1; i < x.dim(); ++i) shape.push_back(x.size(i));
    return reduce_scatter_stacked(x.reshape(shape), group);
  }
  return reduce_scatter_stacked(torch::stack(x.chunk(p, Dim), 0), group);
}

/// This rank's slice of dimension Dim (-1: the last).
template <int Dim>
torch::Tensor own_slice(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  const auto [begin, end] = slice_of(x.size(Dim), group, Dim == 0 ? "the first dimension" : "the last dimension");
  return x.narrow(Dim, begin, end - begin).contiguous();
}
inline torch::Tensor own_slice_last(const torch::Tensor& x, Communicator& group) { return own_slice<-1>(x, group); }

/// Rows of `ids` looked up in a vocabulary block, `weight` holding rows
/// [begin, begin + weight.size(0)): the ids outside it give zero rows (the
/// other blocks' ranks supply them). `padding_idx` is a whole-vocabulary id or -1.
inline torch::Tensor vocab_block_rows(const torch::Tensor& weight, const torch::Tensor& ids, int64_t begin,
                                      int64_t padding_idx = -1) {
  const int64_t end = begin + weight.size(0);
  const torch::Tensor outside = (ids < begin) | (ids >= end);
  const torch::Tensor local = (ids - begin).masked_fill(outside, 0);
  const int64_t local_padding = padding_idx >= begin && padding_idx < end ? padding_idx - begin : -1;
  return torch::embedding(weight, local, local_padding).masked_fill(outside.unsqueeze(-1), 0.0);
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

/// A sum every rank uses differently: all-reduced forward and backward.
using AllReduceBoth = GroupFunction<all_reduce_sum, all_reduce_sum>;
/// Gathered along Dim for several ranks' uses (a sequence, a weight): the
/// gradient's blocks summed back to their owners.
template <int Dim>
using GatherSummed = GroupFunction<all_gather_dim<Dim>, reduce_scatter_dim<Dim>>;
/// Gathered along Dim for a use every rank makes alike (the same loss of the
/// whole output on every rank): backward keeps this rank's slice of the gradient.
template <int Dim>
using GatherKept = GroupFunction<all_gather_dim<Dim>, own_slice<Dim>>;
/// Partial sums reduce-scattered along Dim; backward all-gathers.
template <int Dim>
using ReduceScatterGathered = GroupFunction<reduce_scatter_dim<Dim>, all_gather_dim<Dim>>;

}  // namespace strata::parallel::group_ops
