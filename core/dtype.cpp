#include "strata/core/dtype.h"

#include "strata/core/enum_names.h"

namespace strata {
namespace {
constexpr EnumName<DType> kDTypeNames[] = {
    {DType::kFloat32, "fp32"},    {DType::kBFloat16, "bf16"},     {DType::kFloat16, "fp16"},
    {DType::kFloat32, "float32"}, {DType::kBFloat16, "bfloat16"}, {DType::kFloat16, "float16"},
};
}  // namespace

const char* dtype_name(DType dtype) { return enum_name(kDTypeNames, dtype); }

DType parse_dtype(const std::string& name) { return parse_enum(kDTypeNames, name, "dtype"); }

}  // namespace strata
