// The views of a memory trace that `strata trace` prints and writes: the text
// report, per-layer activations and the checkpointing prediction, the Chrome
// trace export and the SVG plot. The trace's data model and its JSON are
// strata/memory/trace.h; these are presentation, and live with the tool.
#include "trace_views.h"

#include <fnmatch.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "strata/core/bytes.h"
#include "strata/core/error.h"

namespace strata::tools {

using memory::Trace;
using memory::TraceOp;
using memory::TraceStep;
using memory::TraceChunk;
using memory::TraceMove;
using memory::TraceTouch;
using memory::SimulateOptions;
using memory::SimulateResult;
using memory::simulate_trace;
using memory::kNumTiers;
using memory::tier_name;
using memory::Tier;
using nlohmann::json;

namespace {
json tiers_json(const std::array<uint64_t, kNumTiers>& a) {
  return {{"device", a[0]}, {"host", a[1]}, {"nvme", a[2]}};
}
}  // namespace

std::string format_trace_report(const Trace& t, size_t top) {
  std::string out;
  auto line = [&](const std::string& s) { out += s + "\n"; };
  double step_seconds = 0.0;
  for (const TraceStep& s : t.steps) step_seconds += s.seconds;
  line(fmt::format("strata trace (version {}): {} steps, {} operators, device tier {}", t.version, t.steps.size(),
                   t.ops.size(), t.device));
  if (!t.steps.empty()) {
    std::string per;
    for (const TraceStep& s : t.steps) per += fmt::format("{}{:.1f}", per.empty() ? "" : ", ", s.seconds * 1e3);
    line(fmt::format("step time: {:.1f} ms mean ({} ms)", step_seconds * 1e3 / t.steps.size(), per));
  }

  // Peaks. Non-model memory (activations, workspace) lives where operators run: the device tier.
  std::array<uint64_t, kNumTiers> model_peak{};
  uint64_t non_model_peak = 0;
  const TraceOp* non_model_at = nullptr;
  for (const TraceOp& o : t.ops) {
    for (int k = 0; k < kNumTiers; ++k) model_peak[k] = std::max(model_peak[k], o.model_bytes[k]);
    if (o.non_model_peak > non_model_peak || non_model_at == nullptr) {
      non_model_peak = o.non_model_peak;
      non_model_at = &o;
    }
  }
  line("");
  line(fmt::format("{:<8} {:>14} {:>14} {:>14}", "peak", "model", "non-model", "budget"));
  for (int k = 0; k < kNumTiers; ++k) {
    line(fmt::format("{:<8} {:>14} {:>14} {:>14}", tier_name(static_cast<Tier>(k)), format_bytes(model_peak[k]),
                     k == 0 ? format_bytes(non_model_peak) : "-", format_bytes(t.budgets[k])));
  }
  if (non_model_at != nullptr) {
    line(fmt::format("non-model peak at operator #{} {} ({}); measured by {}", non_model_at->index, non_model_at->name,
                     non_model_at->phase, t.non_model_source));
  }

  // Moves and stalls.
  struct Moved {
    uint64_t bytes = 0, count = 0, demand = 0;
  };
  std::map<std::pair<std::string, std::string>, Moved> moved;
  double stalls = 0.0;
  uint64_t stall_bytes = 0;
  for (const TraceOp& o : t.ops) {
    for (const TraceMove& m : o.moves) {
      Moved& e = moved[{m.from, m.to}];
      e.bytes += m.bytes;
      e.count += m.count;
      e.demand += m.demand_bytes;
    }
    stalls += o.stall_seconds;
    stall_bytes += o.stall_bytes;
  }
  line("");
  line(fmt::format("{:<16} {:>14} {:>8} {:>14}", "moved", "bytes", "chunks", "on demand"));
  if (moved.empty()) line("  (no chunk moved)");
  for (const auto& [pair, e] : moved) {
    line(fmt::format("{:<16} {:>14} {:>8} {:>14}", pair.first + " -> " + pair.second, format_bytes(e.bytes), e.count,
                     format_bytes(e.demand)));
  }
  line(fmt::format("waits for moves in flight: {:.2f} ms ({}), {:.1f}% of step time; on-demand moves are waited "
                   "for too",
                   stalls * 1e3, format_bytes(stall_bytes), step_seconds > 0 ? 100.0 * stalls / step_seconds : 0.0));

  // The device policies replayed at the traced budgets (Note [Replaying a trace]).
  if (t.budgets[0] > 0 && !t.ops.empty()) {
    SimulateOptions so;
    so.device_budget = t.budgets[0];
    so.prefetch = t.prefetch;
    std::string row;
    bool fits = true;
    for (const char* policy : {"lru", "static", "auto"}) {
      so.policy = policy;
      const SimulateResult r = simulate_trace(t, so);
      fits = fits && r.fits;
      row += fmt::format("{}{} under {}", row.empty() ? "" : ", ", format_bytes(r.h2d_bytes), policy);
    }
    if (fits) line(fmt::format("replayed at this device budget, host -> device: {}", row));
  }

  // Top operators by non-model memory.
  std::vector<const TraceOp*> by_mem;
  for (const TraceOp& o : t.ops) by_mem.push_back(&o);
  std::stable_sort(by_mem.begin(), by_mem.end(),
                   [](const TraceOp* a, const TraceOp* b) { return a->non_model_peak > b->non_model_peak; });
  line("");
  line(fmt::format("top {} operators by non-model memory:", std::min(top, by_mem.size())));
  for (size_t i = 0; i < std::min(top, by_mem.size()); ++i) {
    const TraceOp& o = *by_mem[i];
    line(fmt::format("  #{:<6} {:<36} {:<9} peak {:>12}  after {:>12}  {} chunks", o.index, o.name, o.phase,
                     format_bytes(o.non_model_peak), format_bytes(o.non_model_bytes), o.chunks.size()));
  }

  // Activations per layer: what checkpointing or offloading each would free.
  const std::vector<LayerActivations> layers = layer_activations(t);
  if (!layers.empty()) {
    uint64_t kept = 0;
    for (const LayerActivations& l : layers) kept += l.kept_bytes;
    line("");
    line(fmt::format("activations kept for backward per layer (last traced step's forward, {} in all; "
                     "checkpoint or offload the largest):", format_bytes(kept)));
    for (const LayerActivations& l : layers) {
      line(fmt::format("  {:<28} {:>12} {:>5.1f}%  forward {:>9.2f} ms  {} ops", l.layer, format_bytes(l.kept_bytes),
                       kept ? 100.0 * l.kept_bytes / kept : 0.0, l.forward_seconds * 1e3, l.ops));
    }
  }

  // Chunk utilisation.
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_role;  // role -> (used bytes, allocated bytes)
  uint64_t used = 0, alloc = 0;
  for (const TraceChunk& c : t.chunks) {
    const uint64_t u =
        std::min<uint64_t>(static_cast<uint64_t>(c.used_elems) * dtype_size(parse_dtype(c.dtype)), c.bytes);
    used += u;
    alloc += c.bytes;
    by_role[c.role].first += u;
    by_role[c.role].second += c.bytes;
  }
  line("");
  line(fmt::format("chunks: {} chunks, {} allocated, {:.1f}% used by tensors, {} padding", t.chunks.size(),
                   format_bytes(alloc), alloc ? 100.0 * used / alloc : 0.0, format_bytes(alloc - used)));
  for (const auto& [role, e] : by_role) {
    line(fmt::format("  {:<7} {:>12} of {:>12} used", role, format_bytes(e.first), format_bytes(e.second)));
  }
  return out;
}

namespace {

std::string layer_of(const std::string& param, int depth) {
  size_t cut = std::string::npos, at = 0;
  for (int k = 0; k < depth; ++k) {
    const size_t dot = param.find('.', at);
    if (dot == std::string::npos) break;
    cut = dot;
    at = dot + 1;
  }
  return cut == std::string::npos ? param : param.substr(0, cut);
}

// The ops of the last traced step: the steady state (the first carries
// one-time costs: planning, first touches of memory).
std::pair<int64_t, int64_t> last_step(const Trace& t) {
  if (t.steps.empty()) return {0, static_cast<int64_t>(t.ops.size())};
  const TraceStep& s = t.steps.back();
  return {s.first_op, std::min<int64_t>(s.end_op, static_cast<int64_t>(t.ops.size()))};
}

}  // namespace

std::vector<LayerActivations> layer_activations(const Trace& t, int depth) {
  STRATA_CHECK(depth >= 1, "the layer depth must be at least 1, got ", depth);
  std::vector<LayerActivations> layers;
  std::map<std::string, size_t> index;
  const auto [begin, end] = last_step(t);
  std::string current;
  uint64_t run_start = 0, last = 0;  // non-model bytes when the current run began, and after the last op
  bool started = false;
  const auto close_run = [&] {
    if (current.empty()) return;
    layers[index.at(current)].kept_bytes += last > run_start ? last - run_start : 0;
  };
  for (int64_t i = begin; i < end; ++i) {
    const TraceOp& o = t.ops[static_cast<size_t>(i)];
    if (o.phase != "forward") continue;
    std::string layer = current;
    if (!o.params.empty() && o.params[0] >= 0 && static_cast<size_t>(o.params[0]) < t.params.size()) {
      layer = layer_of(t.params[static_cast<size_t>(o.params[0])], depth);
    }
    if (!started) last = o.non_model_bytes;  // the first operator's own output is not known apart
    started = true;
    if (layer != current) {
      close_run();
      current = layer;
      run_start = last;
      if (!current.empty() && index.emplace(current, layers.size()).second) layers.push_back({current, 0, 0.0, 0});
    }
    last = o.non_model_bytes;
    if (!current.empty()) {
      layers[index.at(current)].forward_seconds += std::max(0.0, o.seconds - o.stall_seconds);
      ++layers[index.at(current)].ops;
    }
  }
  close_run();
  return layers;
}

CheckpointPrediction predict_checkpointing(const Trace& t, const std::vector<std::string>& patterns, int depth) {
  CheckpointPrediction p;
  const std::vector<LayerActivations> layers = layer_activations(t, depth);
  STRATA_CHECK(!layers.empty(), "the trace names no parameters, so it has no layers; record it with a strata "
               "version that writes parameter names (trace version 2)");
  uint64_t largest = 0;
  std::vector<std::string> unmatched;
  for (const std::string& pattern : patterns) {
    bool any = false;
    for (const LayerActivations& l : layers) {
      const bool match = fnmatch(pattern.c_str(), l.layer.c_str(), 0) == 0;  // '*' spans dots too
      if (!match) continue;
      any = true;
      if (std::find(p.layers.begin(), p.layers.end(), l.layer) != p.layers.end()) continue;
      p.layers.push_back(l.layer);
      p.freed_bytes += l.kept_bytes;
      p.recompute_seconds += l.forward_seconds;
      largest = std::max(largest, l.kept_bytes);
    }
    if (!any) unmatched.push_back(pattern);
  }
  if (!unmatched.empty()) {
    std::string names;
    for (size_t i = 0; i < std::min<size_t>(layers.size(), 6); ++i) names += (i ? ", " : "") + layers[i].layer;
    STRATA_FAIL("no layer matches ", unmatched.front(), "; the trace's layers at depth ", depth, " are ", names,
                layers.size() > 6 ? ", ..." : "", " (glob patterns: blocks.* or *.block)");
  }
  const auto [begin, end] = last_step(t);
  for (int64_t i = begin; i < end; ++i) {
    const TraceOp& o = t.ops[static_cast<size_t>(i)];
    if (o.phase != "optimizer") p.peak_before = std::max(p.peak_before, o.non_model_peak);
  }
  if (!t.steps.empty()) p.step_seconds = t.steps.back().seconds;
  const uint64_t freed = p.freed_bytes - largest;
  p.peak_after = p.peak_before > freed ? p.peak_before - freed : 0;
  return p;
}

std::string export_chrome_trace(const Trace& t) {
  json events = json::array();
  auto thread = [&](int tid, const std::string& name) {
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 1}, {"tid", tid}, {"args", {{"name", name}}}});
  };
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 1}, {"args", {{"name", "strata " + t.device}}}});
  thread(1, "steps");
  thread(2, "operators");
  thread(3, "chunk moves");
  auto us = [](double s) { return s * 1e6; };
  for (const TraceStep& s : t.steps) {
    const double start = s.first_op < static_cast<int64_t>(t.ops.size()) ? t.ops[s.first_op].start : 0.0;
    events.push_back({{"ph", "X"}, {"name", fmt::format("step {}", s.index)}, {"cat", "step"}, {"pid", 1}, {"tid", 1},
                      {"ts", us(start)}, {"dur", us(s.seconds)}});
  }
  for (const TraceOp& o : t.ops) {
    json chunks = json::array();
    for (const TraceTouch& c : o.chunks) chunks.push_back(fmt::format("{}@{}", c.chunk, c.tier));
    events.push_back({{"ph", "X"}, {"name", o.name}, {"cat", o.phase}, {"pid", 1}, {"tid", 2}, {"ts", us(o.start)},
                      {"dur", us(o.seconds)},
                      {"args", {{"index", o.index}, {"chunks", chunks}, {"non_model_peak", o.non_model_peak},
                                {"stall_seconds", o.stall_seconds}}}});
    for (const TraceMove& m : o.moves) {
      events.push_back({{"ph", "X"}, {"name", m.from + " -> " + m.to}, {"cat", "move"}, {"pid", 1}, {"tid", 3},
                        {"ts", us(o.start)}, {"dur", us(o.seconds)}, {"args", {{"bytes", m.bytes}, {"chunks", m.count}}}});
    }
    const double end = us(o.start + o.seconds);
    events.push_back({{"ph", "C"}, {"name", "model bytes"}, {"pid", 1}, {"ts", end}, {"args", tiers_json(o.model_bytes)}});
    events.push_back({{"ph", "C"}, {"name", "non-model bytes"}, {"pid", 1}, {"ts", end},
                      {"args", {{"live", o.non_model_bytes}, {"peak", o.non_model_peak}}}});
  }
  return json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

std::string xml_escape(const std::string& in) {
  std::string out;
  for (char c : in) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string plot_trace_svg(const Trace& t) {
  const double width = 1000, panel_h = 180, top = 58, left = 90, right = 20, gap = 40;
  const double plot_w = width - left - right;
  const double height = top + kNumTiers * (panel_h + gap) + 20;
  const size_t n = std::max<size_t>(t.ops.size(), 1);
  auto x_of = [&](size_t i) { return left + plot_w * static_cast<double>(i) / static_cast<double>(n); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{:.0f}\" y=\"22\" font-size=\"15\">strata memory trace: {} steps, {} operators, device tier {}</text>\n",
      width, height, width, height, left, t.steps.size(), t.ops.size(), xml_escape(t.device));
  for (int k = 0; k < kNumTiers; ++k) {
    const double y0 = top + k * (panel_h + gap);
    const double base = y0 + panel_h;
    uint64_t ymax = t.budgets[k];
    for (const TraceOp& o : t.ops) {
      ymax = std::max(ymax, o.model_bytes[k] + (k == 0 ? o.non_model_peak : 0));
    }
    ymax = std::max<uint64_t>(ymax, 1);
    auto y_of = [&](uint64_t b) { return base - panel_h * static_cast<double>(b) / static_cast<double>(ymax) * 0.95; };
    const std::string tier = tier_name(static_cast<Tier>(k));
    svg += fmt::format("<g class=\"panel\" id=\"{}\">\n", tier);
    svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
                       "stroke=\"#999\"/>\n",
                       left, y0, plot_w, panel_h);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"13\">{} tier</text>\n", left, y0 - 6, tier);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", left - 6,
                       y_of(ymax) + 4, format_bytes(ymax));
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">0</text>\n", left - 6, base);
    // Step boundaries.
    for (const TraceStep& s : t.steps) {
      const double x = x_of(static_cast<size_t>(s.first_op));
      svg += fmt::format("<line class=\"step\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" "
                         "stroke=\"#ccc\"/>\n",
                         x, y0, x, base);
    }
    // Operators during which chunks left or arrived on this tier.
    for (size_t i = 0; i < t.ops.size(); ++i) {
      bool moved = false;
      for (const TraceMove& m : t.ops[i].moves) moved = moved || m.from == tier || m.to == tier;
      if (moved) {
        svg += fmt::format("<line class=\"move\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" "
                           "stroke=\"#e8a33d\" stroke-width=\"1\"/>\n",
                           x_of(i), base, x_of(i), base + 6);
      }
    }
    auto series = [&](const char* cls, const char* color, auto value) {
      std::string pts;
      for (size_t i = 0; i < t.ops.size(); ++i) {
        pts += fmt::format("{:.1f},{:.1f} {:.1f},{:.1f} ", x_of(i), y_of(value(t.ops[i])), x_of(i + 1),
                           y_of(value(t.ops[i])));
      }
      svg += fmt::format("<polyline class=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                         cls, color, pts);
    };
    if (k == 0) {
      series("non-model", "#c44e52", [&](const TraceOp& o) { return o.model_bytes[0] + o.non_model_peak; });
    }
    series("model", "#4c72b0", [&](const TraceOp& o) { return o.model_bytes[k]; });
    if (t.budgets[k] > 0) {
      svg += fmt::format("<line class=\"budget\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" "
                         "stroke=\"#222\" stroke-dasharray=\"6,4\"/>\n"
                         "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">budget {}</text>\n",
                         left, y_of(t.budgets[k]), left + plot_w, y_of(t.budgets[k]), left + plot_w - 4,
                         y_of(t.budgets[k]) - 4, format_bytes(t.budgets[k]));
    }
    svg += "</g>\n";
  }
  const double ly = height - 8;
  svg += fmt::format(
      "<g class=\"legend\"><line x1=\"{0:.0f}\" y1=\"{1:.0f}\" x2=\"{2:.0f}\" y2=\"{1:.0f}\" stroke=\"#4c72b0\" "
      "stroke-width=\"2\"/><text x=\"{3:.0f}\" y=\"{4:.0f}\">model bytes</text>"
      "<line x1=\"{5:.0f}\" y1=\"{1:.0f}\" x2=\"{6:.0f}\" y2=\"{1:.0f}\" stroke=\"#c44e52\" stroke-width=\"2\"/>"
      "<text x=\"{7:.0f}\" y=\"{4:.0f}\">model + non-model (device)</text>"
      "<line x1=\"{8:.0f}\" y1=\"{1:.0f}\" x2=\"{9:.0f}\" y2=\"{1:.0f}\" stroke=\"#e8a33d\" stroke-width=\"2\"/>"
      "<text x=\"{10:.0f}\" y=\"{4:.0f}\">chunk moves</text>"
      "<text x=\"{11:.0f}\" y=\"{4:.0f}\">x: operator index; grey lines: steps; dashed: budget</text></g>\n",
      left, ly - 4, left + 20, left + 25, ly, left + 120, left + 140, left + 145, left + 320, left + 340, left + 345,
      left + 450);
  svg += "</svg>\n";
  return svg;
}

}  // namespace strata::tools
