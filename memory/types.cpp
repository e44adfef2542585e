#include "strata/memory/types.h"

#include "strata/core/bytes.h"
#include "strata/core/error.h"

namespace strata::memory {

const char* tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "unknown";
}

Tier parse_tier(const std::string& name) {
  if (name == "device") return Tier::kDevice;
  if (name == "host") return Tier::kHost;
  if (name == "nvme") return Tier::kNvme;
  STRATA_FAIL("unknown tier '", name, "'; use device, host or nvme");
}

size_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

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

uint64_t TierBudgets::of(Tier tier) const {
  switch (tier) {
    case Tier::kDevice: return device;
    case Tier::kHost: return host;
    case Tier::kNvme: return nvme;
  }
  return 0;
}

TierBudgets TierBudgets::from_strings(const std::string& device, const std::string& host, const std::string& nvme) {
  return TierBudgets{parse_bytes(device), parse_bytes(host), parse_bytes(nvme)};
}

}  // namespace strata::memory
