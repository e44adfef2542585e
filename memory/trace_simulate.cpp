#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/memory/eviction_policy.h"
#include "strata/memory/trace.h"

namespace strata::memory {
namespace {

bool is_device_op(const TraceOp& o) { return o.phase != "optimizer" && !o.chunks.empty(); }

// The distinct chunks an operator touches, in order.
std::vector<int64_t> op_chunks(const TraceOp& o) {
  std::vector<int64_t> v;
  for (const TraceTouch& c : o.chunks) {
    if (std::find(v.begin(), v.end(), c.chunk) == v.end()) v.push_back(c.chunk);
  }
  return v;
}

// An operator's own compute time: its traced time less its stalls and the
// moves it made on demand, at the simulation's bandwidths.
double compute_seconds(const TraceOp& o, const SimulateOptions& so) {
  double moves = 0.0;
  for (const TraceMove& m : o.moves) {
    if (m.demand_bytes == 0) continue;
    double bw = so.h2d_bytes_per_s;
    if (m.to == "nvme") {
      bw = so.nvme_write_bytes_per_s;
    } else if (m.from == "nvme") {
      bw = so.nvme_read_bytes_per_s;
    } else if (m.from == "device") {
      bw = so.d2h_bytes_per_s;
    }
    moves += static_cast<double>(m.demand_bytes) / bw;
  }
  return std::max(0.0, o.seconds - o.stall_seconds - moves);
}

struct Family {
  uint64_t param = 0, grad = 0, optim = 0;  // optim: exp_avg, exp_avg_sq and the master
};

}  // namespace

std::pair<uint64_t, uint64_t> trace_device_bounds(const Trace& t) {
  std::unordered_map<int64_t, uint64_t> bytes;
  for (const TraceChunk& c : t.chunks) bytes[c.id] = c.bytes;
  uint64_t widest = 0, all = 0;
  for (const TraceChunk& c : t.chunks) all += c.role == "param" ? c.bytes : 0;
  for (const TraceOp& o : t.ops) {
    uint64_t need = 0;
    for (int64_t c : op_chunks(o)) need += bytes[c];
    widest = std::max(widest, need);
  }
  return {widest, all};
}

// See Note [Replaying a trace].
SimulateResult simulate_trace(const Trace& t, const SimulateOptions& o) {
  const PolicyKind kind = parse_policy(o.policy);
  STRATA_CHECK(o.h2d_bytes_per_s > 0 && o.d2h_bytes_per_s > 0 && o.nvme_read_bytes_per_s > 0 &&
                   o.nvme_write_bytes_per_s > 0,
               "bandwidths must be positive");
  SimulateResult r;
  r.device_budget = o.device_budget;
  r.host_budget = o.host_budget > 0 ? o.host_budget : t.budgets[1];
  std::unordered_map<int64_t, uint64_t> bytes;
  std::map<int32_t, Family> families;  // by family id: the engine's step order
  std::vector<std::pair<ChunkId, uint64_t>> param_chunks;
  for (const TraceChunk& c : t.chunks) {
    bytes[c.id] = c.bytes;
    Family& f = families[c.family];
    if (c.role == "param") {
      f.param += c.bytes;
      param_chunks.emplace_back(static_cast<ChunkId>(c.id), c.bytes);
    } else if (c.role == "grad") {
      f.grad += c.bytes;
    } else {
      f.optim += c.bytes;
    }
  }
  // The engine's own policy object chooses every victim (Note [Replaying a trace]).
  const std::unique_ptr<EvictionPolicy> policy = make_policy(kind);
  auto* const planner = dynamic_cast<TracePolicy*>(policy.get());
  auto* const placement = dynamic_cast<StaticPolicy*>(policy.get());
  if (placement != nullptr) placement->set_held(static_held_chunks(param_chunks, o.static_param_fraction, o.device_budget));
  const bool prefetch = o.prefetch && planner != nullptr;

  // Each device operator's distinct chunks, and the position one past the
  // last device operator of its step (where the engine's plan ends).
  std::vector<size_t> device_ops;
  std::vector<std::vector<int64_t>> device_chunks;
  for (size_t i = 0; i < t.ops.size(); ++i) {
    if (!is_device_op(t.ops[i])) continue;
    device_ops.push_back(i);
    device_chunks.push_back(op_chunks(t.ops[i]));
  }
  std::vector<size_t> step_end(device_ops.size());
  for (size_t k = device_ops.size(); k-- > 0;) {
    const bool last = k + 1 == device_ops.size() || t.ops[device_ops[k + 1]].step != t.ops[device_ops[k]].step;
    step_end[k] = last ? k + 1 : step_end[k + 1];
  }
  // The plan is the traced device operators, whole: a chunk's next use after
  // the last of them is its first (the next step looks like the traced ones).
  if (planner != nullptr) {
    std::vector<std::vector<ChunkId>> plan;
    for (const std::vector<int64_t>& op : device_chunks) plan.emplace_back(op.begin(), op.end());
    planner->set_plan(std::move(plan));
  }

  struct Resident {
    double ready = 0.0;   // compute-clock time its copy ends (prefetched chunks)
  };
  std::map<int64_t, Resident> resident;  // ordered: candidates in chunk order, as the manager lists them
  uint64_t used = 0;
  double now = 0.0;        // compute clock: compute and stalls so far
  double h2d_free = 0.0;   // when the host -> device copy queue is idle
  double backward_compute = 0.0, optimizer_compute = 0.0, compute = 0.0, device_stall = 0.0;
  std::vector<int64_t> streamed;  // static: the previous operator's streamed chunks
  auto evict = [&](int64_t c) {
    r.d2h_bytes += bytes[c];
    r.d2h_count += 1;
    used -= bytes[c];
    resident.erase(c);
    policy->on_leave(static_cast<ChunkId>(c), Tier::kDevice);
  };
  auto load = [&](int64_t c, bool ahead) {
    r.h2d_bytes += bytes[c];
    r.h2d_count += 1;
    used += bytes[c];
    const double copy = static_cast<double>(bytes[c]) / o.h2d_bytes_per_s;
    Resident& res = resident[c];
    if (ahead) {  // ChunkManager::prefetch: a move, not a use
      r.prefetched_bytes += bytes[c];
      h2d_free = std::max(h2d_free, now) + copy;
      res.ready = h2d_free;
    } else {
      now += copy;  // on demand: the operator waits for the copy
      device_stall += copy;
      res.ready = now;
      policy->on_access(static_cast<ChunkId>(c), Tier::kDevice);
    }
  };
  size_t k = 0;  // position in device_ops
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const TraceOp& op = t.ops[i];
    const double op_compute = compute_seconds(op, o);
    compute += op_compute;
    if (op.phase == "backward" || op.phase == "recompute") backward_compute += op_compute;  // recomputation runs in backward
    if (op.phase == "optimizer") optimizer_compute += op_compute;
    if (op.name == "strata::optimizer_step") {
      // The step updates every family on host: parameter chunks leave the device.
      std::vector<int64_t> params;
      for (const auto& [c, _] : resident) params.push_back(c);
      std::sort(params.begin(), params.end());
      for (int64_t c : params) evict(c);
      streamed.clear();
      now += op_compute;
      continue;
    }
    if (!is_device_op(op)) {
      now += op_compute;
      continue;
    }
    if (planner != nullptr) planner->set_cursor(static_cast<int64_t>(k));
    const std::vector<int64_t>& pinned = device_chunks[k];
    uint64_t need = 0;
    for (int64_t c : pinned) need += bytes[c];
    if (need > o.device_budget && r.fits) {
      r.fits = false;
      r.why = "operator #" + std::to_string(op.index) + " " + op.name + " needs " + format_bytes(need) +
              " of chunks on the device at once";
    }
    if (placement != nullptr) {
      for (int64_t c : streamed) {
        if (resident.count(c) != 0 && std::find(pinned.begin(), pinned.end(), c) == pinned.end()) evict(c);
      }
      streamed.clear();
      for (int64_t c : pinned) {
        if (!placement->held(static_cast<ChunkId>(c))) streamed.push_back(c);
      }
    }
    for (size_t p = 0; p < pinned.size(); ++p) {
      const int64_t c = pinned[p];
      const auto at = resident.find(c);
      if (at != resident.end()) {
        if (at->second.ready > now) {  // prefetched, still in flight
          device_stall += at->second.ready - now;
          now = at->second.ready;
        }
        policy->on_access(static_cast<ChunkId>(c), Tier::kDevice);
        continue;
      }
      while (used + bytes[c] > o.device_budget) {
        // ChunkManager::make_room: the chunks neither pinned for this
        // operator nor still arriving; with none, wait for an arrival.
        std::vector<ChunkId> candidates;
        double arrival = 0.0;
        for (const auto& [cand, res] : resident) {
          if (std::find(pinned.begin(), pinned.begin() + p, cand) != pinned.begin() + p) continue;
          if (res.ready > now) {
            arrival = arrival == 0.0 ? res.ready : std::min(arrival, res.ready);
            continue;
          }
          candidates.push_back(static_cast<ChunkId>(cand));
        }
        if (candidates.empty() && arrival > now) {
          device_stall += arrival - now;
          now = arrival;
          continue;
        }
        if (candidates.empty()) break;  // nothing evictable: the budget is too small (reported in `why`)
        const ChunkId victim = policy->choose_victim(Tier::kDevice, candidates);
        evict(victim);
        r.evictions += 1;
        if (o.record_evictions) r.evicted.push_back({op.index, victim});
      }
      load(c, /*ahead=*/false);
    }
    now += op_compute;
    // The engine's prefetch after an operator's chunks are pinned: the next
    // operators' chunks, when all fit in the free bytes and the copy queue is idle.
    if (prefetch && h2d_free <= now) {
      std::vector<int64_t> wanted;
      uint64_t want_bytes = 0;
      for (size_t j = k + 1; j < std::min(step_end[k], k + 1 + kPrefetchLookaheadOps); ++j) {
        for (int64_t c : device_chunks[j]) {
          if (resident.count(c) != 0 || std::find(wanted.begin(), wanted.end(), c) != wanted.end()) continue;
          wanted.push_back(c);
          want_bytes += bytes[c];
        }
      }
      if (!wanted.empty() && used + want_bytes <= o.device_budget) {
        for (int64_t c : wanted) load(c, /*ahead=*/true);
      }
    }
    k += 1;
  }
  const double steps = std::max<double>(1.0, static_cast<double>(t.steps.size()));

  // Host and NVMe, per step (the steady state).
  if (t.budgets[2] > 0) {
    const size_t n = families.size();
    std::vector<uint64_t> optim_bytes;
    for (const auto& [_, f] : families) optim_bytes.push_back(f.optim);
    const size_t on_nvme = nvme_optim_families(optim_bytes, t.nvme_optim_fraction, r.host_budget);
    r.nvme_optim_families = on_nvme;
    uint64_t resident_host = 0, homed = 0, largest = 0, second = 0;
    size_t index = 0;
    for (const auto& [_, f] : families) {
      resident_host += f.param + f.grad;
      if (index++ < n - r.nvme_optim_families) {
        resident_host += f.optim;
        continue;
      }
      homed += f.optim;
      if (f.optim > largest) {
        second = largest;
        largest = f.optim;
      } else if (f.optim > second) {
        second = f.optim;
      }
    }
    const uint64_t in_flight = o.prefetch ? largest + second : largest;
    const uint64_t demand = resident_host + in_flight;
    r.host_spill_bytes = demand > r.host_budget ? demand - r.host_budget : 0;
    r.nvme_read_bytes = homed + r.host_spill_bytes;
    r.nvme_write_bytes = homed + r.host_spill_bytes;
    const double read = static_cast<double>(r.nvme_read_bytes) / o.nvme_read_bytes_per_s;
    const double write = static_cast<double>(r.nvme_write_bytes) / o.nvme_write_bytes_per_s;
    const double optimizer = optimizer_compute / steps, backward = backward_compute / steps;
    double stall = std::max(0.0, write - optimizer);  // write-behind, waited for at the step's end
    if (!o.prefetch) {
      stall += read;
    } else {
      // Early reads into the free host bytes overlap backward; the rest is
      // read a family ahead, overlapping all updates but the first.
      const uint64_t free_host = r.host_budget > resident_host ? r.host_budget - resident_host : 0;
      const double early = static_cast<double>(std::min(homed, free_host)) / o.nvme_read_bytes_per_s;
      const double rest = read - early;
      const double overlap = n > 0 ? optimizer * static_cast<double>(n - 1) / static_cast<double>(n) : 0.0;
      stall += std::max(0.0, early - backward) + std::max(0.0, rest - overlap);
    }
    r.nvme_stall_seconds = stall;
  }
  r.compute_seconds = compute / steps;
  r.device_stall_seconds = device_stall / steps;
  r.step_seconds = r.compute_seconds + r.device_stall_seconds + r.nvme_stall_seconds;
  return r;
}

}  // namespace strata::memory
