#pragma once
// The CPU kernels, written once over the Vec interface of vec.h. Included by
// one translation unit per ISA, which instantiates make_table<Vec>(). Each
// kernel covers [begin, end) of one chunk slice: the vector body, then the
// tail one lane at a time with the same arithmetic.

#include <cmath>
#include <type_traits>

#include "dispatch.h"
#include "vec.h"

namespace strata::kernels::cpu {
namespace {

// Note [Software prefetch in the optimizer kernels]
// An optimizer step streams 4-5 arrays in and 3-4 out per thread. With only
// the hardware prefetchers, the update reached 86-90% of a plain
// read-modify-write stream on the same arrays; prefetching every input stream
// 256 elements ahead (1 KiB of fp32) brings it to the stream's rate
// (`strata bench optim`). One prefetch per 16 elements is one per cache line
// of the fp32 streams.
constexpr int64_t kPrefetchElems = 256;

template <class W, class... Ptrs>
inline void prefetch_ahead(int64_t i, const Ptrs*... ptrs) {
  if ((i & 15) == 0) (W::prefetch(ptrs + i + kPrefetchElems), ...);
}

template <int D>
struct Storage;
template <>
struct Storage<static_cast<int>(DType::kFloat32)> {
  using type = float;
};
template <>
struct Storage<static_cast<int>(DType::kBFloat16)> {
  using type = BF16;
};
template <>
struct Storage<static_cast<int>(DType::kFloat16)> {
  using type = FP16;
};
// The parameter copy: fp32 parameters have none (the master is the parameter).
template <int D>
using CopyStorage = std::conditional_t<D == static_cast<int>(DType::kFloat32), NoCopy, typename Storage<D>::type>;

// Runs body(W{}, i) over [begin, end): V-wide steps, then a scalar tail.
template <class V, class Body>
inline void for_each_lane_group(int64_t begin, int64_t end, Body&& body) {
  int64_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) body(V{}, i);
  for (; i < end; ++i) body(VecScalar{}, i);
}

template <class W, class P>
inline void store_copy(P* copy, int64_t i, W w) {
  if constexpr (!std::is_same_v<P, NoCopy>) W::store(copy + i, w);
}

template <class V, class G, class P>
void adam_kernel(const AdamParams& p, const OptimSpans& s, int64_t begin, int64_t end) {
  const double bc1 = p.bias_correction ? 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step)) : 1.0;
  const float step_size = static_cast<float>(p.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float decay = p.decoupled_weight_decay ? 1.0f - p.lr * p.weight_decay : 1.0f;
  const float l2 = p.decoupled_weight_decay ? 0.0f : p.weight_decay;
  // Every constant in a local: stores through the float spans could alias the
  // params struct, which would force reloads inside the loop.
  const float grad_scale = p.grad_scale, beta1 = p.beta1, beta2 = p.beta2, eps = p.eps;
  const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;
  const G* g = static_cast<const G*>(s.grad);
  P* copy = static_cast<P*>(s.param_copy);
  float* master = s.master;
  float* m = s.state0;
  float* v = s.state1;
  for_each_lane_group<V>(begin, end, [=](auto tag, int64_t i) {
    using W = decltype(tag);
    prefetch_ahead<W>(i, g, master, m, v);
    W gv = W::load(g + i) * W::set1(grad_scale);
    W w = W::load(master + i);
    if (l2 != 0.0f) gv = W::fmadd(w, W::set1(l2), gv);
    const W mv = W::fmadd(W::set1(beta1), W::load(m + i), W::set1(one_minus_beta1) * gv);
    const W vv = W::fmadd(W::set1(beta2), W::load(v + i), W::set1(one_minus_beta2) * gv * gv);
    const W denom = W::fmadd(W::sqrt(vv), W::set1(inv_sqrt_bc2), W::set1(eps));
    w = w * W::set1(decay) - (mv / denom) * W::set1(step_size);
    W::store(m + i, mv);
    W::store(v + i, vv);
    W::store(master + i, w);
    store_copy(copy, i, w);
  });
}

template <class V, class G, class P>
void lion_kernel(const LionParams& p, const OptimSpans& s, int64_t begin, int64_t end) {
  const float decay = 1.0f - p.lr * p.weight_decay;
  const float lr = p.lr, grad_scale = p.grad_scale, beta1 = p.beta1, beta2 = p.beta2;
  const G* g = static_cast<const G*>(s.grad);
  P* copy = static_cast<P*>(s.param_copy);
  float* master = s.master;
  float* m = s.state0;
  for_each_lane_group<V>(begin, end, [=](auto tag, int64_t i) {
    using W = decltype(tag);
    prefetch_ahead<W>(i, g, master, m);
    const W gv = W::load(g + i) * W::set1(grad_scale);
    const W mv = W::load(m + i);
    const W c = W::fmadd(W::set1(beta1), mv, W::set1(1.0f - beta1) * gv);
    const W w = W::load(master + i) * W::set1(decay) - W::sign(c) * W::set1(lr);
    W::store(m + i, W::fmadd(W::set1(beta2), mv, W::set1(1.0f - beta2) * gv));
    W::store(master + i, w);
    store_copy(copy, i, w);
  });
}

template <class V, class G, class P>
void sgd_kernel(const SgdParams& p, const OptimSpans& s, int64_t begin, int64_t end) {
  const bool has_momentum = p.momentum != 0.0f;
  const bool first = p.step <= 1;
  const bool nesterov = p.nesterov;
  const float lr = p.lr, momentum = p.momentum, dampening = p.dampening, weight_decay = p.weight_decay;
  const float grad_scale = p.grad_scale;
  const G* g = static_cast<const G*>(s.grad);
  P* copy = static_cast<P*>(s.param_copy);
  float* master = s.master;
  float* buf = s.state0;
  for_each_lane_group<V>(begin, end, [=](auto tag, int64_t i) {
    using W = decltype(tag);
    prefetch_ahead<W>(i, g, master);
    if (has_momentum) prefetch_ahead<W>(i, buf);
    W d = W::load(g + i) * W::set1(grad_scale);
    W w = W::load(master + i);
    if (weight_decay != 0.0f) d = W::fmadd(w, W::set1(weight_decay), d);
    if (has_momentum) {
      const W b = first ? d : W::fmadd(W::set1(momentum), W::load(buf + i), W::set1(1.0f - dampening) * d);
      W::store(buf + i, b);
      d = nesterov ? W::fmadd(W::set1(momentum), b, d) : b;
    }
    w = W::fmadd(W::set1(-lr), d, w);
    W::store(master + i, w);
    store_copy(copy, i, w);
  });
}

constexpr int64_t kStatsBlock = 4096;

// Note [Overflow check from the sum of squares]
// An inf or nan gradient makes its square, and so its block's sum of squares,
// inf or nan; a finite block sum proves the block finite. So the hot loop is
// only loads and FMAs into eight independent accumulators (no loop-carried
// chain longer than one FMA per accumulator, unlike a separate nan
// accumulator, which made the pass latency-bound at a third of read
// bandwidth). A block whose sum is not finite is scanned again exactly: it
// holds inf/nan, or finite values above ~1.8e19 whose squares overflow fp32,
// whose sum is then taken in fp64 instead. That rescan costs one block, and
// only on the rare step that overflows.
template <class G>
bool rescan_block(const G* g, int64_t b, int64_t e, double& sum_sq) {
  double s = 0.0;
  for (int64_t i = b; i < e; ++i) {
    const float x = VecScalar::load(g + i).v;
    if (!std::isfinite(x)) return false;
    s += static_cast<double>(x) * static_cast<double>(x);
  }
  sum_sq += s;
  return true;
}

// Adds one block's sum of squares to `out`, or marks it not finite (Note
// [Overflow check from the sum of squares]).
template <class V, class G>
inline void add_block(const G* g, int64_t b, int64_t e, float block, GradStats& out) {
  if (std::isfinite(block)) {
    out.sum_sq += static_cast<double>(block);
  } else if (!rescan_block(g, b, e, out.sum_sq)) {
    out.finite = false;  // Note [No half-updated chunk]: the caller skips the step
  }
}

// Sum of squares of [b, e), at most one block, in fp32.
template <class V, class G>
inline float block_sum(const G* g, int64_t b, int64_t e) {
  V acc0 = V::zero(), acc1 = V::zero(), acc2 = V::zero(), acc3 = V::zero();
  int64_t i = b;
  for (; i + 4 * V::kWidth <= e; i += 4 * V::kWidth) {
    const V x0 = V::load(g + i), x1 = V::load(g + i + V::kWidth);
    const V x2 = V::load(g + i + 2 * V::kWidth), x3 = V::load(g + i + 3 * V::kWidth);
    acc0 = V::fmadd(x0, x0, acc0);
    acc1 = V::fmadd(x1, x1, acc1);
    acc2 = V::fmadd(x2, x2, acc2);
    acc3 = V::fmadd(x3, x3, acc3);
  }
  for (; i + V::kWidth <= e; i += V::kWidth) {
    const V x = V::load(g + i);
    acc0 = V::fmadd(x, x, acc0);
  }
  float tail = 0.0f;
  for (; i < e; ++i) {
    const float x = VecScalar::load(g + i).v;
    tail = std::fma(x, x, tail);
  }
  return V::reduce_add((acc0 + acc1) + (acc2 + acc3)) + tail;
}

// Note [Four streams per thread in grad_stats]
// A single sequential read stream reached only about 10 GB/s per core here,
// while the optimizer's four streams together move far more: one stream does
// not keep enough lines in flight. So each thread reads its range as four
// quarters at once, block by block, with two accumulators per quarter.
template <class V, class G>
GradStats stats_kernel(const void* grad, int64_t begin, int64_t end) {
  const G* g = static_cast<const G*>(grad);
  GradStats out;
  const int64_t quarter = (end - begin) / kStatsBlock / 4 * kStatsBlock;  // whole blocks per stream
  for (int64_t j = 0; j < quarter; j += kStatsBlock) {
    V acc[8] = {V::zero(), V::zero(), V::zero(), V::zero(), V::zero(), V::zero(), V::zero(), V::zero()};
    for (int64_t i = j; i < j + kStatsBlock; i += 2 * V::kWidth) {
      for (int k = 0; k < 4; ++k) {
        const G* p = g + begin + k * quarter + i;
        const V x0 = V::load(p), x1 = V::load(p + V::kWidth);
        acc[2 * k] = V::fmadd(x0, x0, acc[2 * k]);
        acc[2 * k + 1] = V::fmadd(x1, x1, acc[2 * k + 1]);
      }
    }
    for (int k = 0; k < 4; ++k) {
      const int64_t b = begin + k * quarter + j;
      add_block<V>(g, b, b + kStatsBlock, V::reduce_add(acc[2 * k] + acc[2 * k + 1]), out);
    }
  }
  for (int64_t b = begin + 4 * quarter; b < end; b += kStatsBlock) {
    const int64_t e = std::min(end, b + kStatsBlock);
    add_block<V>(g, b, e, block_sum<V>(g, b, e), out);
  }
  return out;
}

template <class V, class S, class D>
void cast_kernel(const void* src, void* dst, int64_t begin, int64_t end) {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  for_each_lane_group<V>(begin, end, [&](auto tag, int64_t i) {
    using W = decltype(tag);
    W::store(d + i, W::load(s + i));
  });
}

template <class V, class G, class P>
void probe_kernel(const OptimSpans& s, int64_t begin, int64_t end) {
  const G* g = static_cast<const G*>(s.grad);
  P* copy = static_cast<P*>(s.param_copy);
  for_each_lane_group<V>(begin, end, [&](auto tag, int64_t i) {
    using W = decltype(tag);
    const W gv = W::load(g + i);
    const W w = W::load(s.master + i) + gv;
    W::store(s.state0 + i, W::load(s.state0 + i) + gv);
    if (s.state1 != nullptr) W::store(s.state1 + i, W::load(s.state1 + i) + gv);
    W::store(s.master + i, w);
    store_copy(copy, i, w);
  });
}

template <class V, int G, int P>
void fill_pair(KernelTable& t) {
  using GT = typename Storage<G>::type;
  using PT = CopyStorage<P>;
  t.adam[G][P] = &adam_kernel<V, GT, PT>;
  t.lion[G][P] = &lion_kernel<V, GT, PT>;
  t.sgd[G][P] = &sgd_kernel<V, GT, PT>;
  t.probe[G][P] = &probe_kernel<V, GT, PT>;
  t.cast[G][P] = &cast_kernel<V, GT, typename Storage<P>::type>;
}

template <class V, int G>
void fill_row(KernelTable& t) {
  fill_pair<V, G, 0>(t);
  fill_pair<V, G, 1>(t);
  fill_pair<V, G, 2>(t);
  t.stats[G] = &stats_kernel<V, typename Storage<G>::type>;
}

template <class V>
KernelTable make_table() {
  KernelTable t{};
  fill_row<V, 0>(t);
  fill_row<V, 1>(t);
  fill_row<V, 2>(t);
  return t;
}

}  // namespace
}  // namespace strata::kernels::cpu
