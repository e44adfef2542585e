// The public CPU kernel API: ISA table lookup, threading, and the overflow
// guard of Note [No half-updated chunk].
#include "strata/kernels/optim.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu/dispatch.h"
#include "strata/core/error.h"
#include "strata/kernels/thread_pool.h"

namespace strata::kernels {

namespace {

constexpr int64_t kGrain = 64;               // split points on 64-element boundaries (cache lines)
constexpr int64_t kMinPerThread = 1 << 15;   // below this, threading costs more than it saves

const cpu::KernelTable& table(Isa isa) {
  STRATA_CHECK(isa_supported(isa), "ISA ", isa_name(isa), " requested but this CPU supports at most ",
               isa_name(best_isa(detect_cpu_features())));
  switch (isa) {
    case Isa::kAvx512: return cpu::table_avx512();
    case Isa::kAvx2: return cpu::table_avx2();
    case Isa::kScalar: return cpu::table_scalar();
  }
  return cpu::table_scalar();
}

int idx(DType d) { return static_cast<int>(d); }

void check_spans(const OptimSpans& s, bool needs_state0, bool needs_state1, const char* what) {
  STRATA_CHECK(s.n >= 0, what, ": negative element count ", s.n);
  if (s.n == 0) return;
  STRATA_CHECK(s.master != nullptr && s.grad != nullptr, what, ": master and grad spans are required");
  STRATA_CHECK(!needs_state0 || s.state0 != nullptr, what, ": the first optimizer state span is required");
  STRATA_CHECK(!needs_state1 || s.state1 != nullptr, what, ": the second optimizer state span is required");
  STRATA_CHECK(s.param_dtype == DType::kFloat32 || s.param_copy != nullptr, what, ": a ", dtype_name(s.param_dtype),
               " parameter needs its param_copy span (the master is fp32)");
}

// Runs kernel(params, spans, begin, end) over the kernel pool.
template <class Params, class Fn>
void run_parallel(Fn fn, const Params& params, const OptimSpans& spans) {
  kernel_thread_pool().parallel_for(spans.n, kGrain, kMinPerThread,
                                    [&](int64_t b, int64_t e) { fn(params, spans, b, e); });
}

template <class Params, class Fn>
StepStatus guarded_step(Fn fn, const Params& params, const OptimSpans& spans, Isa isa) {
  if (spans.n == 0) return StepStatus::kUpdated;
  if (!params.grads_known_finite && !grad_stats(spans.grad, spans.grad_dtype, spans.n, isa).finite) {
    return StepStatus::kOverflow;
  }
  run_parallel(fn, params, spans);
  return StepStatus::kUpdated;
}

}  // namespace

bool isa_supported(Isa isa) {
  return static_cast<int>(isa) <= static_cast<int>(best_isa(detect_cpu_features()));
}

GradStats grad_stats(const void* grad, DType dtype, int64_t n, Isa isa) {
  STRATA_CHECK(n >= 0, "grad_stats: negative element count ", n);
  GradStats total;
  if (n == 0) return total;
  STRATA_CHECK(grad != nullptr, "grad_stats: null gradient span");
  const cpu::StatsFn fn = table(isa).stats[idx(dtype)];
  std::mutex mu;
  kernel_thread_pool().parallel_for(n, kGrain, kMinPerThread, [&](int64_t b, int64_t e) {
    const GradStats part = fn(grad, b, e);
    std::lock_guard<std::mutex> lock(mu);
    total.merge(part);
  });
  return total;
}

float clip_coefficient(double total_norm, double max_norm) {
  STRATA_CHECK(max_norm > 0, "clip norm must be positive, got ", max_norm);
  return static_cast<float>(std::min(1.0, max_norm / (total_norm + 1e-6)));
}

StepStatus adam_step(const AdamParams& params, const OptimSpans& spans, Isa isa) {
  check_spans(spans, true, true, "adam_step");
  STRATA_CHECK(params.step >= 1, "adam_step: step must count from 1, got ", params.step);
  return guarded_step(table(isa).adam[idx(spans.grad_dtype)][idx(spans.param_dtype)], params, spans, isa);
}

StepStatus lion_step(const LionParams& params, const OptimSpans& spans, Isa isa) {
  check_spans(spans, true, false, "lion_step");
  return guarded_step(table(isa).lion[idx(spans.grad_dtype)][idx(spans.param_dtype)], params, spans, isa);
}

StepStatus sgd_step(const SgdParams& params, const OptimSpans& spans, Isa isa) {
  check_spans(spans, params.momentum != 0.0f, false, "sgd_step");
  STRATA_CHECK(params.step >= 1, "sgd_step: step must count from 1, got ", params.step);
  return guarded_step(table(isa).sgd[idx(spans.grad_dtype)][idx(spans.param_dtype)], params, spans, isa);
}

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, Isa isa) {
  STRATA_CHECK(n >= 0, "cast: negative element count ", n);
  if (n == 0) return;
  STRATA_CHECK(src != nullptr && dst != nullptr, "cast: null span");
  if (src_dtype == dst_dtype) {
    std::memmove(dst, src, static_cast<size_t>(n) * dtype_size(src_dtype));
    return;
  }
  const cpu::CastFn fn = table(isa).cast[idx(src_dtype)][idx(dst_dtype)];
  kernel_thread_pool().parallel_for(n, kGrain, kMinPerThread, [&](int64_t b, int64_t e) { fn(src, dst, b, e); });
}

void rmw_probe(const OptimSpans& spans, Isa isa) {
  check_spans(spans, true, false, "rmw_probe");
  const cpu::ProbeFn fn = table(isa).probe[idx(spans.grad_dtype)][idx(spans.param_dtype)];
  kernel_thread_pool().parallel_for(spans.n, kGrain, kMinPerThread, [&](int64_t b, int64_t e) { fn(spans, b, e); });
}

}  // namespace strata::kernels
