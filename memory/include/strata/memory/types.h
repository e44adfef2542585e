#pragma once
// Tiers, dtypes and budgets: the vocabulary of the chunk memory core.

#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/core/dtype.h"

namespace strata::memory {

enum class Tier : uint8_t {
  kDevice = 0,  // GPU memory, or host memory emulating it (offload::DeviceMemory)
  kHost = 1,    // CPU memory from the strata host arena, pinned under CUDA
  kNvme = 2,    // a SwapStore on local disk (offload's NvmeStore, through NvmeSwapStore)
};
constexpr int kNumTiers = 3;

const char* tier_name(Tier tier);
/// "device" / "host" / "nvme"; throws strata::Error naming the accepted values.
Tier parse_tier(const std::string& name);
/// The tier a chunk is evicted to, or itself for the last tier.
constexpr Tier next_lower_tier(Tier tier) {
  return tier == Tier::kDevice ? Tier::kHost : Tier::kNvme;
}

using ::strata::DType;
using ::strata::dtype_name;
using ::strata::dtype_size;
using ::strata::parse_dtype;

/// Byte budgets of the three tiers. Each is a hard limit on the bytes the
/// chunk manager keeps on that tier (payload rounded up to the allocation
/// alignment), never exceeded.
struct TierBudgets {
  uint64_t device = 0;
  uint64_t host = 0;
  uint64_t nvme = 0;

  uint64_t of(Tier tier) const;
  /// Parses human sizes, e.g. from_strings("512MiB", "2GiB", "0").
  static TierBudgets from_strings(const std::string& device, const std::string& host, const std::string& nvme);
};

/// Allocation granularity of chunk payloads on every tier: 4 KiB (pages, O_DIRECT).
constexpr size_t kChunkAlignment = 4096;

}  // namespace strata::memory
