// `strata trace`: record a program's memory trace, and report on one.
//
//   strata trace record [-o strata-trace.json] [--steps 2] -- PROGRAM ARGS...
//   strata trace report TRACE [--top 10]
//   strata trace simulate TRACE --device-budget B [--host-budget H] [--policy lru,auto,static]
//                         [--checkpoint LAYERS [--layer-depth 2]]
//       [--prefetch on|off] [--bandwidth h2d=10,d2h=10,nvme-read=2,nvme-write=1] [--sweep]
//   strata trace plot TRACE -o mem.svg
//   strata trace export TRACE --chrome out.json
//
// record runs PROGRAM with STRATA_TRACE and STRATA_TRACE_STEPS set, which any
// program using the engine honours (attach reads them), and checks the
// trace it wrote. The trace format is docs/trace.md.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <memory>

#include "child_process.h"
#include "commands.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/memory/trace.h"
#include "trace_views.h"

namespace strata::tools {
namespace {

struct RecordOptions {
  std::string out = "strata-trace.json";
  int steps = 2;
  std::vector<std::string> command;
};

void record(const RecordOptions& o) {
  STRATA_CHECK(!o.command.empty(), "give the program to run after --, e.g. strata trace record -- build/examples/gpt");
  STRATA_CHECK(o.steps >= 1, "--steps must be at least 1");
  const std::string out = std::filesystem::absolute(o.out).string();
  // A trace left from an earlier run must not pass for this one; anything
  // else at that path is the user's and stays.
  if (std::filesystem::exists(out)) {
    try {
      memory::read_trace(out);
    } catch (const std::exception&) {
      STRATA_FAIL(out, " exists and is not a strata trace; give -o a new path or a trace to replace");
    }
    std::filesystem::remove(out);
  }
  const pid_t pid = spawn_child(o.command, {{"STRATA_TRACE", out}, {"STRATA_TRACE_STEPS", std::to_string(o.steps)}},
                                nullptr, "strata trace record: ", o.command[0]);
  const int status = wait_child(pid);
  if (exit_code_of(status) != 0) {
    // The program may have failed after the traced steps: say whether a trace was written.
    std::error_code ec;
    const bool written = std::filesystem::exists(out, ec);
    STRATA_FAIL(o.command[0], " ", describe_exit(status),
                written ? fmt::format("; it wrote its trace to {} before that", out) : std::string("; no trace recorded"));
  }
  STRATA_CHECK(std::filesystem::exists(out), o.command[0], " exited without writing a trace to ", out,
               ": does it train through strata::parallel::attach (with no trace path of its own in its options), "
               "and for at least ", o.steps, " steps?");
  const memory::Trace t = memory::read_trace(out);
  fmt::print("strata trace: {} steps, {} operators recorded to {}\n", t.steps.size(), t.ops.size(), out);
}

struct SimOptions {
  std::string trace;
  std::string device_budget;
  std::string host_budget;
  std::vector<std::string> policies = {"lru", "auto", "static"};
  std::vector<std::string> bandwidth;  // h2d=, d2h=, nvme-read=, nvme-write= (GB/s)
  double static_param_fraction = -1.0;
  std::string prefetch = "on";
  bool sweep = false;
  std::vector<std::string> checkpoint;  // layers to predict checkpointing for
  int layer_depth = 2;
};

// --checkpoint: the effect of checkpointing the given layers (Note [Activations per layer]).
void predict_checkpoint(const memory::Trace& t, const SimOptions& o) {
  const CheckpointPrediction p = predict_checkpointing(t, o.checkpoint, o.layer_depth);
  std::string names;
  for (size_t i = 0; i < p.layers.size(); ++i) names += (i ? ", " : "") + p.layers[i];
  fmt::print("checkpointing {} layers ({}): their forwards keep {} fewer activations; non-model peak {} -> {} "
             "(predicted); each step recomputes their forward, at most {:.2f} ms as traced ({:.2f} ms step -> at most "
             "{:.2f} ms)\n",
             p.layers.size(), names, format_bytes(p.freed_bytes), format_bytes(p.peak_before),
             format_bytes(p.peak_after), p.recompute_seconds * 1e3, p.step_seconds * 1e3,
             (p.step_seconds + p.recompute_seconds) * 1e3);
}

void parse_bandwidths(const std::vector<std::string>& specs, memory::SimulateOptions& so) {
  for (const std::string& b : specs) {
    const auto eq = b.find('=');
    STRATA_CHECK(eq != std::string::npos, "--bandwidth takes KEY=GB/s pairs such as h2d=10,nvme-read=2, got \"", b,
                 "\"");
    double v = 0;
    try {
      v = std::stod(b.substr(eq + 1)) * 1e9;
    } catch (const std::exception&) {
      STRATA_FAIL("--bandwidth ", b, ": not a number of GB/s");
    }
    STRATA_CHECK(v > 0, "--bandwidth ", b, ": must be positive");
    const std::string key = b.substr(0, eq);
    if (key == "h2d") {
      so.h2d_bytes_per_s = v;
    } else if (key == "d2h") {
      so.d2h_bytes_per_s = v;
    } else if (key == "nvme-read") {
      so.nvme_read_bytes_per_s = v;
    } else if (key == "nvme-write") {
      so.nvme_write_bytes_per_s = v;
    } else {
      STRATA_FAIL("--bandwidth ", b, ": the keys are h2d, d2h, nvme-read and nvme-write");
    }
  }
}

void simulate(const SimOptions& o) {
  const memory::Trace t = memory::read_trace(o.trace);
  memory::SimulateOptions so;
  parse_bandwidths(o.bandwidth, so);
  STRATA_CHECK(o.prefetch == "on" || o.prefetch == "off", "--prefetch is on or off, got \"", o.prefetch, "\"");
  so.prefetch = o.prefetch == "on";
  so.static_param_fraction = o.static_param_fraction;
  if (!o.host_budget.empty()) so.host_budget = parse_bytes(o.host_budget);
  const auto [widest, all] = memory::trace_device_bounds(t);
  std::vector<uint64_t> budgets;
  if (!o.device_budget.empty()) budgets.push_back(parse_bytes(o.device_budget));
  if (o.sweep) {
    for (int i = 0; i <= 8; ++i) {
      budgets.push_back(round_up(widest + (all - std::min(all, widest)) * i / 8, 4096));
    }
  }
  if (!o.checkpoint.empty()) predict_checkpoint(t, o);
  if (budgets.empty() && !o.checkpoint.empty()) return;
  STRATA_CHECK(!budgets.empty(), "give --device-budget, --sweep, --checkpoint, or several");
  so.device_budget = round_up(std::max(all, widest), 4096);
  so.policy = "lru";
  const memory::SimulateResult everything = memory::simulate_trace(t, so);
  const double resident = everything.step_seconds;
  fmt::print("strata trace simulate: {} ({} steps, traced with policy {}, prefetch {}); host budget {}\n", o.trace,
             t.steps.size(), t.policy, t.prefetch ? "on" : "off", format_bytes(everything.host_budget));
  fmt::print("device bytes an operator needs at once {}, all parameter chunks {}; all resident {:.2f} ms per step\n",
             format_bytes(widest), format_bytes(all), resident * 1e3);
  if (t.budgets[2] > 0) {
    fmt::print("nvme per step: optimizer state of {} families, read {}, written {}, host spill {}\n",
               everything.nvme_optim_families, format_bytes(everything.nvme_read_bytes),
               format_bytes(everything.nvme_write_bytes), format_bytes(everything.host_spill_bytes));
  }
  fmt::print("{:>12} {:>6} {:>12} {:>12} {:>12} {:>9} {:>10} {:>10} {:>10} {:>7}\n", "device", "policy", "h2d", "d2h",
             "prefetched", "evictions", "stall ms", "nvme ms", "step ms", "ratio");
  uint64_t recommended = 0;
  for (uint64_t b : budgets) {
    for (const std::string& policy : o.policies) {
      so.device_budget = b;
      so.policy = policy;
      const memory::SimulateResult r = memory::simulate_trace(t, so);
      if (!r.fits) {
        fmt::print("{:>12} {:>6} does not fit: {}\n", format_bytes(b), policy, r.why);
        continue;
      }
      fmt::print("{:>12} {:>6} {:>12} {:>12} {:>12} {:>9} {:>10.2f} {:>10.2f} {:>10.2f} {:>6.2f}x\n", format_bytes(b),
                 policy, format_bytes(r.h2d_bytes), format_bytes(r.d2h_bytes), format_bytes(r.prefetched_bytes),
                 r.evictions, r.device_stall_seconds * 1e3, r.nvme_stall_seconds * 1e3, r.step_seconds * 1e3,
                 r.step_seconds / resident);
      if (o.sweep && r.step_seconds <= 1.1 * resident && (recommended == 0 || b < recommended)) recommended = b;
    }
  }
  if (o.sweep) {
    if (recommended > 0) {
      fmt::print("recommended device budget: {} (predicted step within 10% of all resident)\n",
                 format_bytes(recommended));
    } else {
      fmt::print("no swept budget is predicted within 10% of all resident\n");
    }
  }
}

}  // namespace

void add_trace_command(CLI::App& app) {
  auto* trace = app.add_subcommand("trace", "Record a memory trace of a training program and report on it");
  trace->require_subcommand(1);

  auto* rec = trace->add_subcommand("record", "Run PROGRAM ARGS... with tracing on");
  auto ro = std::make_shared<RecordOptions>();
  rec->add_option("-o,--out", ro->out, "where the trace goes");
  rec->add_option("--steps", ro->steps, "training steps to trace (the warm-up)");
  rec->add_option("command", ro->command, "the program and its arguments, after --")->required();
  rec->callback([ro] { record(*ro); });

  auto* rep = trace->add_subcommand("report", "Summarise a trace: peaks, moves, stalls, top operators, chunk use");
  auto path = std::make_shared<std::string>();
  auto top = std::make_shared<size_t>(10);
  rep->add_option("trace", *path, "a trace written by strata trace record or STRATA_TRACE")->required();
  rep->add_option("--top", *top, "operators to list by non-model memory");
  rep->callback([path, top] { fmt::print("{}", format_trace_report(memory::read_trace(*path), *top)); });

  auto* sim = trace->add_subcommand("simulate", "Predict device traffic and step time under other budgets and policies");
  auto so = std::make_shared<SimOptions>();
  sim->add_option("trace", so->trace, "a trace")->required();
  sim->add_option("--device-budget", so->device_budget, "device budget to predict, e.g. 8MiB");
  sim->add_option("--host-budget", so->host_budget, "host budget to predict (default: the trace's)");
  sim->add_option("--policy", so->policies, "lru, auto, static, or a list (default all three)")->delimiter(',');
  sim->add_option("--static-param-fraction", so->static_param_fraction,
                  "static: fraction of parameter chunk bytes held on the device (default: as many as fit)");
  sim->add_option("--prefetch", so->prefetch, "on or off (default on)");
  sim->add_option("--bandwidth", so->bandwidth,
                  "h2d=,d2h=,nvme-read=,nvme-write= in GB/s (defaults 10, 10, 2, 1)")->delimiter(',');
  sim->add_flag("--sweep", so->sweep, "try budgets from the widest operator to everything resident; recommend one");
  sim->add_option("--checkpoint", so->checkpoint,
                  "layers to predict activation checkpointing for, as strata trace report lists them "
                  "(glob patterns: blocks.*, *.block)")->delimiter(',');
  sim->add_option("--layer-depth", so->layer_depth, "components of a parameter name that make its layer (default 2)");
  sim->callback([so] { simulate(*so); });

  auto* plot = trace->add_subcommand("plot", "Draw memory per tier over the operators as a self-contained SVG");
  auto ppath = std::make_shared<std::string>();
  auto pout = std::make_shared<std::string>("strata-trace.svg");
  plot->add_option("trace", *ppath, "a trace")->required();
  plot->add_option("-o,--out", *pout, "the SVG to write");
  plot->callback([ppath, pout] {
    const memory::Trace t = memory::read_trace(*ppath);
    memory::write_text_file(plot_trace_svg(t), *pout);
    fmt::print("wrote {} ({} operators)\n", *pout, t.ops.size());
  });

  auto* exp = trace->add_subcommand("export", "Convert a trace for other viewers");
  auto epath = std::make_shared<std::string>();
  auto chrome = std::make_shared<std::string>();
  exp->add_option("trace", *epath, "a trace")->required();
  exp->add_option("--chrome", *chrome, "Chrome trace event JSON to write (opens in Perfetto)")->required();
  exp->callback([epath, chrome] {
    const memory::Trace t = memory::read_trace(*epath);
    memory::write_text_file(export_chrome_trace(t), *chrome);
    fmt::print("wrote {} ({} operators)\n", *chrome, t.ops.size());
  });
}

}  // namespace strata::tools
