#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/memory/trace.h"

namespace strata::memory {
namespace {

bool is_device_op(const TraceOp& o) { return o.phase != "optimizer" && !o.chunks.empty(); }

}  // namespace

std::pair<uint64_t, uint64_t> trace_device_bounds(const Trace& t) {
  std::unordered_map<int64_t, uint64_t> bytes;
  for (const TraceChunk& c : t.chunks) bytes[c.id] = c.bytes;
  uint64_t widest = 0, all = 0;
  for (const TraceChunk& c : t.chunks) all += c.role == "param" ? c.bytes : 0;
  for (const TraceOp& o : t.ops) {
    uint64_t need = 0;
    std::unordered_set<int64_t> seen;
    for (const TraceTouch& c : o.chunks) {
      if (seen.insert(c.chunk).second) need += bytes[c.chunk];
    }
    widest = std::max(widest, need);
  }
  return {widest, all};
}

// See Note [Replaying a trace].
SimulateResult simulate_trace(const Trace& t, const SimulateOptions& o) {
  STRATA_CHECK(o.policy == "lru" || o.policy == "auto", "policy \"", o.policy, "\" is not one of lru, auto");
  STRATA_CHECK(o.h2d_bytes_per_s > 0 && o.d2h_bytes_per_s > 0, "bandwidths must be positive");
  SimulateResult r;
  r.device_budget = o.device_budget;
  std::unordered_map<int64_t, uint64_t> bytes;
  std::unordered_map<int64_t, std::string> role;
  for (const TraceChunk& c : t.chunks) {
    bytes[c.id] = c.bytes;
    role[c.id] = c.role;
  }
  // Uses of each chunk by device operators, for Belady; past the trace's end
  // the sequence repeats (the next step looks like the traced ones).
  std::vector<size_t> device_ops;
  for (size_t i = 0; i < t.ops.size(); ++i) {
    if (is_device_op(t.ops[i])) device_ops.push_back(i);
  }
  std::unordered_map<int64_t, std::vector<size_t>> uses;  // chunk -> positions in device_ops
  for (size_t k = 0; k < device_ops.size(); ++k) {
    for (const TraceTouch& c : t.ops[device_ops[k]].chunks) {
      auto& u = uses[c.chunk];
      if (u.empty() || u.back() != k) u.push_back(k);
    }
  }
  auto next_use = [&](int64_t chunk, size_t k) -> uint64_t {
    const auto it = uses.find(chunk);
    if (it == uses.end()) return UINT64_MAX;
    const auto n = std::upper_bound(it->second.begin(), it->second.end(), k);
    return n != it->second.end() ? *n - k : it->second.front() + device_ops.size() - k;
  };

  std::unordered_map<int64_t, uint64_t> resident;  // chunk -> last use (LRU clock)
  uint64_t used = 0, clock = 0;
  size_t k = 0;  // position in device_ops
  auto evict = [&](int64_t c) {
    r.d2h_bytes += bytes[c];
    r.d2h_count += 1;
    used -= bytes[c];
    resident.erase(c);
  };
  for (const TraceOp& op : t.ops) {
    if (op.name == "strata::optimizer_step") {
      // The step updates every family on host: parameter chunks leave the device.
      std::vector<int64_t> params;
      for (const auto& [c, _] : resident) params.push_back(c);
      for (int64_t c : params) evict(c);
      continue;
    }
    if (!is_device_op(op)) continue;
    std::vector<int64_t> pinned;
    uint64_t need = 0;
    for (const TraceTouch& c : op.chunks) {
      if (std::find(pinned.begin(), pinned.end(), c.chunk) != pinned.end()) continue;
      pinned.push_back(c.chunk);
      need += bytes[c.chunk];
    }
    if (need > o.device_budget && r.fits) {
      r.fits = false;
      r.why = "operator #" + std::to_string(op.index) + " " + op.name + " needs " + format_bytes(need) +
              " of chunks on the device at once";
    }
    for (size_t i = 0; i < pinned.size(); ++i) {
      const int64_t c = pinned[i];
      if (resident.count(c) == 0) {
        while (used + bytes[c] > o.device_budget) {
          int64_t victim = -1;
          uint64_t best = 0;
          for (const auto& [cand, last] : resident) {
            if (std::find(pinned.begin(), pinned.begin() + i, cand) != pinned.begin() + i) continue;
            const uint64_t score = o.policy == "lru" ? UINT64_MAX - last : next_use(cand, k);
            if (victim < 0 || score > best || (score == best && cand < victim)) {
              victim = cand;
              best = score;
            }
          }
          if (victim < 0) break;  // nothing evictable: the budget is too small (reported in `why`)
          evict(victim);
          r.evictions += 1;
        }
        r.h2d_bytes += bytes[c];
        r.h2d_count += 1;
        used += bytes[c];
      }
      resident[c] = ++clock;
    }
    k += 1;
  }
  // Step time: traced compute plus predicted device moves.
  double traced_step = 0.0;
  uint64_t traced_h2d = 0, traced_d2h = 0;
  for (const TraceStep& s : t.steps) traced_step += s.seconds;
  for (const TraceOp& op : t.ops) {
    for (const TraceMove& m : op.moves) {
      if ((m.from == "host" || m.from == "nvme") && m.to == "device") traced_h2d += m.bytes;
      if (m.from == "device") traced_d2h += m.bytes;
    }
  }
  const double traced_moves = traced_h2d / o.h2d_bytes_per_s + traced_d2h / o.d2h_bytes_per_s;
  const double predicted_moves = r.h2d_bytes / o.h2d_bytes_per_s + r.d2h_bytes / o.d2h_bytes_per_s;
  const double steps = std::max<double>(1.0, static_cast<double>(t.steps.size()));
  r.step_seconds = std::max(0.0, traced_step - traced_moves) / steps + predicted_moves / steps;
  return r;
}

}  // namespace strata::memory
