#pragma once
// Tensor parallelism, 1D (Megatron-LM): layers whose weights are split over
// the ranks of a tensor group (DeviceMesh::group(kTensor), or any
// Communicator), each rank holding and training its slice. docs/tensor_parallel.md.
//
//   ColumnParallelLinear  weight rows (output features) split; input replicated
//   RowParallelLinear     weight columns (input features) split; output all-reduced
//   VocabParallelEmbedding  vocabulary rows split; output all-reduced
//   vocab_parallel_cross_entropy  loss over logits split by vocabulary, never gathered
//
// A column-parallel layer followed by a row-parallel one (an MLP, or
// attention split by heads) communicates once forward (the row layer's
// all-reduce) and once backward (the column layer's input gradient):
// Note [Megatron's f and g]. Every rank of the group must run the same layers
// in the same order. The group's communicator must outlive the layers.
//
// With an engine: attach(module, optimizer, options) on every rank trains
// each rank's slices in its own chunks (offload, traces and checkpoints as
// for any module); pass a data-parallel communicator (the mesh's data axis),
// never the tensor group, as attach's comm. Gradient-norm clipping is global
// across the tensor group (tensor_group_of).

#include <torch/torch.h>

#include "strata/parallel/communicator.h"

namespace strata::parallel {

// Note [Megatron's f and g]: the four autograd collectives of 1D tensor parallelism.
/// Identity forward; backward all-reduces the gradient over the group (f).
torch::Tensor copy_to_group(const torch::Tensor& x, Communicator& group);
/// All-reduce forward; identity backward (g).
torch::Tensor reduce_from_group(const torch::Tensor& x, Communicator& group);
/// This rank's slice of the last dimension forward; all-gather backward.
torch::Tensor scatter_to_group(const torch::Tensor& x, Communicator& group);
/// All-gather along the last dimension forward; this rank's slice backward.
torch::Tensor gather_from_group(const torch::Tensor& x, Communicator& group);

/// Note [Megatron's sequence parallelism]: between a row-parallel layer and
/// the next column-parallel one (norms, dropout, residuals) every rank of the
/// tensor group would compute the same whole activation; instead each keeps
/// 1/P of the sequence. The row layer's all-reduce becomes a reduce-scatter
/// along the sequence, the column layer's input is all-gathered along it
/// (its backward reduce-scatters, replacing f's all-reduce), and parameters
/// used on the shards (norms, the row layer's bias) get their gradients
/// summed over the group. Same bytes as 1D, 1/P of those activations.
/// All-gather along `dim` forward; reduce-scatter backward.
torch::Tensor gather_sequence(const torch::Tensor& x, Communicator& group, int64_t dim);
/// Reduce-scatter along `dim` (the sum over the group, this rank's slice) forward; all-gather backward.
torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, Communicator& group, int64_t dim);

/// The tensor group parameter `param` is split over (its rank's slice), or
/// null for a parameter no parallel layer split (replicated over the group).
/// The engine uses it for gradient-norm clipping (Note [Clipping across the
/// tensor group]): it counts every slice and each replicated parameter once.
Communicator* tensor_group_of(const torch::Tensor& param);
/// How many ranks of its tensor group hold the same part as this rank: 1 for
/// a unique slice, q for a 2D LayerNorm's slice (one per grid row), 0 when
/// `param` is not split (then every rank of the group holds all of it).
int tensor_copies_of(const torch::Tensor& param);
/// Records that `param` holds this rank's part over `group`, the same on
/// `copies` ranks of it (the layers and parallelize() do it).
void mark_split(const torch::Tensor& param, Communicator& group, int copies = 1);

/// The [begin, end) of `n` this rank holds when split evenly over the group;
/// a clear error when the group's size does not divide `n`.
std::pair<int64_t, int64_t> slice_of(int64_t n, Communicator& group, const char* what);

struct ColumnParallelLinearImpl : torch::nn::Module {
  /// The rows [out * r / P, out * (r + 1) / P) of a torch::nn::Linear(in, out)
  /// built here with LibTorch's own initialisation (the same values a single
  /// process gets with the same seed). `gather_output`: all-gather the
  /// output's last dimension (else each rank keeps its slice).
  ColumnParallelLinearImpl(int64_t in, int64_t out, Communicator& group, bool bias = true, bool gather_output = false);
  /// The same slice of an existing layer's weights.
  ColumnParallelLinearImpl(const torch::nn::Linear& full, Communicator& group, bool gather_output = false);
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;  // [out / P, in], [out / P]
  Communicator* group;
  bool gather_output;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearImpl : torch::nn::Module {
  /// The columns [in * r / P, in * (r + 1) / P) of a torch::nn::Linear(in,
  /// out); the bias is whole on every rank and added after the all-reduce.
  /// `input_is_parallel`: the input already holds this rank's slice of its
  /// last dimension (a column-parallel layer's output), else it is sliced here.
  RowParallelLinearImpl(int64_t in, int64_t out, Communicator& group, bool bias = true, bool input_is_parallel = true);
  RowParallelLinearImpl(const torch::nn::Linear& full, Communicator& group, bool input_is_parallel = true);
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;  // [out, in / P], [out]
  Communicator* group;
  bool input_is_parallel;
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingImpl : torch::nn::Module {
  /// The rows [vocab * r / P, vocab * (r + 1) / P) of a torch::nn::Embedding(vocab, dim).
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, Communicator& group);
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, Communicator& group);
  torch::Tensor forward(const torch::Tensor& ids);

  torch::Tensor weight;  // [vocab / P, dim]
  int64_t vocab_begin = 0, vocab_end = 0;
  Communicator* group;
};
TORCH_MODULE(VocabParallelEmbedding);

/// Rows of `ids` looked up in a vocabulary split over the group, this rank's
/// slice `weight` holding rows [vocab_begin, vocab_begin + weight.size(0)):
/// each rank looks up its own ids (zeros for the others) and the rows are
/// all-reduced. `padding_idx` (a whole-vocabulary id, or -1) gets no gradient.
/// `sequence_dim` >= 0: reduce-scattered along that dimension instead, each
/// rank keeping its sequence shard (Note [Megatron's sequence parallelism]).
torch::Tensor vocab_parallel_embedding(const torch::Tensor& weight, const torch::Tensor& ids, int64_t vocab_begin,
                                       Communicator& group, int64_t padding_idx = -1, int64_t sequence_dim = -1);

/// Mean cross-entropy of `logits` [N, V / P] (this rank's vocabulary slice,
/// columns [V * r / P, V * (r + 1) / P)) against `target` [N] (ids in [0, V)),
/// as torch::nn::functional::cross_entropy on the whole logits, without
/// gathering them: a max, a sum of exponentials and the target's logit are
/// all-reduced (N values each). Computed in fp32.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                           Communicator& group);

}  // namespace strata::parallel
