#include "strata/memory/eviction_policy.h"

#include "strata/core/error.h"

namespace strata::memory {

void LruPolicy::on_access(ChunkId chunk, Tier) { last_access_[chunk] = ++clock_; }

void LruPolicy::on_leave(ChunkId, Tier) {}

ChunkId LruPolicy::choose_victim(Tier, const std::vector<ChunkId>& candidates) {
  STRATA_ASSERT(!candidates.empty(), "eviction policy asked to choose among no candidates");
  ChunkId best = candidates.front();
  uint64_t best_time = UINT64_MAX;
  for (ChunkId c : candidates) {
    const auto it = last_access_.find(c);
    const uint64_t t = it == last_access_.end() ? 0 : it->second;
    if (t < best_time || (t == best_time && c < best)) {
      best = c;
      best_time = t;
    }
  }
  return best;
}

}  // namespace strata::memory
