// `strata trace`: record a program's memory trace, and report on one.
//
//   strata trace record [-o strata-trace.json] [--steps 2] -- PROGRAM ARGS...
//   strata trace report TRACE [--top 10]
//   strata trace plot TRACE -o mem.svg
//   strata trace export TRACE --chrome out.json
//
// record runs PROGRAM with STRATA_TRACE and STRATA_TRACE_STEPS set, which any
// program using the engine honours (EngineOptions::from_env), and checks the
// trace it wrote. The trace format is docs/trace.md.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <memory>

#include "commands.h"
#include "strata/core/error.h"
#include "strata/memory/trace.h"

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
  std::filesystem::remove(out);  // a trace left from an earlier run must not pass for this one
  const pid_t pid = ::fork();
  STRATA_CHECK(pid >= 0, "fork failed: ", std::strerror(errno));
  if (pid == 0) {
    ::setenv("STRATA_TRACE", out.c_str(), 1);
    ::setenv("STRATA_TRACE_STEPS", std::to_string(o.steps).c_str(), 1);
    std::vector<char*> argv;
    for (const std::string& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "strata trace record: cannot run %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    STRATA_CHECK(errno == EINTR, "waitpid failed: ", std::strerror(errno));
  }
  STRATA_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, o.command[0], " failed (",
               WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                 : fmt::format("signal {}", WTERMSIG(status)),
               "); no trace recorded");
  STRATA_CHECK(std::filesystem::exists(out), o.command[0], " exited without writing a trace to ", out,
               ": does it train through strata::parallel::attach with EngineOptions::from_env, and for at least ",
               o.steps, " steps?");
  const memory::Trace t = memory::read_trace(out);
  fmt::print("strata trace: {} steps, {} operators recorded to {}\n", t.steps.size(), t.ops.size(), out);
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
  rep->callback([path, top] { fmt::print("{}", memory::format_trace_report(memory::read_trace(*path), *top)); });

  auto* plot = trace->add_subcommand("plot", "Draw memory per tier over the operators as a self-contained SVG");
  auto ppath = std::make_shared<std::string>();
  auto pout = std::make_shared<std::string>("strata-trace.svg");
  plot->add_option("trace", *ppath, "a trace")->required();
  plot->add_option("-o,--out", *pout, "the SVG to write");
  plot->callback([ppath, pout] {
    const memory::Trace t = memory::read_trace(*ppath);
    memory::write_text_file(memory::plot_trace_svg(t), *pout);
    fmt::print("wrote {} ({} operators)\n", *pout, t.ops.size());
  });

  auto* exp = trace->add_subcommand("export", "Convert a trace for other viewers");
  auto epath = std::make_shared<std::string>();
  auto chrome = std::make_shared<std::string>();
  exp->add_option("trace", *epath, "a trace")->required();
  exp->add_option("--chrome", *chrome, "Chrome trace event JSON to write (opens in Perfetto)")->required();
  exp->callback([epath, chrome] {
    const memory::Trace t = memory::read_trace(*epath);
    memory::write_text_file(memory::export_chrome_trace(t), *chrome);
    fmt::print("wrote {} ({} operators)\n", *chrome, t.ops.size());
  });
}

}  // namespace strata::tools
