#include "strata/memory/trace.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "strata/core/bytes.h"
#include "strata/core/error.h"

namespace strata::memory {

using nlohmann::json;

namespace {

json tiers_json(const std::array<uint64_t, kNumTiers>& a) {
  return {{"device", a[0]}, {"host", a[1]}, {"nvme", a[2]}};
}
std::array<uint64_t, kNumTiers> tiers_from(const json& j) {
  return {j.at("device").get<uint64_t>(), j.at("host").get<uint64_t>(), j.at("nvme").get<uint64_t>()};
}

}  // namespace

std::string trace_to_json(const Trace& t) {
  json chunks = json::array();
  for (const TraceChunk& c : t.chunks) {
    chunks.push_back({{"id", c.id}, {"family", c.family}, {"role", c.role}, {"dtype", c.dtype}, {"bytes", c.bytes},
                      {"capacity_elems", c.capacity_elems}, {"used_elems", c.used_elems}});
  }
  json steps = json::array();
  for (const TraceStep& s : t.steps) {
    steps.push_back({{"index", s.index}, {"first_op", s.first_op}, {"end_op", s.end_op}, {"seconds", s.seconds}});
  }
  json ops = json::array();
  for (const TraceOp& o : t.ops) {
    json touches = json::array();
    for (const TraceTouch& c : o.chunks) touches.push_back({{"chunk", c.chunk}, {"tier", c.tier}});
    json moves = json::array();
    for (const TraceMove& m : o.moves) {
      moves.push_back({{"from", m.from}, {"to", m.to}, {"bytes", m.bytes}, {"count", m.count}});
    }
    ops.push_back({{"index", o.index}, {"step", o.step}, {"name", o.name}, {"phase", o.phase}, {"start", o.start},
                   {"seconds", o.seconds}, {"chunks", touches}, {"model_bytes", tiers_json(o.model_bytes)},
                   {"non_model_bytes", o.non_model_bytes}, {"non_model_peak", o.non_model_peak}, {"moves", moves},
                   {"stall_seconds", o.stall_seconds}});
  }
  json j = {{"format", "strata-trace"}, {"version", t.version}, {"device", t.device},
            {"non_model_source", t.non_model_source}, {"budgets", tiers_json(t.budgets)},
            {"chunks", chunks}, {"steps", steps}, {"ops", ops}};
  return j.dump(1);
}

Trace trace_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    STRATA_FAIL("not a JSON document (", e.what(), "); was the trace cut short?");
  }
  STRATA_CHECK(j.is_object() && j.value("format", "") == "strata-trace",
               "not a strata trace: the \"format\" field is not \"strata-trace\"");
  const int version = j.value("version", -1);
  STRATA_CHECK(version == kTraceVersion, "trace version ", version, " is not the version this strata reads (",
               kTraceVersion, "); record it again with this build");
  Trace t;
  try {
    t.version = version;
    t.device = j.at("device").get<std::string>();
    t.non_model_source = j.at("non_model_source").get<std::string>();
    t.budgets = tiers_from(j.at("budgets"));
    for (const json& c : j.at("chunks")) {
      t.chunks.push_back({c.at("id").get<int64_t>(), c.at("family").get<int32_t>(), c.at("role").get<std::string>(),
                          c.at("dtype").get<std::string>(), c.at("bytes").get<uint64_t>(),
                          c.at("capacity_elems").get<int64_t>(), c.at("used_elems").get<int64_t>()});
    }
    for (const json& s : j.at("steps")) {
      t.steps.push_back({s.at("index").get<int>(), s.at("first_op").get<int64_t>(), s.at("end_op").get<int64_t>(),
                         s.at("seconds").get<double>()});
    }
    for (const json& o : j.at("ops")) {
      TraceOp op;
      op.index = o.at("index").get<int64_t>();
      op.step = o.at("step").get<int>();
      op.name = o.at("name").get<std::string>();
      op.phase = o.at("phase").get<std::string>();
      op.start = o.at("start").get<double>();
      op.seconds = o.at("seconds").get<double>();
      for (const json& c : o.at("chunks")) op.chunks.push_back({c.at("chunk").get<int64_t>(), c.at("tier").get<std::string>()});
      op.model_bytes = tiers_from(o.at("model_bytes"));
      op.non_model_bytes = o.at("non_model_bytes").get<uint64_t>();
      op.non_model_peak = o.at("non_model_peak").get<uint64_t>();
      for (const json& m : o.at("moves")) {
        op.moves.push_back({m.at("from").get<std::string>(), m.at("to").get<std::string>(), m.at("bytes").get<uint64_t>(),
                            m.at("count").get<uint64_t>()});
      }
      op.stall_seconds = o.at("stall_seconds").get<double>();
      t.ops.push_back(std::move(op));
    }
  } catch (const json::exception& e) {
    STRATA_FAIL("malformed strata trace: ", e.what());
  }
  return t;
}

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
  std::map<std::pair<std::string, std::string>, std::pair<uint64_t, uint64_t>> moved;
  double stalls = 0.0;
  for (const TraceOp& o : t.ops) {
    for (const TraceMove& m : o.moves) {
      auto& e = moved[{m.from, m.to}];
      e.first += m.bytes;
      e.second += m.count;
    }
    stalls += o.stall_seconds;
  }
  line("");
  line(fmt::format("{:<16} {:>14} {:>8}", "moved", "bytes", "chunks"));
  if (moved.empty()) line("  (no chunk moved)");
  for (const auto& [pair, e] : moved) {
    line(fmt::format("{:<16} {:>14} {:>8}", pair.first + " -> " + pair.second, format_bytes(e.first), e.second));
  }
  line(fmt::format("stalls: {:.2f} ms, {:.1f}% of step time", stalls * 1e3,
                   step_seconds > 0 ? 100.0 * stalls / step_seconds : 0.0));

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

void write_trace(const Trace& trace, const std::string& path) {
  const std::string text = trace_to_json(trace);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  STRATA_CHECK(f != nullptr, "cannot write the trace to ", tmp, ": ", std::strerror(errno));
  const size_t wrote = std::fwrite(text.data(), 1, text.size(), f);
  const int werr = errno;
  const bool ok = wrote == text.size() && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  std::fclose(f);
  if (!ok) {
    std::remove(tmp.c_str());
    STRATA_FAIL("cannot write the trace to ", tmp, ": ", std::strerror(werr ? werr : errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    STRATA_FAIL("cannot move the trace to ", path, ": ", std::strerror(err));
  }
}

Trace read_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  STRATA_CHECK(in.good(), "cannot read the trace ", path, ": ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return trace_from_json(ss.str());
  } catch (const Error& e) {
    STRATA_FAIL(path, ": ", e.what());
  }
}

}  // namespace strata::memory
