#pragma once
// EvictionPolicy: which chunk leaves a tier when the tier is over budget.
//
// The chunk manager decides *when* to evict (a request would exceed the
// budget) and *which chunks may go* (resident on the tier, no tensor in
// COMPUTE, not part of the move in progress); the policy only picks among
// those candidates. It is told of every access and arrival so that it can
// keep its own order. LruPolicy orders by last access; TracePolicy evicts the
// chunk whose next use in a recorded operator sequence is furthest away
// (Belady), falling back to LRU without a plan.

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "strata/memory/types.h"

namespace strata::memory {

using ChunkId = int32_t;

/// Which demoted chunk leaves its tier first (ChunkManager::demote).
enum class Demotion {
  kLastFirst,   // the last demoted: they are needed again in the order they were demoted
  kFirstFirst,  // the first demoted: needed again in the reverse order
  kBeforeAll,   // before every chunk demoted otherwise, the last demoted first: not needed
                // before the next step's use of the same kind (an updated family's
                // optimizer state, Note [Updated optimizer state leaves before parameters])
};

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
  /// The chunk, on `tier`, will not be used before every chunk used since
  /// it was demoted: order it first to leave, among the demoted chunks as
  /// `order` says (ChunkManager::demote). Policies that know the future ignore it.
  virtual void on_demote(ChunkId chunk, Tier tier, Demotion order) {
    (void)chunk, (void)tier, (void)order;
  }
};

/// Least recently used: evicts the candidate whose last access is oldest
/// (ties: the lower chunk id, so runs are reproducible). Demoted chunks are
/// older than any access: those demoted kBeforeAll oldest, the last demoted
/// oldest; then those demoted kFirstFirst, the first demoted oldest; then
/// those demoted kLastFirst, the last demoted oldest.
class LruPolicy final : public EvictionPolicy {
 public:
  const char* name() const noexcept override { return "lru"; }
  void on_access(ChunkId chunk, Tier tier) override;
  void on_leave(ChunkId chunk, Tier tier) override;
  ChunkId choose_victim(Tier tier, const std::vector<ChunkId>& candidates) override;
  void on_demote(ChunkId chunk, Tier tier, Demotion order) override;

 private:
  int64_t clock_ = 0;  // accesses count up from 1, kLastFirst demotions down from -1
  int64_t demoted_ = 0;
  int64_t in_order_ = 0;  // kFirstFirst demotions count up from INT64_MIN / 2
  int64_t before_all_ = 0;  // kBeforeAll demotions count down from INT64_MIN / 2
  std::unordered_map<ChunkId, int64_t> last_access_;
};

// Note [Belady over the recorded operator sequence]
// The engine records, during a warm-up step, the chunks each operator that
// touches parameters uses, in order: the plan. A training step repeats it, so
// the next use of every chunk is known: for a chunk used by operators u1 < u2
// < ... of an n-operator step, seen at operator k, the next use is the first
// ui > k, or u1 + n (the next step) when there is none. Evicting the candidate
// whose next use is furthest away is Belady's rule, optimal in misses for
// equal-sized chunks; a chunk the plan never uses goes first. The engine moves
// the cursor (set_cursor) before each operator, clears the plan when the
// operator sequence diverges from it (another sequence length, another
// branch), and records a new one; without a plan, or for other tiers than the
// device, the policy is LRU.
/// How many operators ahead the auto policy prefetches the chunks of (the
/// engine's prefetch_upcoming and the simulator's model of it).
constexpr int kPrefetchLookaheadOps = 4;

class TracePolicy final : public EvictionPolicy {
 public:
  const char* name() const noexcept override { return "auto"; }
  void on_access(ChunkId chunk, Tier tier) override;
  void on_leave(ChunkId chunk, Tier tier) override;
  ChunkId choose_victim(Tier tier, const std::vector<ChunkId>& candidates) override;
  /// For the LRU order it falls back to; the plan's next uses take precedence.
  void on_demote(ChunkId chunk, Tier tier, Demotion order) override { lru_.on_demote(chunk, tier, order); }

  /// `ops[k]` are the chunks operator k of a step uses.
  void set_plan(std::vector<std::vector<ChunkId>> ops);
  void clear_plan();
  bool has_plan() const;
  size_t plan_size() const;
  /// The chunks operator `op` of the plan uses (empty past the end or without a plan).
  std::vector<ChunkId> plan_op(int64_t op) const;
  /// Operator `op` is about to run; -1: outside a planned step (LRU).
  void set_cursor(int64_t op) { cursor_.store(op, std::memory_order_relaxed); }
  /// Operators from the cursor to `chunk`'s next use; INT64_MAX when the plan never uses it.
  int64_t next_use(ChunkId chunk, int64_t cursor) const;

 private:
  int64_t next_use_locked(ChunkId chunk, int64_t cursor) const;
  LruPolicy lru_;
  mutable std::mutex mu_;
  std::vector<std::vector<ChunkId>> plan_;
  std::unordered_map<ChunkId, std::vector<int64_t>> uses_;
  std::atomic<int64_t> cursor_{-1};
};

// Note [Static placement]
// Colossal-AI Gemini's static policy, for comparison with auto and for users
// who want a placement they can predict: a fixed set of parameter chunks (the
// first ones in chunk order, which is the module's parameter order, so
// roughly forward order) is held on the device between uses; every other
// parameter chunk is streamed, brought to the device for the operators that
// use it and returned to host before the next operator that does not (the
// engine does this, ChunkManager::move). When the budget forces an eviction
// anyway, streamed chunks go first, then held ones, each least recently used
// first: the budget stays a hard limit. The held fraction is
// EngineOptions::static_param_fraction; the optimizer state's host/NVMe split
// is nvme_optim_fraction, and gradients live on host, as in ZeRO-Offload.
class StaticPolicy final : public EvictionPolicy {
 public:
  const char* name() const noexcept override { return "static"; }
  void on_access(ChunkId chunk, Tier tier) override { lru_.on_access(chunk, tier); }
  void on_leave(ChunkId chunk, Tier tier) override { lru_.on_leave(chunk, tier); }
  ChunkId choose_victim(Tier tier, const std::vector<ChunkId>& candidates) override;
  void on_demote(ChunkId chunk, Tier tier, Demotion order) override { lru_.on_demote(chunk, tier, order); }

  void set_held(std::unordered_set<ChunkId> held);
  bool held(ChunkId chunk) const;

 private:
  LruPolicy lru_;
  mutable std::mutex mu_;
  std::unordered_set<ChunkId> held_;
};

/// The device policies, as EngineOptions::policy and `strata trace simulate
/// --policy` name them: lru (LruPolicy), auto (TracePolicy, the plan and
/// its prefetch), static (StaticPolicy). The engine and the simulator both
/// make theirs with make_policy(), so a replay chooses victims as a run does.
enum class PolicyKind { kLru, kAuto, kStatic };
const char* policy_name(PolicyKind kind);
/// Throws strata::Error listing the names for anything else.
PolicyKind parse_policy(const std::string& name);
std::unique_ptr<EvictionPolicy> make_policy(PolicyKind kind);

/// The chunks static placement holds on the device: the longest prefix of
/// `param_chunks` (with their sizes) whose bytes stay within `fraction` of
/// all of them and within `device_budget` less room to stream the two largest
/// chunks. `fraction` < 0: as many as that room allows.
std::unordered_set<ChunkId> static_held_chunks(const std::vector<std::pair<ChunkId, uint64_t>>& param_chunks,
                                               double fraction, uint64_t device_budget);

/// How many chunk families keep their optimizer state on NVMe between steps
/// (the last ones, in step order): `fraction` of them when it is >= 0, else
/// (auto) those whose state does not fit, with the families before them, in
/// half of `host_budget`. `optim_bytes` is each family's state in step order.
/// The engine places state by it and `strata trace simulate` predicts with it.
size_t nvme_optim_families(const std::vector<uint64_t>& optim_bytes, double fraction, uint64_t host_budget);

}  // namespace strata::memory
