#pragma once
// Sequence parallelism: each rank of a sequence group holds S / N of every
// sequence. docs/sequence.md.
//
// Ulysses (DeepSpeed-Ulysses): attention on sequence-sharded q, k, v
// [B, H, S/N, D] runs as an all-to-all to head-sharded [B, H/N, S, D], plain
// attention over the whole sequence for H/N heads, and an all-to-all back
// (Note [Ulysses]). The head count must divide by N.
//
// Ring self-attention (the Colossal-AI paper's): keys, then values, travel
// the ring of ranks; each rank computes its rows of the scores and the output
// (Note [Ring self-attention]).
//
// Ring attention (blockwise, online softmax): key and value blocks travel
// the ring while each rank keeps a running softmax over its query rows, so no
// rank holds more than one block of scores: O(S/N) activations per rank.
// The zigzag layout balances causal work (Note [Ring attention]).

#include <torch/torch.h>

#include <string>

#include "strata/parallel/communicator.h"

namespace strata::parallel {

/// This rank's part of `x` split evenly along `dim` over the group (rank r
/// takes the r-th of N equal parts); a clear error when N does not divide it.
torch::Tensor split_sequence(const torch::Tensor& x, int64_t dim, Communicator& group);

/// How a sequence is laid out over the ranks: contiguous (rank r holds the
/// r-th of N parts) or zigzag (rank r holds chunks r and 2N-1-r of 2N).
enum class SequenceLayout { kContiguous = 0, kZigzag = 1 };
/// This rank's part of `x` along `dim` in the zigzag layout: chunks r and
/// 2N-1-r of 2N, concatenated; a clear error when 2N does not divide it.
torch::Tensor split_sequence_zigzag(const torch::Tensor& x, int64_t dim, Communicator& group);

/// [B, H, S/N, D] sequence-sharded -> [B, H/N, S, D] head-sharded (all-to-all); backward the reverse.
torch::Tensor sequence_to_heads(const torch::Tensor& x, Communicator& group);
/// [B, H/N, S, D] head-sharded -> [B, H, S/N, D] sequence-sharded; backward the reverse.
torch::Tensor heads_to_sequence(const torch::Tensor& x, Communicator& group);

/// Scaled dot-product attention of sequence-sharded q, k, v [B, H, S/N, D]
/// (rank r holding positions [r S/N, (r+1) S/N)), `causal` over the whole
/// sequence; returns this rank's [B, H, S/N, D] of the output. Equal to
/// attention on the whole sequence in one process, forward and backward.
torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                Communicator& group, bool causal);

/// The paper's ring self-attention (Note [Ring self-attention]): the same
/// arguments and result as ulysses_attention, with keys and then values
/// passed around the ring in N - 1 hops; any head count. Each rank holds
/// its rows of the scores against the whole sequence (S^2 / N per head).
torch::Tensor ring_self_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  Communicator& group, bool causal);

/// Ring attention (Note [Ring attention]): q, k, v [B, H, s, D] in `layout`
/// (split_sequence or split_sequence_zigzag of the whole [B, H, S, D]);
/// returns this rank's rows of attention over the whole sequence, `causal`
/// by global position, forward and backward equal to one process's. Blocks
/// of s x s scores at a time: activations O(S/N) per rank. Computes in fp32.
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             Communicator& group, bool causal, SequenceLayout layout = SequenceLayout::kContiguous);

namespace sequence {

/// Which sequence-parallel attention an Attention module runs.
enum class Mode { kRingAttention, kUlysses, kRingSelfAttention };
/// "ring-attention", "ulysses" or "ring-self-attention"; anything else is an error naming them.
Mode parse_mode(const std::string& name);
const char* mode_name(Mode mode);

struct AttentionOptions {
  Mode mode = Mode::kRingAttention;
  bool causal = true;
  /// Ring attention's layout (zigzag balances causal work); Ulysses and ring
  /// self-attention take the contiguous one.
  SequenceLayout layout = SequenceLayout::kZigzag;
};

/// Scaled dot-product attention over a sequence split across `group`, the
/// mode chosen by option: q, k, v [batch, heads, local positions, head_dim]
/// hold this rank's positions (shard()); the result is this rank's rows of
/// attention over the whole sequence, forward and backward equal to one
/// process's. A drop-in for the attention of a model whose inputs are
/// sharded with shard() and whose position embedding takes positions().
struct AttentionImpl : torch::nn::Module {
  /// The group must outlive the module. Ulysses needs the heads divisible by
  /// the group's size (checked at forward, before any collective).
  explicit AttentionImpl(Communicator& group, AttentionOptions options = {});
  /// The same, keeping `group` alive for as long as the module (a
  /// DeviceMesh's sequence group: DeviceMesh::group(kSequence)).
  explicit AttentionImpl(std::shared_ptr<Communicator> group, AttentionOptions options = {});
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
  /// This rank's positions of whole tensors along `dim`, in the mode's layout
  /// (split_sequence, or split_sequence_zigzag for zigzag ring attention).
  torch::Tensor shard(const torch::Tensor& x, int64_t dim) const;
  /// The global positions (int64) of this rank's `local` positions, for a position embedding.
  torch::Tensor positions(int64_t local) const;
  /// The layout the mode takes its inputs in.
  SequenceLayout layout() const;

  Communicator* group;
  AttentionOptions options;
  std::shared_ptr<Communicator> owner;  // null when made from a Communicator&
};
TORCH_MODULE(Attention);

}  // namespace sequence

}  // namespace strata::parallel
