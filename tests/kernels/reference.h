#pragma once
// Independent references for the kernel tests: dtype conversions that do not
// share code with kernels/cpu/vec.h (fp16 through the compiler's _Float16,
// bf16 by choosing the nearest of the two neighbours), and double-precision
// optimizers written from the algorithms' definitions.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/kernels/optim.h"

namespace strata::kernels::testing {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float ref_bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

inline uint16_t ref_float_to_bf16(float f) {
  if (std::isnan(f)) return static_cast<uint16_t>((bits_of(f) >> 16) | 0x40);
  const uint32_t lo = bits_of(f) & 0xffff0000u;
  const uint32_t hi = lo + 0x10000u;  // next bf16 away from zero
  const double d_lo = std::fabs(static_cast<double>(f) - static_cast<double>(float_of(lo)));
  const double d_hi = std::isinf(float_of(lo)) ? INFINITY
                                               : std::fabs(static_cast<double>(f) - static_cast<double>(float_of(hi)));
  if (d_lo < d_hi) return static_cast<uint16_t>(lo >> 16);
  if (d_hi < d_lo) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);  // tie: even
}

inline float ref_fp16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

inline uint16_t ref_float_to_fp16(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

inline double ref_load(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return ref_bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return ref_fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0;
}

/// The stored bits of `f` rounded to `dtype` (2-byte types), for exact comparisons.
inline uint16_t ref_round(float f, DType dtype) {
  return dtype == DType::kBFloat16 ? ref_float_to_bf16(f) : ref_float_to_fp16(f);
}

struct RefState {
  std::vector<double> w, m, v;
};

// torch.optim.AdamW / Adam, in double.
inline void ref_adam(const AdamParams& p, const std::vector<double>& grad, RefState& s) {
  const double b1 = p.beta1, b2 = p.beta2;
  const double bc1 = p.bias_correction ? 1 - std::pow(b1, static_cast<double>(p.step)) : 1;
  const double bc2 = p.bias_correction ? 1 - std::pow(b2, static_cast<double>(p.step)) : 1;
  for (size_t i = 0; i < grad.size(); ++i) {
    double g = grad[i] * p.grad_scale;
    double w = s.w[i];
    if (p.decoupled_weight_decay) {
      w *= 1 - static_cast<double>(p.lr) * p.weight_decay;
    } else {
      g += p.weight_decay * w;
    }
    s.m[i] = b1 * s.m[i] + (1 - b1) * g;
    s.v[i] = b2 * s.v[i] + (1 - b2) * g * g;
    const double denom = std::sqrt(s.v[i]) / std::sqrt(bc2) + p.eps;
    s.w[i] = w - (p.lr / bc1) * s.m[i] / denom;
  }
}

// Lion (Chen et al. 2023), in double. Returns |c| per element: where it is
// tiny, float and double may disagree on sign(c).
inline std::vector<double> ref_lion(const LionParams& p, const std::vector<double>& grad, RefState& s) {
  std::vector<double> c_abs(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) {
    const double g = grad[i] * p.grad_scale;
    const double c = p.beta1 * s.m[i] + (1 - static_cast<double>(p.beta1)) * g;
    c_abs[i] = std::fabs(c);
    const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
    s.w[i] = s.w[i] * (1 - static_cast<double>(p.lr) * p.weight_decay) - p.lr * sign;
    s.m[i] = p.beta2 * s.m[i] + (1 - static_cast<double>(p.beta2)) * g;
  }
  return c_abs;
}

// torch.optim.SGD with momentum, dampening, nesterov and weight decay, in double.
inline void ref_sgd(const SgdParams& p, const std::vector<double>& grad, RefState& s) {
  for (size_t i = 0; i < grad.size(); ++i) {
    double d = grad[i] * p.grad_scale + p.weight_decay * s.w[i];
    if (p.momentum != 0) {
      s.m[i] = p.step <= 1 ? d : p.momentum * s.m[i] + (1 - static_cast<double>(p.dampening)) * d;
      d = p.nesterov ? d + p.momentum * s.m[i] : s.m[i];
    }
    s.w[i] -= p.lr * d;
  }
}

}  // namespace strata::kernels::testing
