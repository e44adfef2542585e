// Note [Ring attention]
// Blockwise attention around the ring with an online softmax (Liu et al.,
// "Ring Attention with Blockwise Transformers"; the flash-attention
// recurrence): rank r keeps its queries, and the key and value blocks of
// every rank pass by in N - 1 hops. For each block it updates, per query
// row, the running maximum m, the running sum l of exp(score - m) and the
// running output acc (rescaled by exp(m_old - m_new) whenever the maximum
// grows), so it never holds more than one block of scores: activations are
// O(S/N) per rank, where ring self-attention holds S^2/N scores. Forward
// saves only q, k, v, the output and the log-sum-exp per row.
//
// Backward recomputes each block's probabilities from the saved
// log-sum-exp. The key and value blocks go around the ring again, each with
// the gradient of its keys and values accumulating as it travels; after the
// N-th hop every block, and its finished gradient, is back on the rank that
// holds it. dQ stays home. Nothing is divided by N: each score's gradient is
// computed once, on the rank that owns its query row.
//
// Causal masks act on global positions. A rank's positions are one or two
// segments (the zigzag layout: chunks r and 2N-1-r of 2N, so every rank holds
// an early and a late part and the causal work is the same on every rank).
// Segment pairs whose keys all lie after the queries are skipped, pairs
// wholly before run unmasked, and only the diagonal ones build a mask.
#include "strata/parallel/sequence_parallel.h"

#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../comm/group_function.h"
#include "ring.h"
#include "strata/core/error.h"

namespace strata::parallel {

namespace {

constexpr uint32_t kForwardTag = 0x5246;   // "RF"
constexpr uint32_t kBackwardTag = 0x5242;  // "RB"

struct Segment {
  int64_t local;   // first row in the rank's tensor
  int64_t global;  // its global position
  int64_t length;
};

// Rank `r`'s positions for `s` local positions.
std::vector<Segment> segments_of(int64_t r, int64_t n, int64_t s, SequenceLayout layout) {
  if (layout == SequenceLayout::kContiguous) return {{0, r * s, s}};
  const int64_t c = s / 2;
  return {{0, r * c, c}, {c, (2 * n - 1 - r) * c, c}};
}

enum class Visibility { kNone, kAll, kPartial };
Visibility visibility(const Segment& q, const Segment& k, bool causal) {
  if (!causal) return Visibility::kAll;
  if (k.global > q.global + q.length - 1) return Visibility::kNone;  // every key after every query
  if (k.global + k.length - 1 <= q.global) return Visibility::kAll;
  return Visibility::kPartial;
}

torch::Tensor causal_mask(const Segment& q, const Segment& k) {
  const auto opts = torch::TensorOptions().dtype(torch::kLong);
  const torch::Tensor rows = torch::arange(q.length, opts) + q.global;
  const torch::Tensor cols = torch::arange(k.length, opts) + k.global;
  return cols.unsqueeze(0) > rows.unsqueeze(1);  // true: masked
}

// Scores of a query segment against a key segment, masked where needed.
torch::Tensor block_scores(const torch::Tensor& q, const torch::Tensor& k, const Segment& qs, const Segment& ks,
                           Visibility vis, double scale) {
  torch::Tensor sc = torch::matmul(q.narrow(2, qs.local, qs.length), k.narrow(2, ks.local, ks.length).transpose(-2, -1)) * scale;
  if (vis == Visibility::kPartial) {
    sc = sc.masked_fill(causal_mask(qs, ks).to(sc.device()), -std::numeric_limits<float>::infinity());
  }
  return sc;
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, Communicator* g, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in, bool causal, int64_t layout_id) {
    Communicator& group = *g;
    const auto layout = static_cast<SequenceLayout>(layout_id);
    const int64_t n = group.world_size(), r = group.rank(), s = q_in.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q_in.size(3)));
    const torch::Tensor q = q_in.to(torch::kFloat32), k0 = k_in.to(torch::kFloat32), v0 = v_in.to(torch::kFloat32);
    const auto mine = segments_of(r, n, s, layout);
    const float inf = std::numeric_limits<float>::infinity();
    torch::Tensor m = torch::full({q.size(0), q.size(1), s}, -inf, q.options());
    torch::Tensor l = torch::zeros_like(m);
    torch::Tensor acc = torch::zeros_like(q);
    torch::Tensor kv = torch::stack({k0, v0});  // travels as one buffer
    for (int64_t step = 0; step < n; ++step) {
      const int64_t src = ((r - step) % n + n) % n;
      const auto theirs = segments_of(src, n, s, layout);
      const torch::Tensor k = kv[0], v = kv[1];
      for (const Segment& qs : mine) {
        for (const Segment& ks : theirs) {
          const Visibility vis = visibility(qs, ks, causal);
          if (vis == Visibility::kNone) continue;
          const torch::Tensor sc = block_scores(q, k, qs, ks, vis, scale);
          torch::Tensor m_old = m.narrow(2, qs.local, qs.length);
          const torch::Tensor m_new = torch::maximum(m_old, std::get<0>(sc.max(-1)));
          const torch::Tensor m_safe = m_new.masked_fill(m_new == -inf, 0.0);  // rows with nothing visible yet
          const torch::Tensor p = torch::exp(sc - m_safe.unsqueeze(-1));
          const torch::Tensor alpha = torch::exp(m_old - m_safe);
          torch::Tensor l_rows = l.narrow(2, qs.local, qs.length);
          l_rows.mul_(alpha).add_(p.sum(-1));
          torch::Tensor acc_rows = acc.narrow(2, qs.local, qs.length);
          acc_rows.mul_(alpha.unsqueeze(-1)).add_(torch::matmul(p, v.narrow(2, ks.local, ks.length)));
          m_old.copy_(m_new);
        }
      }
      if (step + 1 < n) kv = ring::exchange(kv, group, +1, kForwardTag);
    }
    STRATA_CHECK((l > 0).all().item<bool>(), "ring_attention: a query row sees no key (a causal layout error)");
    const torch::Tensor out = acc / l.unsqueeze(-1);
    const torch::Tensor lse = m + torch::log(l);
    ctx->save_for_backward({q, k0, v0, out, lse});
    ctx->saved_data["group"] = group_ops::to_value(group);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["layout"] = layout_id;
    return out.to(q_in.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    Communicator& group = group_ops::from_context(ctx);
    const bool causal = ctx->saved_data["causal"].toBool();
    const auto layout = static_cast<SequenceLayout>(ctx->saved_data["layout"].toInt());
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k0 = saved[1], &v0 = saved[2], &out = saved[3], &lse = saved[4];
    const torch::Tensor dout = grads[0].to(torch::kFloat32);
    const int64_t n = group.world_size(), r = group.rank(), s = q.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const auto mine = segments_of(r, n, s, layout);
    const torch::Tensor delta = (dout * out).sum(-1);  // [B, H, s]
    torch::Tensor dq = torch::zeros_like(q);
    // k, v, and their gradients so far, travelling together.
    torch::Tensor block = torch::stack({k0, v0, torch::zeros_like(k0), torch::zeros_like(v0)});
    for (int64_t step = 0; step < n; ++step) {
      const int64_t src = ((r - step) % n + n) % n;
      const auto theirs = segments_of(src, n, s, layout);
      const torch::Tensor k = block[0], v = block[1];
      torch::Tensor dk = block[2], dv = block[3];
      for (const Segment& qs : mine) {
        for (const Segment& ks : theirs) {
          const Visibility vis = visibility(qs, ks, causal);
          if (vis == Visibility::kNone) continue;
          const torch::Tensor sc = block_scores(q, k, qs, ks, vis, scale);
          const torch::Tensor p = torch::exp(sc - lse.narrow(2, qs.local, qs.length).unsqueeze(-1));
          const torch::Tensor d_o = dout.narrow(2, qs.local, qs.length);
          const torch::Tensor vk = v.narrow(2, ks.local, ks.length), kk = k.narrow(2, ks.local, ks.length);
          dv.narrow(2, ks.local, ks.length).add_(torch::matmul(p.transpose(-2, -1), d_o));
          const torch::Tensor dp = torch::matmul(d_o, vk.transpose(-2, -1));
          const torch::Tensor ds = p * (dp - delta.narrow(2, qs.local, qs.length).unsqueeze(-1)) * scale;
          dq.narrow(2, qs.local, qs.length).add_(torch::matmul(ds, kk));
          dk.narrow(2, ks.local, ks.length).add_(torch::matmul(ds.transpose(-2, -1), q.narrow(2, qs.local, qs.length)));
        }
      }
      if (step + 1 < n) block = ring::exchange(block, group, +1, kBackwardTag);
    }
    // The N-th hop brings every block's finished gradients home.
    block = block.narrow(0, 2, 2);
    if (n > 1) block = ring::exchange(block, group, +1, kBackwardTag);
    const torch::Tensor dk = block[0], dv = block[1];
    return {torch::Tensor(), dq.to(grads[0].scalar_type()), dk.to(grads[0].scalar_type()),
            dv.to(grads[0].scalar_type()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor split_sequence_zigzag(const torch::Tensor& x, int64_t dim, Communicator& group) {
  const int64_t n = group.world_size(), r = group.rank();
  dim = dim < 0 ? dim + x.dim() : dim;
  STRATA_CHECK(dim >= 0 && dim < x.dim(), "split_sequence_zigzag: dimension ", dim, " of a ", x.dim(), "-d tensor");
  const int64_t len = x.size(dim);
  STRATA_CHECK(len % (2 * n) == 0, "the sequence of ", len, " positions does not split evenly into the 2 x ", n,
               " chunks of the zigzag layout: pad it to a multiple of ", 2 * n, " (and mask the padding)");
  const int64_t c = len / (2 * n);
  return torch::cat({x.narrow(dim, r * c, c), x.narrow(dim, (2 * n - 1 - r) * c, c)}, dim);
}

torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             Communicator& group, bool causal, SequenceLayout layout) {
  STRATA_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes(),
               "ring_attention takes q, k, v of one shape [batch, heads, positions / N, head_dim]; got ", q.sizes(),
               ", ", k.sizes(), ", ", v.sizes());
  STRATA_CHECK(layout == SequenceLayout::kContiguous || q.size(2) % 2 == 0, "ring_attention in the zigzag layout holds "
               "two equal chunks per rank: ", q.size(2), " local positions do not halve (use split_sequence_zigzag)");
  return RingAttention::apply(&group, q, k, v, causal, static_cast<int64_t>(layout));
}

}  // namespace strata::parallel
