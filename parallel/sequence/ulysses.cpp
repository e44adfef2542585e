// Note [Ulysses]
// Attention mixes positions but not heads. With the sequence split over N
// ranks, an all-to-all regroups the data so that each rank holds every
// position of H/N heads: rank r sends its positions of head group j to rank
// j and receives head group r's positions from every rank, in rank order,
// which is sequence order. Attention then runs locally over the whole
// sequence (the causal mask is the ordinary one), and the inverse
// all-to-all returns each rank its positions of every head. Each all-to-all
// is the other's backward, so the gradients are exact: nothing is divided or
// reduced. Per layer, q, k, v and the output each cross the group once each
// way (4 all-to-alls forward, 4 backward) at 1/N of the activation per rank.
#include <torch/autograd.h>

#include <cmath>

#include "strata/core/error.h"
#include "strata/parallel/sequence_parallel.h"
#include "strata/parallel/tensor_collectives.h"
#include "../comm/group_function.h"

namespace strata::parallel {

namespace {

// Block j of `blocks` [N, ...] to rank j, block j of the result from rank j.
torch::Tensor exchange(const torch::Tensor& blocks, Communicator& group) {
  const torch::Tensor in = group_ops::host_buffer(blocks);
  torch::Tensor out = torch::empty_like(in);
  all_to_all(group, in, out)->wait();
  return out.to(blocks.device(), blocks.scalar_type());
}

torch::Tensor to_heads(const torch::Tensor& x, Communicator& group) {  // [B, H, s, D] -> [B, H/N, N s, D]
  const int64_t n = group.world_size(), b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  STRATA_CHECK(h % n == 0, "Ulysses sequence parallelism over ", n, " ranks splits the ", h,
               " attention heads evenly; use a head count divisible by the sequence-parallel size");
  if (n == 1) return x;
  const torch::Tensor blocks = x.reshape({b, n, h / n, s, d}).permute({1, 0, 2, 3, 4});
  const torch::Tensor got = exchange(blocks, group);  // [N (source rank = sequence chunk), B, H/N, s, D]
  return got.permute({1, 2, 0, 3, 4}).reshape({b, h / n, n * s, d});
}

torch::Tensor to_sequence(const torch::Tensor& x, Communicator& group) {  // [B, H/N, S, D] -> [B, H, S/N, D]
  const int64_t n = group.world_size(), b = x.size(0), hn = x.size(1), full = x.size(2), d = x.size(3);
  STRATA_CHECK(full % n == 0, "a sequence of ", full, " positions does not split over ", n, " ranks");
  if (n == 1) return x;
  const int64_t s = full / n;
  const torch::Tensor blocks = x.reshape({b, hn, n, s, d}).permute({2, 0, 1, 3, 4});
  const torch::Tensor got = exchange(blocks, group);  // [N (source rank = head group), B, H/N, s, D]
  return got.permute({1, 0, 2, 3, 4}).reshape({b, n * hn, s, d});
}

// Each all-to-all is the other's backward (Note [Ulysses]).
using SequenceToHeads = group_ops::GroupFunction<to_heads, to_sequence>;
using HeadsToSequence = group_ops::GroupFunction<to_sequence, to_heads>;

}  // namespace

torch::Tensor split_sequence(const torch::Tensor& x, int64_t dim, Communicator& group) {
  const int64_t n = group.world_size(), len = x.size(dim);
  STRATA_CHECK(len % n == 0, "a sequence of ", len, " positions does not split evenly over ", n,
               " sequence-parallel ranks; pad it to a multiple of ", n, " (and mask the padding)");
  const int64_t part = len / n;
  return x.narrow(dim, part * group.rank(), part);
}

torch::Tensor sequence_to_heads(const torch::Tensor& x, Communicator& group) {
  STRATA_CHECK(x.dim() == 4, "sequence_to_heads takes [batch, heads, positions, head_dim], got ", x.sizes());
  return SequenceToHeads::apply(&group, x);
}

torch::Tensor heads_to_sequence(const torch::Tensor& x, Communicator& group) {
  STRATA_CHECK(x.dim() == 4, "heads_to_sequence takes [batch, heads / N, positions, head_dim], got ", x.sizes());
  return HeadsToSequence::apply(&group, x);
}

torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                Communicator& group, bool causal) {
  STRATA_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes(),
               "ulysses_attention takes q, k, v of one shape [batch, heads, positions / N, head_dim]; got ",
               q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  STRATA_CHECK(q.size(1) % group.world_size() == 0, "Ulysses sequence parallelism over ", group.world_size(),
               " ranks splits the ", q.size(1), " attention heads evenly; use a head count divisible by the "
               "sequence-parallel size");
  const torch::Tensor qh = sequence_to_heads(q, group), kh = sequence_to_heads(k, group),
                      vh = sequence_to_heads(v, group);
  torch::Tensor scores = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  if (causal) {
    const int64_t s = qh.size(2);
    const torch::Tensor mask = torch::ones({s, s}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  return heads_to_sequence(torch::matmul(torch::softmax(scores, -1), vh), group);
}

}  // namespace strata::parallel
