#pragma once
// Small helpers shared by the engine's tensor-file code (checkpoint_save.cpp,
// checkpoint_load.cpp, weights.cpp): shapes and the safetensors names of dtypes.
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

// torch's scalar types and their safetensors names, one table both ways.
struct StDtype {
  torch::ScalarType torch;
  const char* name;
};
inline constexpr StDtype kStDtypes[] = {
    {torch::kFloat64, "F64"}, {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"}, {torch::kBFloat16, "BF16"},
    {torch::kInt64, "I64"},   {torch::kInt32, "I32"},   {torch::kInt16, "I16"},   {torch::kInt8, "I8"},
    {torch::kUInt8, "U8"},    {torch::kBool, "BOOL"}};

/// The safetensors name of a buffer's or parameter's dtype.
inline std::string st_dtype_of(torch::ScalarType t) {
  for (const StDtype& d : kStDtypes) {
    if (d.torch == t) return d.name;
  }
  STRATA_FAIL("a tensor of dtype ", t, " cannot be saved in a safetensors file");
}

/// The torch scalar type of a safetensors dtype name.
inline torch::ScalarType scalar_type_of_st(const std::string& st) {
  for (const StDtype& d : kStDtypes) {
    if (st == d.name) return d.torch;
  }
  STRATA_FAIL("safetensors dtype ", st, " has no torch scalar type");
}

/// The same for a parameter, which must be floating point.
inline torch::ScalarType torch_dtype(const std::string& st) {
  const torch::ScalarType t = scalar_type_of_st(st);
  STRATA_CHECK(c10::isFloatingType(t), "dtype ", st, " is not a floating type a parameter can take");
  return t;
}

}  // namespace strata::parallel
