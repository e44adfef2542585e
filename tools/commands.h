#pragma once
// Each verb of the `strata` tool registers its subcommand here.

#include <CLI/CLI.hpp>

namespace strata::tools {

void add_info_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_trace_command(CLI::App& app);
/// `strata bench nvme`, added to the `bench` subcommand.
void add_bench_nvme_command(CLI::App& bench);
/// `strata bench step` (needs LibTorch: built only with it).
void add_bench_step_command(CLI::App& bench);

}  // namespace strata::tools
