#pragma once
// CUDA optimizer kernels behind a plain C++ interface (no CUDA headers): the
// same semantics as the CPU kernels in optim.h, on device memory.
//  - multi_tensor_adam: one launch updates a list of chunks (Adam or AdamW,
//    fused unscale/clip via grad_scale, bias correction, bf16/fp16 copy).
//  - lion_step, sgd_step: the rest of the CPU set, one span per launch.
//  - grad_stats: sum of squares (fp32 per block, fp64 across blocks) and the
//    inf/nan flag, accumulated into device memory, so a step needs no host sync.
//  - multi_tensor_adam reads that flag on the device and leaves every chunk
//    untouched when it is set (Note [No half-updated chunk] in optim.h).
// Available when strata is built with CUDA (target strata_kernels_cuda).

#include <cstdint>

#include "strata/core/dtype.h"
#include "strata/kernels/optim.h"

struct CUstream_st;

namespace strata::kernels::cuda {

using Stream = CUstream_st*;  // a cudaStream_t; nullptr is the default stream

/// One chunk slice on the device. exp_avg/exp_avg_sq are Adam's m and v.
struct DeviceSpans {
  int64_t n = 0;
  float* master = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* param_copy = nullptr;  // bf16/fp16 copy; null for fp32 parameters
};

/// Adds the sum of squares of `grad` to *d_sum_sq and sets *d_found_inf to 1
/// if any element is inf or nan. Both are device pointers; zero them first.
void grad_stats(const void* grad, DType dtype, int64_t n, double* d_sum_sq, int* d_found_inf, Stream stream);

/// Updates every chunk of the list; grad and param dtypes are shared by the list.
/// When d_found_inf is not null and *d_found_inf != 0 on the device, nothing is written.
void multi_tensor_adam(const AdamParams& params, DType grad_dtype, DType param_dtype, const DeviceSpans* chunks,
                       int num_chunks, const int* d_found_inf, Stream stream);

/// Lion (exp_avg is its momentum) and SGD (exp_avg is the momentum buffer,
/// unused without momentum) on one span: the CPU kernels' arithmetic.
/// Gradients must be known finite (the caller checked them).
void lion_step(const LionParams& params, DType grad_dtype, DType param_dtype, const DeviceSpans& span, Stream stream);
void sgd_step(const SgdParams& params, DType grad_dtype, DType param_dtype, const DeviceSpans& span, Stream stream);

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, Stream stream);

}  // namespace strata::kernels::cuda
