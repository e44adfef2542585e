#pragma once
// CPU optimizer kernels: Adam, AdamW, Lion and SGD with momentum, over raw
// spans of one chunk. Master weights and optimizer state are fp32; gradients
// and the compute-precision parameter copy may be fp32, bf16 or fp16.
//
// Note [One pass over the optimizer state]
// A step is memory-bound: fp32 AdamW moves 28 bytes per parameter. Every
// kernel does, in one pass per element: gradient unscale and clipping (one
// multiplier, grad_scale = clip_coefficient / loss_scale), weight decay, bias
// correction, the update, and the store of the new bf16/fp16 parameter copy.
// The only other pass is grad_stats(): the L2 norm that clipping needs anyway,
// with the inf/nan check folded into the same read of the gradients. A
// mixed-precision step is therefore grad_stats over all chunks (global norm,
// overflow), then one fused update per chunk with grads_known_finite = true.
//
// Note [No half-updated chunk]
// An update never starts on gradients that hold inf or nan. When the caller
// has not checked them (grads_known_finite = false, the default), the step
// runs grad_stats first and returns kOverflow without touching any state if
// they are not finite. When the caller says they were checked, the check is
// skipped; this is the fast path above.
//
// Work is split over the kernel thread pool (thread_pool.h) in one contiguous
// range per thread, which keeps each thread's streams long. ISA: selected_isa()
// unless an Isa is passed (tests run every ISA the CPU has).

#include <cstdint>

#include "strata/core/dtype.h"
#include "strata/kernels/isa.h"

namespace strata::kernels {

/// The arrays of one chunk family slice. `param_copy` is written from the
/// updated master in `param_dtype` (bf16/fp16); leave it null with fp32
/// parameters, whose master is the parameter itself.
struct OptimSpans {
  int64_t n = 0;
  float* master = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  float* state0 = nullptr;  // Adam exp_avg, Lion exp_avg, SGD momentum buffer
  float* state1 = nullptr;  // Adam exp_avg_sq
  void* param_copy = nullptr;
  DType param_dtype = DType::kFloat32;
};

struct AdamParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = true;  // true: AdamW; false: Adam with L2 in the gradient
  bool bias_correction = true;
  int64_t step = 1;                    // 1-based count including this step
  float grad_scale = 1.0f;             // clip_coefficient / loss_scale
  bool grads_known_finite = false;     // see Note [No half-updated chunk]
};

struct LionParams {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;
  float grad_scale = 1.0f;
  bool grads_known_finite = false;
};

struct SgdParams {
  float lr = 1e-2f;
  float momentum = 0.9f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  int64_t step = 1;  // step 1 initialises the momentum buffer with the gradient (as torch.optim.SGD)
  float grad_scale = 1.0f;
  bool grads_known_finite = false;
};

enum class StepStatus : int {
  kUpdated = 0,   // state and parameters updated
  kOverflow = 1,  // gradients held inf/nan; nothing was written
};

struct GradStats {
  double sum_sq = 0.0;  // sum of squares of the stored (still loss-scaled) gradients
  bool finite = true;
  void merge(const GradStats& o) {
    sum_sq += o.sum_sq;
    finite = finite && o.finite;
  }
};

/// L2 norm (squared) and overflow check in one read of the gradients. The sum
/// is accumulated in fp32 over blocks of 4096 elements, blocks summed in fp64.
GradStats grad_stats(const void* grad, DType dtype, int64_t n, Isa isa = selected_isa());

/// min(1, max_norm / (total_norm + 1e-6)), as torch.nn.utils.clip_grad_norm_.
float clip_coefficient(double total_norm, double max_norm);

StepStatus adam_step(const AdamParams& params, const OptimSpans& spans, Isa isa = selected_isa());
StepStatus lion_step(const LionParams& params, const OptimSpans& spans, Isa isa = selected_isa());
StepStatus sgd_step(const SgdParams& params, const OptimSpans& spans, Isa isa = selected_isa());

/// Converts n elements (round to nearest even; NaN stays NaN).
void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, Isa isa = selected_isa());

/// The bandwidth probe of `strata bench optim`: the same arrays and bytes per
/// element as a step (read grad, master, state0 and state1 when not null;
/// write them back and the parameter copy), with one add per array instead of
/// the update.
void rmw_probe(const OptimSpans& spans, Isa isa = selected_isa());

/// Whether the CPU can run `isa`.
bool isa_supported(Isa isa);

}  // namespace strata::kernels
