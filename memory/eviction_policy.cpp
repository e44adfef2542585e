#include "strata/memory/eviction_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "strata/core/enum_names.h"
#include "strata/core/error.h"

namespace strata::memory {

namespace {
constexpr EnumName<PolicyKind> kPolicyNames[] = {
    {PolicyKind::kAuto, "auto"}, {PolicyKind::kLru, "lru"}, {PolicyKind::kStatic, "static"}};
}  // namespace

const char* policy_name(PolicyKind kind) { return enum_name(kPolicyNames, kind); }

PolicyKind parse_policy(const std::string& name) { return parse_enum(kPolicyNames, name, "device policy"); }

std::unique_ptr<EvictionPolicy> make_policy(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kLru: return std::make_unique<LruPolicy>();
    case PolicyKind::kAuto: return std::make_unique<TracePolicy>();
    case PolicyKind::kStatic: return std::make_unique<StaticPolicy>();
  }
  STRATA_ASSERT(false, "unknown PolicyKind ", static_cast<int>(kind));
  return nullptr;
}

void LruPolicy::on_access(ChunkId chunk, Tier) { last_access_[chunk] = ++clock_; }

void LruPolicy::on_leave(ChunkId, Tier) {}

void LruPolicy::on_demote(ChunkId chunk, Tier, Demotion order) {
  switch (order) {
    case Demotion::kLastFirst: last_access_[chunk] = --demoted_; break;
    case Demotion::kFirstFirst: last_access_[chunk] = INT64_MIN / 2 + ++in_order_; break;
    case Demotion::kBeforeAll: last_access_[chunk] = INT64_MIN / 2 - ++before_all_; break;
  }
}

ChunkId LruPolicy::choose_victim(Tier, const std::vector<ChunkId>& candidates) {
  STRATA_ASSERT(!candidates.empty(), "eviction policy asked to choose among no candidates");
  ChunkId best = candidates.front();
  int64_t best_time = INT64_MAX;
  for (ChunkId c : candidates) {
    const auto it = last_access_.find(c);
    const int64_t t = it == last_access_.end() ? 0 : it->second;
    if (t < best_time || (t == best_time && c < best)) {
      best = c;
      best_time = t;
    }
  }
  return best;
}

void TracePolicy::on_access(ChunkId chunk, Tier tier) { lru_.on_access(chunk, tier); }
void TracePolicy::on_leave(ChunkId chunk, Tier tier) { lru_.on_leave(chunk, tier); }

void TracePolicy::set_plan(std::vector<std::vector<ChunkId>> ops) {
  std::lock_guard<std::mutex> lock(mu_);
  plan_ = std::move(ops);
  uses_.clear();
  for (size_t k = 0; k < plan_.size(); ++k) {
    for (ChunkId c : plan_[k]) {
      auto& u = uses_[c];
      if (u.empty() || u.back() != static_cast<int64_t>(k)) u.push_back(static_cast<int64_t>(k));
    }
  }
}

void TracePolicy::clear_plan() {
  std::lock_guard<std::mutex> lock(mu_);
  plan_.clear();
  uses_.clear();
}

bool TracePolicy::has_plan() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !plan_.empty();
}

size_t TracePolicy::plan_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plan_.size();
}

std::vector<ChunkId> TracePolicy::plan_op(int64_t op) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (op < 0 || op >= static_cast<int64_t>(plan_.size())) return {};
  return plan_[op];
}

int64_t TracePolicy::next_use(ChunkId chunk, int64_t cursor) const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_use_locked(chunk, cursor);
}

int64_t TracePolicy::next_use_locked(ChunkId chunk, int64_t cursor) const {
  const auto it = uses_.find(chunk);
  if (it == uses_.end()) return INT64_MAX;
  const std::vector<int64_t>& u = it->second;
  const auto next = std::upper_bound(u.begin(), u.end(), cursor);
  if (next != u.end()) return *next - cursor;
  return u.front() + static_cast<int64_t>(plan_.size()) - cursor;  // in the next step
}

ChunkId TracePolicy::choose_victim(Tier tier, const std::vector<ChunkId>& candidates) {
  STRATA_ASSERT(!candidates.empty(), "eviction policy asked to choose among no candidates");
  const int64_t cursor = cursor_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  if (tier != Tier::kDevice || plan_.empty() || cursor < 0) return lru_.choose_victim(tier, candidates);
  ChunkId best = candidates.front();
  int64_t best_use = -1;
  for (ChunkId c : candidates) {
    const int64_t use = next_use_locked(c, cursor);
    if (use > best_use || (use == best_use && c < best)) {
      best = c;
      best_use = use;
    }
  }
  return best;
}

void StaticPolicy::set_held(std::unordered_set<ChunkId> held) {
  std::lock_guard<std::mutex> lock(mu_);
  held_ = std::move(held);
}

bool StaticPolicy::held(ChunkId chunk) const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.count(chunk) != 0;
}

// See Note [Static placement].
ChunkId StaticPolicy::choose_victim(Tier tier, const std::vector<ChunkId>& candidates) {
  STRATA_ASSERT(!candidates.empty(), "eviction policy asked to choose among no candidates");
  if (tier == Tier::kDevice) {
    std::vector<ChunkId> streamed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (ChunkId c : candidates) {
        if (held_.count(c) == 0) streamed.push_back(c);
      }
    }
    if (!streamed.empty()) return lru_.choose_victim(tier, streamed);
  }
  return lru_.choose_victim(tier, candidates);
}

std::unordered_set<ChunkId> static_held_chunks(const std::vector<std::pair<ChunkId, uint64_t>>& param_chunks,
                                               double fraction, uint64_t device_budget) {
  uint64_t total = 0, largest = 0, second = 0;
  for (const auto& [c, bytes] : param_chunks) {
    total += bytes;
    if (bytes > largest) {
      second = largest;
      largest = bytes;
    } else if (bytes > second) {
      second = bytes;
    }
  }
  const uint64_t room = device_budget > largest + second ? device_budget - largest - second : 0;
  const uint64_t wanted = fraction < 0 ? total : static_cast<uint64_t>(fraction * static_cast<double>(total));
  const uint64_t limit = std::min(room, wanted);
  std::unordered_set<ChunkId> held;
  uint64_t bytes = 0;
  for (const auto& [c, b] : param_chunks) {
    if (bytes + b > limit) break;
    bytes += b;
    held.insert(c);
  }
  return held;
}

size_t nvme_optim_families(const std::vector<uint64_t>& optim_bytes, double fraction, uint64_t host_budget) {
  const size_t n = optim_bytes.size();
  if (fraction >= 0) return std::min(n, static_cast<size_t>(std::llround(fraction * static_cast<double>(n))));
  uint64_t host = 0;
  size_t on_host = 0;
  for (uint64_t b : optim_bytes) {
    host += b;
    if (host > host_budget / 2) break;
    on_host += 1;
  }
  return n - on_host;
}

}  // namespace strata::memory
