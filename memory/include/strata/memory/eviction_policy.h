#pragma once
// EvictionPolicy: which chunk leaves a tier when the tier is over budget.
//
// The chunk manager decides *when* to evict (a request would exceed the
// budget) and *which chunks may go* (resident on the tier, no tensor in
// COMPUTE, not part of the move in progress); the policy only picks among
// those candidates. It is told of every access and arrival so that it can
// keep its own order. LRU is the default; the trace-driven policy (Belady over
// a recorded trace) arrives with the tracer issue.

#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "strata/memory/types.h"

namespace strata::memory {

using ChunkId = int32_t;

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* name() const noexcept = 0;

  /// A chunk was accessed on `tier` (made resident there, or already was).
  virtual void on_access(ChunkId chunk, Tier tier) = 0;
  /// A chunk left `tier` (evicted, moved or released).
  virtual void on_leave(ChunkId chunk, Tier tier) = 0;
  /// Picks the chunk to evict from `tier` among `candidates` (never empty).
  virtual ChunkId choose_victim(Tier tier, const std::vector<ChunkId>& candidates) = 0;
};

/// Least recently used: evicts the candidate whose last access is oldest
/// (ties: the lower chunk id, so runs are reproducible).
class LruPolicy final : public EvictionPolicy {
 public:
  const char* name() const noexcept override { return "lru"; }
  void on_access(ChunkId chunk, Tier tier) override;
  void on_leave(ChunkId chunk, Tier tier) override;
  ChunkId choose_victim(Tier tier, const std::vector<ChunkId>& candidates) override;

 private:
  uint64_t clock_ = 0;
  std::unordered_map<ChunkId, uint64_t> last_access_;
};

}  // namespace strata::memory
