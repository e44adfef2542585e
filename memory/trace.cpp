#include "strata/memory/trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

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
      moves.push_back(
          {{"from", m.from}, {"to", m.to}, {"bytes", m.bytes}, {"count", m.count}, {"demand_bytes", m.demand_bytes}});
    }
    json started = json::array();
    for (const TraceMove& m : o.started) {
      started.push_back({{"from", m.from}, {"to", m.to}, {"bytes", m.bytes}, {"count", m.count}});
    }
    ops.push_back({{"index", o.index}, {"step", o.step}, {"name", o.name}, {"phase", o.phase}, {"start", o.start},
                   {"seconds", o.seconds}, {"chunks", touches}, {"model_bytes", tiers_json(o.model_bytes)},
                   {"non_model_bytes", o.non_model_bytes}, {"non_model_peak", o.non_model_peak}, {"moves", moves},
                   {"started", started}, {"stall_seconds", o.stall_seconds}, {"stall_bytes", o.stall_bytes}});
    if (!o.params.empty()) ops.back()["params"] = o.params;
  }
  json j = {{"format", "strata-trace"}, {"version", t.version}, {"device", t.device},
            {"non_model_source", t.non_model_source}, {"policy", t.policy}, {"prefetch", t.prefetch},
            {"nvme_optim_fraction", t.nvme_optim_fraction},
            {"budgets", tiers_json(t.budgets)},
            {"chunks", chunks}, {"steps", steps}, {"ops", ops}};
  if (!t.params.empty()) j["params"] = t.params;
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
    t.policy = j.at("policy").get<std::string>();
    t.prefetch = j.at("prefetch").get<bool>();
    t.nvme_optim_fraction = j.at("nvme_optim_fraction").get<double>();
    t.budgets = tiers_from(j.at("budgets"));
    for (const json& c : j.at("chunks")) {
      t.chunks.push_back({c.at("id").get<int64_t>(), c.at("family").get<int32_t>(), c.at("role").get<std::string>(),
                          c.at("dtype").get<std::string>(), c.at("bytes").get<uint64_t>(),
                          c.at("capacity_elems").get<int64_t>(), c.at("used_elems").get<int64_t>()});
    }
    if (j.contains("params")) t.params = j.at("params").get<std::vector<std::string>>();
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
                            m.at("count").get<uint64_t>(), m.at("demand_bytes").get<uint64_t>()});
      }
      for (const json& m : o.at("started")) {
        op.started.push_back({m.at("from").get<std::string>(), m.at("to").get<std::string>(),
                              m.at("bytes").get<uint64_t>(), m.at("count").get<uint64_t>(), 0});
      }
      op.stall_seconds = o.at("stall_seconds").get<double>();
      op.stall_bytes = o.at("stall_bytes").get<uint64_t>();
      if (o.contains("params")) op.params = o.at("params").get<std::vector<int64_t>>();
      t.ops.push_back(std::move(op));
    }
  } catch (const json::exception& e) {
    STRATA_FAIL("malformed strata trace: ", e.what());
  }
  return t;
}

void write_trace(const Trace& trace, const std::string& path) { write_text_file(trace_to_json(trace), path); }

void write_text_file(const std::string& text, const std::string& path) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = STRATA_SYSCALL(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644), "cannot write ",
                                path, " (its temporary file)");
  try {
    for (size_t done = 0; done < text.size();) {
      const ssize_t n = STRATA_SYSCALL(::write(fd, text.data() + done, text.size() - done), "cannot write ", tmp);
      STRATA_CHECK(n > 0, "cannot write ", tmp, ": no progress (disk full?)");
      done += static_cast<size_t>(n);
    }
    STRATA_SYSCALL(::fsync(fd), "cannot write ", tmp);
  } catch (...) {
    ::close(fd);  // already failing: only the first error is reported
    ::unlink(tmp.c_str());
    throw;
  }
  try {
    STRATA_CLOSE(fd, "cannot write ", tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  const int err = STRATA_SYSCALL_ERRNO(::rename(tmp.c_str(), path.c_str()));
  if (err != 0) {
    ::unlink(tmp.c_str());
    STRATA_FAIL_ERRNO(err, "rename", "cannot move ", tmp, " to ", path);
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
