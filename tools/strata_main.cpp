// strata: the command-line tool: info, bench, trace, checkpoint, run.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "commands.h"

namespace {

// `strata bench ...` is strata-bench's, beside this executable (Note [A
// launcher without LibTorch] in tools/CMakeLists.txt): exec'd with the same
// arguments, so what the benchmark prints and returns is strata's.
int exec_bench(char** argv) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    std::fprintf(stderr, "strata: error: cannot find this executable's folder to run strata-bench from: %s\n",
                 ec.message().c_str());
    return 1;
  }
  const std::string bench = (self.parent_path() / "strata-bench").string();
  argv[0] = const_cast<char*>(bench.c_str());
  ::execv(bench.c_str(), argv);
  std::fprintf(stderr, "strata: error: cannot run the benchmarks' executable %s: %s (it is built with strata: "
               "cmake --build BUILD_DIR --target strata_bench)\n", bench.c_str(), std::strerror(errno));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == "bench") return exec_bench(argv);
  CLI::App app{"strata: memory-centric heterogeneous training runtime"};
  app.set_version_flag("--version", std::string("strata ") + STRATA_VERSION);
  app.require_subcommand(1);
  strata::tools::add_info_command(app);
  // Listed here; `strata bench ...` never reaches this parser (exec_bench above).
  app.add_subcommand("bench", "Benchmarks, each printed beside a ceiling measured in the same run "
                              "(strata bench --help lists them)");
  strata::tools::add_trace_command(app);
  strata::tools::add_checkpoint_command(app);
  strata::tools::add_run_command(app);
  return strata::tools::parse_and_run(app, argc, argv);
}
