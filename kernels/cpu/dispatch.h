#pragma once
// One table of kernel entry points per ISA. Each is defined in its own
// translation unit (optim_scalar.cpp, optim_avx2.cpp, optim_avx512.cpp),
// compiled with that ISA's flags from the templates in optim_impl.h. Arrays
// are indexed by DType: [grad dtype][param copy dtype] (fp32 copy = none).

#include <cstdint>

#include "strata/kernels/isa.h"
#include "strata/kernels/optim.h"

namespace strata::kernels::cpu {

using AdamFn = void (*)(const AdamParams&, const OptimSpans&, int64_t begin, int64_t end);
using LionFn = void (*)(const LionParams&, const OptimSpans&, int64_t begin, int64_t end);
using SgdFn = void (*)(const SgdParams&, const OptimSpans&, int64_t begin, int64_t end);
using StatsFn = GradStats (*)(const void* grad, int64_t begin, int64_t end);
using CastFn = void (*)(const void* src, void* dst, int64_t begin, int64_t end);
using ProbeFn = void (*)(const OptimSpans&, int64_t begin, int64_t end);

struct KernelTable {
  AdamFn adam[kNumDTypes][kNumDTypes];
  LionFn lion[kNumDTypes][kNumDTypes];
  SgdFn sgd[kNumDTypes][kNumDTypes];
  StatsFn stats[kNumDTypes];
  CastFn cast[kNumDTypes][kNumDTypes];
  ProbeFn probe[kNumDTypes][kNumDTypes];
};

const KernelTable& table_scalar();
const KernelTable& table_avx2();
const KernelTable& table_avx512();

}  // namespace strata::kernels::cpu
