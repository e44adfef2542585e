#include "strata/memory/types.h"

#include "strata/core/bytes.h"
#include "strata/core/enum_names.h"
#include "strata/core/error.h"

namespace strata::memory {

namespace {
constexpr EnumName<Tier> kTierNames[] = {{Tier::kDevice, "device"}, {Tier::kHost, "host"}, {Tier::kNvme, "nvme"}};
}  // namespace

const char* tier_name(Tier tier) { return enum_name(kTierNames, tier); }

Tier parse_tier(const std::string& name) { return parse_enum(kTierNames, name, "tier"); }

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
