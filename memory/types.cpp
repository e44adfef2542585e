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
