// strata-bench: the benchmarks, which `strata bench ...` execs (Note [A
// launcher without LibTorch] in tools/CMakeLists.txt). Its name in help and
// errors is strata's: users type `strata bench`.
#include <string>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"strata: memory-centric heterogeneous training runtime", "strata"};
  app.set_version_flag("--version", std::string("strata ") + STRATA_VERSION);
  app.require_subcommand(1);
  strata::tools::add_bench_command(app);
  return strata::tools::parse_and_run(app, argc, argv);
}
