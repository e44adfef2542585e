// Tensor parallelism, 1D (Megatron-LM): the autograd collectives and the layers.
//
// Note [Megatron's f and g]
// A column-parallel linear Y_r = X A_r needs the whole input X on every rank
// and produces a slice of the output; a row-parallel linear Z = sum_r Y_r B_r
// takes those slices and sums the partial products over the group. So
// forward needs one all-reduce (g, after the row layer) and backward one (f,
// before the column layer: dL/dX = sum_r dL/dY_r A_r^T). f and g are each
// other's transpose: f is the identity forward and an all-reduce backward, g
// the reverse. scatter/gather along the last dimension are the same pair for
// layers used alone. The collectives run on host buffers (Gloo moves host
// memory): a CUDA tensor is copied to host and back.
#include <torch/autograd.h>

#include "strata/core/error.h"
#include "strata/parallel/tensor_collectives.h"
#include "strata/parallel/tensor_parallel.h"

#include "../dispatch/placement.h"
#include "../comm/group_function.h"

namespace strata::parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using group_ops::all_reduce_over;
using group_ops::all_reduce_sum;
using group_ops::GroupFunction;
using group_ops::identity;
using group_ops::own_slice_last;

// Note [Megatron's f and g]: each is the other's transpose.
using CopyToGroup = GroupFunction<identity, all_reduce_sum>;          // f
using ReduceFromGroup = GroupFunction<all_reduce_sum, identity>;      // g
using ScatterToGroup = GroupFunction<own_slice_last, group_ops::all_gather_dim<-1>>;
using GatherFromGroup = GroupFunction<group_ops::all_gather_dim<-1>, own_slice_last>;

// Note [Cross-entropy over a split vocabulary]: loss_i = log sum_v exp(z_iv)
// - z_i,t_i. Each rank holds columns [b, e) of z. The max (for stability), the
// sum of exponentials and the target's logit (held by one rank, zero
// elsewhere) are all-reduced; the gradient softmax - onehot is local.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, Communicator* g, const torch::Tensor& logits,
                               const torch::Tensor& target) {
    const auto [begin, end] = slice_of(logits.size(-1) * g->world_size(), *g, "the vocabulary");
    const torch::Tensor z32 = logits.to(torch::kFloat32);
    const torch::Tensor max = all_reduce_over(std::get<0>(z32.max(-1)), *g, ReduceOp::kMax);
    const torch::Tensor z = z32 - max.unsqueeze(-1);
    const torch::Tensor e = z.exp();
    const torch::Tensor sum = all_reduce_sum(e.sum(-1), *g);
    const torch::Tensor mine = (target >= begin) & (target < end);
    const torch::Tensor local = (target - begin).masked_fill(~mine, 0);
    const torch::Tensor picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0);
    const torch::Tensor target_logit = all_reduce_sum(picked, *g);
    const torch::Tensor loss = (sum.log() - target_logit).mean();
    ctx->save_for_backward({e / sum.unsqueeze(-1), local, mine});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss.to(logits.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    torch::Tensor d = s[0].clone();  // softmax over the whole vocabulary, this rank's columns
    d.scatter_add_(-1, s[1].unsqueeze(-1), -s[2].to(d.scalar_type()).unsqueeze(-1));
    d.mul_(grads[0].to(torch::kFloat32) / static_cast<double>(d.size(0)));
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {torch::Tensor(), d.to(dtype), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor copy_to_group(const torch::Tensor& x, Communicator& group) { return CopyToGroup::apply(&group, x); }

namespace {
// Note [Megatron's sequence parallelism]: all-gather along the sequence forward, reduce-scatter backward; and the transpose.
template <int Dim>
using GatherSequence = group_ops::GatherSummed<Dim>;
template <int Dim>
using ReduceScatterSequence = group_ops::ReduceScatterGathered<Dim>;

int64_t sequence_dim(const torch::Tensor& x, int64_t dim) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  STRATA_CHECK(d >= 0 && d < x.dim() && d < 4, "sequence dimension ", dim, " of a tensor of ", x.dim(),
               " dimensions: give one of its first four");
  return d;
}
}  // namespace

torch::Tensor gather_sequence(const torch::Tensor& x, Communicator& group, int64_t dim) {
  switch (sequence_dim(x, dim)) {
    case 0: return GatherSequence<0>::apply(&group, x);
    case 1: return GatherSequence<1>::apply(&group, x);
    case 2: return GatherSequence<2>::apply(&group, x);
    default: return GatherSequence<3>::apply(&group, x);
  }
}

torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, Communicator& group, int64_t dim) {
  switch (sequence_dim(x, dim)) {
    case 0: return ReduceScatterSequence<0>::apply(&group, x);
    case 1: return ReduceScatterSequence<1>::apply(&group, x);
    case 2: return ReduceScatterSequence<2>::apply(&group, x);
    default: return ReduceScatterSequence<3>::apply(&group, x);
  }
}
torch::Tensor reduce_from_group(const torch::Tensor& x, Communicator& group) {
  return ReduceFromGroup::apply(&group, x);
}
torch::Tensor scatter_to_group(const torch::Tensor& x, Communicator& group) { return ScatterToGroup::apply(&group, x); }
torch::Tensor gather_from_group(const torch::Tensor& x, Communicator& group) {
  return GatherFromGroup::apply(&group, x);
}

std::pair<int64_t, int64_t> slice_of(int64_t n, Communicator& group, const char* what) {
  const int64_t p = group.world_size();
  STRATA_CHECK(n % p == 0, "tensor parallelism over ", p, " ranks splits ", what, " (", n, ") evenly; choose sizes "
               "divisible by the tensor-parallel size");
  const int64_t share = n / p;
  return {share * group.rank(), share * (group.rank() + 1)};
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& weight, const torch::Tensor& ids, int64_t vocab_begin,
                                       Communicator& group, int64_t padding_idx, int64_t sequence_dim) {
  const torch::Tensor rows = group_ops::vocab_block_rows(weight, ids, vocab_begin, padding_idx);
  return sequence_dim < 0 ? reduce_from_group(rows, group) : reduce_scatter_sequence(rows, group, sequence_dim);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                           Communicator& group) {
  STRATA_CHECK(logits.dim() == 2 && target.dim() == 1 && target.size(0) == logits.size(0),
               "vocab_parallel_cross_entropy takes logits [N, V / P] and targets [N]; reshape them first (got ",
               logits.sizes(), " and ", target.sizes(), ")");
  return VocabParallelCrossEntropy::apply(&group, logits, target);
}

// --- layers ------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, Communicator& g, bool with_bias,
                                                   bool gather)
    : ColumnParallelLinearImpl(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(with_bias)), g, gather) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full, Communicator& g, bool gather)
    : group(&g), gather_output(gather) {
  const auto [begin, end] = slice_of(full->weight.size(0), g, "the output features");
  const tensor_layout::Cut rows = [b = begin, e = end](const torch::Tensor& t) { return t.narrow(0, b, e - b); };
  checkpoint::PartMap map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, rows, &map));
  tensor_layout::place(weight, g, 1, nullptr, map);
  if (full->bias.defined()) {
    bias = register_parameter("bias", tensor_layout::cut_part(full->bias, rows, &map));
    tensor_layout::place(bias, g, 1, nullptr, map);
  }
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = torch::nn::functional::linear(copy_to_group(x, *group), weight, bias);
  return gather_output ? gather_from_group(y, *group) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, Communicator& g, bool with_bias, bool parallel_in)
    : RowParallelLinearImpl(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(with_bias)), g, parallel_in) {}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full, Communicator& g, bool parallel_in)
    : group(&g), input_is_parallel(parallel_in) {
  const auto [begin, end] = slice_of(full->weight.size(1), g, "the input features");
  checkpoint::PartMap map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [b = begin, e = end](const torch::Tensor& t) {
    return t.narrow(1, b, e - b);
  }, &map));
  tensor_layout::place(weight, g, 1, nullptr, map);  // the bias is whole: replicated over the group
  torch::NoGradGuard no_grad;
  if (full->bias.defined()) bias = register_parameter("bias", full->bias.clone());
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  const torch::Tensor part = input_is_parallel ? x : scatter_to_group(x, *group);
  torch::Tensor y = reduce_from_group(torch::nn::functional::linear(part, weight), *group);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, Communicator& g)
    : VocabParallelEmbeddingImpl(torch::nn::Embedding(vocab, dim), g) {}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, Communicator& g) : group(&g) {
  std::tie(vocab_begin, vocab_end) = slice_of(full->weight.size(0), g, "the vocabulary");
  checkpoint::PartMap map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [b = vocab_begin, e = vocab_end](
                                                                    const torch::Tensor& t) { return t.narrow(0, b, e - b); },
                                                                &map));
  tensor_layout::place(weight, g, 1, nullptr, map);
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  return vocab_parallel_embedding(weight, ids, vocab_begin, *group);
}

}  // namespace strata::parallel
