#pragma once
// Element types of chunks and kernels. Master weights and optimizer state are
// always fp32; parameters and gradients may be any of the three.

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata {

enum class DType : uint8_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};
constexpr int kNumDTypes = 3;

constexpr size_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType dtype);
/// "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16"; throws strata::Error otherwise.
DType parse_dtype(const std::string& name);

}  // namespace strata
