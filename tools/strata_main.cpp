// strata: the command-line tool: info, bench, trace, checkpoint, run.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "strata/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"strata: memory-centric heterogeneous training runtime"};
  app.set_version_flag("--version", std::string("strata ") + STRATA_VERSION);
  app.require_subcommand(1);
  strata::tools::add_info_command(app);
  strata::tools::add_bench_command(app);
  strata::tools::add_trace_command(app);
  strata::tools::add_checkpoint_command(app);
  strata::tools::add_run_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata: error: %s\n", e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
