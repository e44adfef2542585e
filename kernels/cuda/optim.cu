// CUDA optimizer, norm and cast kernels; see strata/kernels/cuda_optim.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "strata/core/cuda_check.h"
#include "strata/kernels/cuda_optim.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxChunksPerLaunch = 32;  // chunk table travels in the kernel arguments

struct NoCopy {};

template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

struct AdamConstants {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float step_size, inv_sqrt_bc2, decay, l2, grad_scale;
};

struct AdamLaunch {
  AdamConstants k;
  const int* found_inf;
  int num_chunks;
  DeviceSpans chunks[kMaxChunksPerLaunch];
};

template <class G, class P>
__global__ void adam_kernel(AdamLaunch args) {
  if (args.found_inf != nullptr && *args.found_inf != 0) return;
  const DeviceSpans& c = args.chunks[blockIdx.y];
  const AdamConstants& k = args.k;
  const G* grad = static_cast<const G*>(c.grad);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.n; i += stride) {
    float g = to_float(grad[i]) * k.grad_scale;
    float w = c.master[i];
    if (k.l2 != 0.0f) g = fmaf(w, k.l2, g);
    const float m = fmaf(k.beta1, c.exp_avg[i], k.one_minus_beta1 * g);
    const float v = fmaf(k.beta2, c.exp_avg_sq[i], k.one_minus_beta2 * g * g);
    const float denom = fmaf(sqrtf(v), k.inv_sqrt_bc2, k.eps);
    w = w * k.decay - (m / denom) * k.step_size;
    c.exp_avg[i] = m;
    c.exp_avg_sq[i] = v;
    c.master[i] = w;
    if constexpr (!std::is_same_v<P, NoCopy>) static_cast<P*>(c.param_copy)[i] = from_float<P>(w);
  }
}

// Lion and SGD: the CPU kernels' arithmetic (cpu/optim_impl.h), one span per launch.
template <class G, class P>
__global__ void lion_kernel(DeviceSpans c, float lr, float beta1, float beta2, float decay, float grad_scale) {
  const G* grad = static_cast<const G*>(c.grad);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.n; i += stride) {
    const float g = to_float(grad[i]) * grad_scale;
    const float m = c.exp_avg[i];
    const float u = fmaf(beta1, m, (1.0f - beta1) * g);
    const float sign = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f);
    const float w = c.master[i] * decay - sign * lr;
    c.exp_avg[i] = fmaf(beta2, m, (1.0f - beta2) * g);
    c.master[i] = w;
    if constexpr (!std::is_same_v<P, NoCopy>) static_cast<P*>(c.param_copy)[i] = from_float<P>(w);
  }
}

template <class G, class P>
__global__ void sgd_kernel(DeviceSpans c, float lr, float momentum, float dampening, float weight_decay,
                           float grad_scale, bool first, bool nesterov) {
  const G* grad = static_cast<const G*>(c.grad);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.n; i += stride) {
    float d = to_float(grad[i]) * grad_scale;
    float w = c.master[i];
    if (weight_decay != 0.0f) d = fmaf(w, weight_decay, d);
    if (c.exp_avg != nullptr) {  // the momentum buffer
      const float b = first ? d : fmaf(momentum, c.exp_avg[i], (1.0f - dampening) * d);
      c.exp_avg[i] = b;
      d = nesterov ? fmaf(momentum, b, d) : b;
    }
    w = fmaf(-lr, d, w);
    c.master[i] = w;
    if constexpr (!std::is_same_v<P, NoCopy>) static_cast<P*>(c.param_copy)[i] = from_float<P>(w);
  }
}

template <class G>
__global__ void stats_kernel(const G* grad, int64_t n, double* sum_sq, int* found_inf) {
  __shared__ float partial[kThreads / 32];
  float acc = 0.0f;
  bool bad = false;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = to_float(grad[i]);
    bad |= !isfinite(x);
    acc = fmaf(x, x, acc);
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = acc;
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(found_inf, 1);
  if (threadIdx.x == 0) {
    float block = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) block += partial[w];
    atomicAdd(sum_sq, static_cast<double>(block));
  }
}

template <class S, class D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = from_float<D>(to_float(src[i]));
  }
}

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 4096));
}

// Calls f(type tag) with the storage type of `dtype`.
template <class F>
void with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); return;
    case DType::kBFloat16: f(__nv_bfloat16{}); return;
    case DType::kFloat16: f(__half{}); return;
  }
}

template <class F>
void with_copy_type(DType dtype, F&& f) {
  if (dtype == DType::kFloat32) {
    f(NoCopy{});
  } else {
    with_type(dtype, f);
  }
}

}  // namespace

void grad_stats(const void* grad, DType dtype, int64_t n, double* d_sum_sq, int* d_found_inf, Stream stream) {
  STRATA_CHECK(n >= 0, "cuda grad_stats: negative element count ", n);
  if (n == 0) return;
  with_type(dtype, [&](auto tag) {
    using G = decltype(tag);
    stats_kernel<G><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const G*>(grad), n, d_sum_sq, d_found_inf);
  });
  STRATA_CUDA_CHECK(cudaGetLastError(), "launching the grad-norm kernel");
}

void multi_tensor_adam(const AdamParams& p, DType grad_dtype, DType param_dtype, const DeviceSpans* chunks,
                       int num_chunks, const int* d_found_inf, Stream stream) {
  STRATA_CHECK(num_chunks >= 0 && p.step >= 1, "multi_tensor_adam: bad chunk count ", num_chunks, " or step ", p.step);
  const double bc1 = p.bias_correction ? 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step)) : 1.0;
  AdamLaunch launch{};
  launch.k = AdamConstants{p.beta1, p.beta2, 1.0f - p.beta1, 1.0f - p.beta2, p.eps,
                           static_cast<float>(p.lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2)),
                           p.decoupled_weight_decay ? 1.0f - p.lr * p.weight_decay : 1.0f,
                           p.decoupled_weight_decay ? 0.0f : p.weight_decay, p.grad_scale};
  launch.found_inf = d_found_inf;
  for (int first = 0; first < num_chunks; first += kMaxChunksPerLaunch) {
    launch.num_chunks = std::min(kMaxChunksPerLaunch, num_chunks - first);
    int64_t longest = 0;
    for (int c = 0; c < launch.num_chunks; ++c) {
      launch.chunks[c] = chunks[first + c];
      longest = std::max(longest, launch.chunks[c].n);
    }
    if (longest == 0) continue;
    const dim3 grid(grid_for(longest), static_cast<unsigned>(launch.num_chunks));
    with_type(grad_dtype, [&](auto gtag) {
      with_copy_type(param_dtype, [&](auto ptag) {
        adam_kernel<decltype(gtag), decltype(ptag)><<<grid, kThreads, 0, stream>>>(launch);
      });
    });
    STRATA_CUDA_CHECK(cudaGetLastError(), "launching the multi-tensor Adam kernel");
  }
}

void lion_step(const LionParams& p, DType grad_dtype, DType param_dtype, const DeviceSpans& span, Stream stream) {
  if (span.n == 0) return;
  const float decay = 1.0f - p.lr * p.weight_decay;
  with_type(grad_dtype, [&](auto gtag) {
    with_copy_type(param_dtype, [&](auto ptag) {
      lion_kernel<decltype(gtag), decltype(ptag)>
          <<<grid_for(span.n), kThreads, 0, stream>>>(span, p.lr, p.beta1, p.beta2, decay, p.grad_scale);
    });
  });
  STRATA_CUDA_CHECK(cudaGetLastError(), "launching the Lion kernel");
}

void sgd_step(const SgdParams& p, DType grad_dtype, DType param_dtype, const DeviceSpans& span, Stream stream) {
  if (span.n == 0) return;
  DeviceSpans s = span;
  if (p.momentum == 0.0f) s.exp_avg = nullptr;
  with_type(grad_dtype, [&](auto gtag) {
    with_copy_type(param_dtype, [&](auto ptag) {
      sgd_kernel<decltype(gtag), decltype(ptag)><<<grid_for(s.n), kThreads, 0, stream>>>(
          s, p.lr, p.momentum, p.dampening, p.weight_decay, p.grad_scale, p.step <= 1, p.nesterov);
    });
  });
  STRATA_CUDA_CHECK(cudaGetLastError(), "launching the SGD kernel");
}

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, Stream stream) {
  STRATA_CHECK(n >= 0, "cuda cast: negative element count ", n);
  if (n == 0) return;
  with_type(src_dtype, [&](auto stag) {
    with_type(dst_dtype, [&](auto dtag) {
      using S = decltype(stag);
      using D = decltype(dtag);
      cast_kernel<S, D><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const S*>(src), static_cast<D*>(dst), n);
    });
  });
  STRATA_CUDA_CHECK(cudaGetLastError(), "launching the cast kernel");
}

}  // namespace strata::kernels::cuda
