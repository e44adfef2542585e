// Pipeline schedules as data (pipeline_schedule.h).
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <tuple>

#include "strata/core/enum_names.h"
#include "strata/core/error.h"
#include "strata/memory/trace.h"
#include "strata/parallel/pipeline_schedule.h"

namespace strata::parallel::pipeline {

namespace {
constexpr EnumName<Schedule> kScheduleNames[] = {{Schedule::kGPipe, "gpipe"},
                                                 {Schedule::k1F1B, "1f1b"},
                                                 {Schedule::kInterleaved1F1B, "interleaved-1f1b"},
                                                 {Schedule::kZeroBubbleH1, "zb-h1"}};
}  // namespace

Schedule schedule_from_name(const std::string& name) { return parse_enum(kScheduleNames, name, "pipeline schedule"); }

const char* schedule_name(Schedule s) { return enum_name(kScheduleNames, s); }

std::string to_string(const Action& a) {
  const char* k = a.kind == ActionKind::kForward          ? "F"
                  : a.kind == ActionKind::kBackward       ? "B"
                  : a.kind == ActionKind::kBackwardInput  ? "BI"
                                                          : "W";
  return fmt::format("{}{}.{}", k, a.stage, a.microbatch);
}

void check_schedule(Schedule s, int p, int v, int m) {
  STRATA_CHECK(p >= 1, "a pipeline needs at least one stage, not ", p);
  STRATA_CHECK(m >= 1, "a pipeline step needs at least one microbatch, not ", m);
  STRATA_CHECK(v >= 1, "virtual stages per rank must be at least 1, not ", v);
  if (s == Schedule::kInterleaved1F1B) {
    STRATA_CHECK(m % p == 0, "interleaved-1f1b needs the microbatches (", m, ") to be a multiple of the stages (", p,
                 "), as Megatron's does: use ", (m + p - 1) / p * p, " microbatches, or another schedule");
  } else {
    STRATA_CHECK(v == 1, "schedule ", schedule_name(s), " runs one stage per rank; virtual stages (", v,
                 ") need interleaved-1f1b");
  }
}

namespace {

Action act(ActionKind k, int s, int mb) { return Action{k, s, mb}; }

// Finish times of the actions run so far, and when an action's input is
// ready (Note [Pipeline actions]): a forward waits for the previous stage's
// forward, a backward (or input pass) for the next stage's (the last stage
// for its own forward), a weight pass for its input pass.
class Timeline {
 public:
  explicit Timeline(int stages) : stages_(stages) {}
  void finish(const Action& a, double t) { done_[{static_cast<int>(a.kind), a.stage, a.microbatch}] = t; }
  std::optional<double> ready(const Action& a) const {
    switch (a.kind) {
      case ActionKind::kForward:
        return a.stage == 0 ? std::optional<double>(0.0) : at(ActionKind::kForward, a.stage - 1, a.microbatch);
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (a.stage == stages_ - 1) return at(ActionKind::kForward, a.stage, a.microbatch);
        if (auto t = at(ActionKind::kBackward, a.stage + 1, a.microbatch)) return t;
        return at(ActionKind::kBackwardInput, a.stage + 1, a.microbatch);
      case ActionKind::kBackwardWeight: return at(ActionKind::kBackwardInput, a.stage, a.microbatch);
    }
    return std::nullopt;
  }

 private:
  std::optional<double> at(ActionKind k, int s, int mb) const {
    auto it = done_.find({static_cast<int>(k), s, mb});
    return it == done_.end() ? std::nullopt : std::optional<double>(it->second);
  }
  int stages_;
  std::map<std::tuple<int, int, int>, double> done_;  // (kind, stage, mb) -> finish
};

// 1F1B's order of forwards and backwards on one stage (`backward` is B, or BI under ZB).
std::vector<Action> one_f_one_b(int rank, int p, int m, ActionKind backward) {
  const int warmup = std::min(p - rank - 1, m);
  std::vector<Action> a;
  for (int k = 0; k < warmup; ++k) a.push_back(act(ActionKind::kForward, rank, k));
  for (int i = 0; i < m - warmup; ++i) {
    a.push_back(act(ActionKind::kForward, rank, warmup + i));
    a.push_back(act(backward, rank, i));
  }
  for (int k = m - warmup; k < m; ++k) a.push_back(act(backward, rank, k));
  return a;
}

// Megatron's interleaved order: microbatches in groups of p, each group
// through chunk 0, 1, .. forward and through the chunks in reverse backward.
std::vector<Action> interleaved(int rank, int p, int v, int m) {
  const int total = m * v;
  auto unit = [&](int k, bool forward) {
    const int c = (k / p) % v;
    const int chunk = forward ? c : v - 1 - c;
    const int mb = (k / (p * v)) * p + k % p;
    return act(forward ? ActionKind::kForward : ActionKind::kBackward, chunk * p + rank, mb);
  };
  const int warmup = std::min((p - rank - 1) * 2 + (v - 1) * p, total);
  std::vector<Action> a;
  for (int k = 0; k < warmup; ++k) a.push_back(unit(k, true));
  for (int i = 0; i < total - warmup; ++i) {
    a.push_back(unit(warmup + i, true));
    a.push_back(unit(i, false));
  }
  for (int k = total - warmup; k < total; ++k) a.push_back(unit(k, false));
  return a;
}

// ZB-H1: 1F1B's forwards and input-gradient passes, with each weight pass
// placed where its rank would otherwise wait, found by running all ranks
// with equal unit costs; a rank holds at most p microbatches between
// forward and weight pass (1F1B's peak on the first stage), so memory stays
// 1F1B's. With m >= p its bubble is the paper's (p-1)(F+B-W).
std::vector<std::vector<Action>> zero_bubble_h1(int p, int m) {
  std::vector<std::vector<Action>> seq(p), out(p);
  for (int r = 0; r < p; ++r) seq[r] = one_f_one_b(r, p, m, ActionKind::kBackwardInput);
  Timeline timeline(p);
  std::vector<double> t(p, 0.0);
  std::vector<size_t> pos(p, 0);
  std::vector<int> forwards(p, 0), inputs(p, 0), weights(p, 0);
  for (;;) {
    int best_rank = -1;
    double best_start = std::numeric_limits<double>::infinity();
    Action best{ActionKind::kForward, 0, 0};
    for (int r = 0; r < p; ++r) {
      double start = std::numeric_limits<double>::infinity();
      Action chosen{ActionKind::kForward, 0, 0};
      if (pos[r] < seq[r].size()) {
        const Action& a = seq[r][pos[r]];
        std::optional<double> dep = timeline.ready(a);
        if (a.kind == ActionKind::kForward && forwards[r] - weights[r] >= p) dep.reset();  // memory: a weight pass first
        if (dep) {
          start = std::max(t[r], *dep);
          chosen = a;
        }
      }
      if (weights[r] < inputs[r] && t[r] < start) {  // a weight pass fills the wait
        start = t[r];
        chosen = act(ActionKind::kBackwardWeight, r, weights[r]);
      }
      if (start < best_start) {
        best_start = start;
        best_rank = r;
        best = chosen;
      }
    }
    if (best_rank < 0) break;
    const int r = best_rank;
    t[r] = best_start + 1.0;
    timeline.finish(best, t[r]);
    out[r].push_back(best);
    if (best.kind == ActionKind::kForward) forwards[r] += 1, pos[r] += 1;
    if (best.kind == ActionKind::kBackwardInput) inputs[r] += 1, pos[r] += 1;
    if (best.kind == ActionKind::kBackwardWeight) weights[r] += 1;
  }
  for (int r = 0; r < p; ++r) {
    STRATA_CHECK(static_cast<int>(out[r].size()) == 3 * m, "internal: the zb-h1 order of rank ", r, " is incomplete");
  }
  return out;
}

}  // namespace

std::vector<Action> schedule_actions(Schedule s, int rank, int p, int v, int m) {
  check_schedule(s, p, v, m);
  STRATA_CHECK(rank >= 0 && rank < p, "rank ", rank, " is not a stage of ", p);
  switch (s) {
    case Schedule::kGPipe: {
      std::vector<Action> a;
      for (int k = 0; k < m; ++k) a.push_back(act(ActionKind::kForward, rank, k));
      for (int k = 0; k < m; ++k) a.push_back(act(ActionKind::kBackward, rank, k));
      return a;
    }
    case Schedule::k1F1B: return one_f_one_b(rank, p, m, ActionKind::kBackward);
    case Schedule::kInterleaved1F1B: return interleaved(rank, p, v, m);
    case Schedule::kZeroBubbleH1: return zero_bubble_h1(p, m)[rank];
  }
  STRATA_FAIL("unknown schedule");
}

double SimulatedStep::bubble() const {
  double worst = 0.0;
  for (double b : busy) worst = std::max(worst, time > 0 ? 1.0 - b / time : 0.0);
  return worst;
}

namespace {

bool is_backward(ActionKind k) { return k == ActionKind::kBackward || k == ActionKind::kBackwardInput; }

// Note [Pipeline links]: both ends of every link must run its items in one
// order. Returns where they first differ, or "".
std::string link_mismatch(const std::vector<std::vector<Action>>& per_rank, int p, int v) {
  const int stages = p * v;
  // Per link (its sending rank), activations and gradients as each end sees them: (stage, mb).
  std::vector<std::vector<std::pair<int, int>>> act_sent(p), act_recv(p), grad_sent(p), grad_recv(p);
  for (int r = 0; r < p; ++r) {
    for (const Action& a : per_rank[r]) {
      if (a.kind == ActionKind::kForward) {
        if (a.stage + 1 < stages) act_sent[r].push_back({a.stage, a.microbatch});
        if (a.stage > 0) act_recv[(r + p - 1) % p].push_back({a.stage - 1, a.microbatch});
      } else if (is_backward(a.kind)) {
        if (a.stage > 0) grad_sent[(r + p - 1) % p].push_back({a.stage, a.microbatch});
        if (a.stage + 1 < stages) grad_recv[r].push_back({a.stage + 1, a.microbatch});
      }
    }
  }
  for (int l = 0; l < p; ++l) {
    if (act_sent[l] != act_recv[l]) {
      return fmt::format("rank {} sends activations to rank {} in another order than it receives them", l, (l + 1) % p);
    }
    if (grad_sent[l] != grad_recv[l]) {
      return fmt::format("rank {} sends gradients to rank {} in another order than it receives them", (l + 1) % p, l);
    }
  }
  return "";
}

}  // namespace

SimulatedStep simulate(const std::vector<std::vector<Action>>& per_rank, int p, int v, const ActionCosts& costs) {
  const int stages = p * v;
  SimulatedStep out;
  STRATA_CHECK(static_cast<int>(per_rank.size()) == p, "simulate: ", per_rank.size(), " ranks' actions for ", p, " ranks");
  out.stuck = link_mismatch(per_rank, p, v);
  if (!out.stuck.empty()) return out;
  out.busy.assign(p, 0.0);
  out.peak_in_flight.assign(p, 0);
  std::vector<int> held(p, 0);
  std::vector<double> t(p, 0.0);
  std::vector<size_t> pos(p, 0);
  Timeline timeline(stages);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (pos[r] < per_rank[r].size()) {
        const Action& a = per_rank[r][pos[r]];
        const std::optional<double> dep = timeline.ready(a);
        if (!dep) break;
        const double cost = a.kind == ActionKind::kForward          ? costs.forward
                            : a.kind == ActionKind::kBackward       ? costs.backward_input + costs.backward_weight
                            : a.kind == ActionKind::kBackwardInput  ? costs.backward_input
                                                                    : costs.backward_weight;
        const double start = std::max(t[r], *dep);
        t[r] = start + cost;
        out.busy[r] += cost;
        timeline.finish(a, t[r]);
        if (a.kind == ActionKind::kForward) held[r] += 1;
        if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) held[r] -= 1;
        out.peak_in_flight[r] = std::max(out.peak_in_flight[r], held[r]);
        pos[r] += 1;
        progress = true;
      }
    }
  }
  out.completes = true;
  out.busy.resize(p);
  for (int r = 0; r < p; ++r) {
    if (pos[r] < per_rank[r].size()) {
      out.completes = false;
      out.stuck += fmt::format("{}rank {} waits at {}", out.stuck.empty() ? "" : ", ", r, to_string(per_rank[r][pos[r]]));
    }
    out.time = std::max(out.time, t[r]);
  }
  return out;
}

double bubble_formula(Schedule s, int p, int v, int m, const ActionCosts& c) {
  const double pm1 = p - 1;
  switch (s) {
    case Schedule::kGPipe:
    case Schedule::k1F1B: return pm1 / (m + pm1);
    case Schedule::kInterleaved1F1B: return pm1 / (static_cast<double>(v) * m + pm1);
    case Schedule::kZeroBubbleH1: {
      const double idle = pm1 * std::max(0.0, c.forward + c.backward_input - c.backward_weight);
      return idle / (m * (c.forward + c.backward_input + c.backward_weight) + idle);
    }
  }
  return 0.0;
}

std::vector<int> partition_balanced(const std::vector<double>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  STRATA_CHECK(parts >= 1, "cannot cut layers into ", parts, " stages");
  STRATA_CHECK(n >= parts, "the model has ", n, " layers, fewer than the ", parts,
               " stages it should be cut into: use fewer stages (or virtual stages), or split the layers finer");
  for (double c : costs) STRATA_CHECK(c >= 0.0, "layer costs must be non-negative");
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  // best[k][i]: the least largest piece cutting the first i layers into k pieces.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0.0;
  for (int k = 1; k <= parts; ++k) {
    for (int i = k; i <= n - (parts - k); ++i) {
      for (int j = k - 1; j < i; ++j) {
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {  // strict: the earliest cut among equals, deterministic on every rank
          best[k][i] = v;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int> bounds(parts + 1, n);
  for (int k = parts, i = n; k > 0; --k) {
    bounds[k] = i;
    i = cut[k][i];
    bounds[k - 1] = i;
  }
  bounds[0] = 0;
  return bounds;
}

namespace {

// The first dot-separated part of `name` that is a number: its layer.
int layer_of(const std::string& name) {
  size_t begin = 0;
  while (begin <= name.size()) {
    const size_t end = std::min(name.find('.', begin), name.size());
    const std::string part = name.substr(begin, end - begin);
    if (!part.empty() && part.find_first_not_of("0123456789") == std::string::npos && part.size() < 9) {
      return std::stoi(part);
    }
    begin = end + 1;
  }
  return -1;
}

}  // namespace

LayerCosts trace_layer_costs(const std::string& trace_path, int layers) {
  const memory::Trace t = memory::read_trace(trace_path);
  STRATA_CHECK(!t.params.empty(), "the trace ", trace_path,
               " names no parameters; record it again with this build (EngineOptions::trace_path)");
  STRATA_CHECK(!t.steps.empty(), "the trace ", trace_path, " holds no step");
  std::vector<int> layer(t.params.size(), -1);
  bool any = false;
  for (size_t i = 0; i < t.params.size(); ++i) {
    layer[i] = layer_of(t.params[i]);
    STRATA_CHECK(layer[i] < layers, "the trace's parameter ", t.params[i], " belongs to layer ", layer[i],
                 " but the model has ", layers, " layers: was the trace recorded of this model?");
    any = any || layer[i] >= 0;
  }
  STRATA_CHECK(any, "no parameter of the trace ", trace_path, " is named by its layer index (\"3.weight\"): record a "
               "trace of the torch::nn::Sequential itself, or of its pipeline stages");
  LayerCosts out;
  out.seconds.assign(layers, 0.0);
  out.activation_bytes.assign(layers, 0.0);
  const memory::TraceStep& step = t.steps.back();
  int current = 0;
  double last_bytes = -1.0;
  for (int64_t i = step.first_op; i < step.end_op; ++i) {
    const memory::TraceOp& op = t.ops[static_cast<size_t>(i)];
    if (op.phase == "optimizer") continue;
    for (int64_t id : op.params) {
      const int l = id >= 0 && id < static_cast<int64_t>(layer.size()) ? layer[static_cast<size_t>(id)] : -1;
      if (l >= 0) {
        current = l;
        break;
      }
    }
    out.seconds[current] += op.seconds;
    const double bytes = static_cast<double>(op.non_model_bytes);
    if (op.phase == "forward" && last_bytes >= 0) out.activation_bytes[current] += bytes - last_bytes;
    last_bytes = bytes;
  }
  for (double& b : out.activation_bytes) b = std::max(0.0, b);
  return out;
}

std::vector<double> mixed_costs(const LayerCosts& c, double memory_weight) {
  STRATA_CHECK(memory_weight >= 0.0 && memory_weight <= 1.0, "the memory weight must be within 0 and 1, not ",
               memory_weight);
  double ts = 0, bs = 0;
  for (double v : c.seconds) ts += v;
  for (double v : c.activation_bytes) bs += v;
  std::vector<double> out(c.seconds.size(), 0.0);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = (1.0 - memory_weight) * (ts > 0 ? c.seconds[i] / ts : 0.0) +
             memory_weight * (bs > 0 ? c.activation_bytes[i] / bs : 0.0);
  }
  return out;
}

}  // namespace strata::parallel::pipeline
