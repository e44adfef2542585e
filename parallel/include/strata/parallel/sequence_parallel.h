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

#include <torch/torch.h>

#include "strata/parallel/communicator.h"

namespace strata::parallel {

/// This rank's part of `x` split evenly along `dim` over the group (rank r
/// takes the r-th of N equal parts); a clear error when N does not divide it.
torch::Tensor split_sequence(const torch::Tensor& x, int64_t dim, Communicator& group);

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

}  // namespace strata::parallel
