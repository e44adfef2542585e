#pragma once
// STRATA_CUDA_CHECK(expr, context...): decodes a failed CUDA runtime call into
// strata::Error ("<context>: cudaMalloc(&p, n) failed: cudaErrorMemoryAllocation
// (out of memory)"). Include only from CUDA-only sources: it needs the CUDA
// runtime headers.

#include <cuda_runtime_api.h>

#include "strata/core/error.h"

#define STRATA_CUDA_CHECK(expr, ...)                                                          \
  do {                                                                                        \
    const cudaError_t strata_err_ = (expr);                                                   \
    if (strata_err_ != cudaSuccess) {                                                         \
      STRATA_FAIL(__VA_ARGS__, ": ", #expr, " failed: ", cudaGetErrorName(strata_err_), " (", \
                  cudaGetErrorString(strata_err_), ")");                                      \
    }                                                                                         \
  } while (0)
