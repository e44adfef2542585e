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
  const G* g = static_cast<const G*>(s.grad);
  P* copy = static_cast<P*>(s.param_copy);
  float* master = s.master;
  float* m = s.state0;
  float* v = s.state1;
  for_each_lane_group<V>(begin, end, [&](auto tag, int64_t i) {
    using W = decltype(tag);
    W gv = W::load(g + i) * W::set1(p.grad_scale);
    W w = W::load(master + i);
    if (l2 != 0.0f) gv = W::fmadd(w, W::set1(l2), gv);
    const W mv = W::fmadd(W::set1(p.beta1), W::load(m + i), W::set1(1.0f - p.beta1) * gv);
    const W vv = W::fmadd(W::set1(p.beta2), W::load(v + i), W::set1(1.0f - p.beta2) * gv * gv);
    const W denom = W::fmadd(W::sqrt(vv), W::set1(inv_sqrt_bc2), W::set1(p.eps));
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
  const G* g = static_cast<const G*>(s.grad);
  P* copy = static_cast<P*>(s.param_copy);
  float* master = s.master;
  float* m = s.state0;
  for_each_lane_group<V>(begin, end, [&](auto tag, int64_t i) {
    using W = decltype(tag);
    const W gv = W::load(g + i) * W::set1(p.grad_scale);
    const W mv = W::load(m + i);
    const W c = W::fmadd(W::set1(p.beta1), mv, W::set1(1.0f - p.beta1) * gv);
    const W w = W::load(master + i) * W::set1(decay) - W::sign(c) * W::set1(p.lr);
    W::store(m + i, W::fmadd(W::set1(p.beta2), mv, W::set1(1.0f - p.beta2) * gv));
    W::store(master + i, w);
    store_copy(copy, i, w);
  });
}

template <class V, class G, class P>
void sgd_kernel(const SgdParams& p, const OptimSpans& s, int64_t begin, int64_t end) {
  const bool has_momentum = p.momentum != 0.0f;
  const bool first = p.step <= 1;
  const G* g = static_cast<const G*>(s.grad);
  P* copy = static_cast<P*>(s.param_copy);
  float* master = s.master;
  float* buf = s.state0;
  for_each_lane_group<V>(begin, end, [&](auto tag, int64_t i) {
    using W = decltype(tag);
    W d = W::load(g + i) * W::set1(p.grad_scale);
    W w = W::load(master + i);
    if (p.weight_decay != 0.0f) d = W::fmadd(w, W::set1(p.weight_decay), d);
    if (has_momentum) {
      const W b = first ? d : W::fmadd(W::set1(p.momentum), W::load(buf + i), W::set1(1.0f - p.dampening) * d);
      W::store(buf + i, b);
      d = p.nesterov ? W::fmadd(W::set1(p.momentum), b, d) : b;
    }
    w = W::fmadd(W::set1(-p.lr), d, w);
    W::store(master + i, w);
    store_copy(copy, i, w);
  });
}

constexpr int64_t kStatsBlock = 4096;

template <class V, class G>
GradStats stats_kernel(const void* grad, int64_t begin, int64_t end) {
  const G* g = static_cast<const G*>(grad);
  GradStats out;
  V nan_v = V::zero();
  VecScalar nan_s = VecScalar::zero();
  for (int64_t b = begin; b < end; b += kStatsBlock) {
    const int64_t e = std::min(end, b + kStatsBlock);
    V acc = V::zero();
    VecScalar acc_s = VecScalar::zero();
    int64_t i = b;
    for (; i + V::kWidth <= e; i += V::kWidth) {
      const V x = V::load(g + i);
      acc = V::fmadd(x, x, acc);
      nan_v = V::fmadd(x, V::zero(), nan_v);  // inf * 0 and nan * 0 are nan: sticky
    }
    for (; i < e; ++i) {
      const VecScalar x = VecScalar::load(g + i);
      acc_s = VecScalar::fmadd(x, x, acc_s);
      nan_s = VecScalar::fmadd(x, VecScalar::zero(), nan_s);
    }
    out.sum_sq += static_cast<double>(V::reduce_add(acc)) + static_cast<double>(acc_s.v);
  }
  out.finite = !std::isnan(V::reduce_add(nan_v)) && !std::isnan(nan_s.v);
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
    W::store(s.state1 + i, W::load(s.state1 + i) + gv);
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
