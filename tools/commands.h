#pragma once
// Each verb of the `strata` tool registers its subcommand here.

#include <CLI/CLI.hpp>

namespace strata::tools {

void add_info_command(CLI::App& app);
void add_bench_command(CLI::App& app);

}  // namespace strata::tools
