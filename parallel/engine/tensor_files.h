#pragma once
// Small helpers shared by the engine's tensor-file code (checkpoint.cpp,
// weights.cpp): shapes and the safetensors names of dtypes.
// Private to strata_parallel.

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "strata/core/error.h"

namespace strata::parallel {

inline std::vector<int64_t> shape_of(const torch::Tensor& t) { return t.sizes().vec(); }

inline std::string shape_str(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

inline torch::ScalarType torch_dtype(const std::string& st) {
  if (st == "F32") return torch::kFloat32;
  if (st == "F64") return torch::kFloat64;
  if (st == "F16") return torch::kFloat16;
  if (st == "BF16") return torch::kBFloat16;
  STRATA_FAIL("dtype ", st, " is not a floating type a parameter can take");
}

}  // namespace strata::parallel
