#include "strata/core/dtype.h"

#include "strata/core/error.h"

namespace strata {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
  }
  return "unknown";
}

DType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  STRATA_FAIL("unknown dtype '", name, "'; use fp32, bf16 or fp16");
}

}  // namespace strata
