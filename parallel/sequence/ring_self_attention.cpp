// Note [Ring self-attention]
// The paper's ring self-attention (Li et al., "Sequence Parallelism: Long
// Sequence Training from System Perspective"): rank r holds the queries,
// keys and values of positions [r s, (r+1) s), s = S / N. Keys travel the
// ring in N - 1 hops (each rank passes what it holds to the next and takes
// the previous rank's), so rank r forms its s rows of the scores against
// every position; the softmax runs on whole rows (the causal mask by global
// position); then values travel the ring the same way and each rank sums
// its rows' products with every chunk. Each hop is an autograd function
// whose backward is the hop in the other direction, so backward is exact by
// construction: a key chunk's gradient travels back to the rank that holds
// it, summed over every rank whose queries used it, and no gradient is
// divided by N (Colossal-AI's legacy version divided some and not others,
// their examples #155). Every rank builds the same graph in the same order,
// so the hops of backward pair across ranks in the same order too (pairing
// by parity, ring::exchange). Scores take S * s per head per rank (S^2 / N), as in the paper.
#include <torch/autograd.h>

#include <cmath>
#include <limits>

#include "strata/core/error.h"
#include "strata/parallel/sequence_parallel.h"
#include "../comm/group_function.h"
#include "ring.h"

namespace strata::parallel {

namespace {

constexpr uint32_t kRingTag = 0x5241;  // "RA"; ordering on the communicator pairs the hops

torch::Tensor to_next(const torch::Tensor& x, Communicator& group) { return ring::exchange(x, group, +1, kRingTag); }
torch::Tensor to_previous(const torch::Tensor& x, Communicator& group) { return ring::exchange(x, group, -1, kRingTag); }
// A hop's gradient goes back to the rank the chunk came from.
using RingHop = group_ops::GroupFunction<to_next, to_previous>;

// Every rank's chunk of `x`, by the rank that holds it, through N - 1 hops.
std::vector<torch::Tensor> around_the_ring(const torch::Tensor& x, Communicator& group) {
  const int n = group.world_size(), r = group.rank();
  std::vector<torch::Tensor> chunks(static_cast<size_t>(n));
  chunks[static_cast<size_t>(r)] = x;
  torch::Tensor cur = x;
  for (int h = 1; h < n; ++h) {
    cur = RingHop::apply(&group, cur);  // now rank (r - h)'s chunk
    chunks[static_cast<size_t>((r - h + n) % n)] = cur;
  }
  return chunks;
}

}  // namespace

torch::Tensor ring_self_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  Communicator& group, bool causal) {
  STRATA_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes(),
               "ring_self_attention takes q, k, v of one shape [batch, heads, positions / N, head_dim]; got ",
               q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t n = group.world_size(), s = q.size(2);
  const std::vector<torch::Tensor> keys = around_the_ring(k, group);
  std::vector<torch::Tensor> parts;
  for (const torch::Tensor& kj : keys) parts.push_back(torch::matmul(q, kj.transpose(-2, -1)));
  torch::Tensor scores = torch::cat(parts, -1) / std::sqrt(static_cast<double>(q.size(3)));  // [B, H, s, S]
  if (causal) {
    const auto opts = torch::TensorOptions().dtype(torch::kLong).device(q.device());
    const torch::Tensor rows = torch::arange(s, opts) + group.rank() * s;
    const torch::Tensor cols = torch::arange(n * s, opts);
    scores = scores.masked_fill(cols.unsqueeze(0) > rows.unsqueeze(1), -std::numeric_limits<float>::infinity());
  }
  const torch::Tensor probs = torch::softmax(scores, -1);
  const std::vector<torch::Tensor> values = around_the_ring(v, group);
  torch::Tensor out;
  for (int64_t j = 0; j < n; ++j) {
    const torch::Tensor term = torch::matmul(probs.narrow(-1, j * s, s), values[static_cast<size_t>(j)]);
    out = out.defined() ? out + term : term;
  }
  return out;
}

}  // namespace strata::parallel
