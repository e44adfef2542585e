#pragma once
// Each verb of the `strata` tool registers its subcommand here.

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace strata::tools {

/// Parses the command line into `app` and runs the chosen verb: 0, or a
/// message on stderr and CLI11's status (bad arguments) or 1 (a failure).
int parse_and_run(CLI::App& app, int argc, char** argv);

void add_info_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_trace_command(CLI::App& app);
/// `strata checkpoint inspect|verify|export|convert`: engine checkpoints offline.
void add_checkpoint_command(CLI::App& app);

/// `strata run -n N -- PROGRAM`: local ranks with torchrun's variables.
void add_run_command(CLI::App& app);
/// Runs `command` as `n` local ranks, as `strata run -n n` does, their
/// prefixed output on stderr; returns the exit code.
int run_local_ranks(int n, const std::vector<std::string>& command);
/// `strata bench nvme`, added to the `bench` subcommand.
void add_bench_nvme_command(CLI::App& bench);
/// `strata bench step` (needs LibTorch: built only with it).
void add_bench_step_command(CLI::App& bench);
/// `strata bench comm` (needs LibTorch and Gloo).
void add_bench_comm_command(CLI::App& bench);
/// `strata bench pipeline` (needs LibTorch and Gloo).
void add_bench_pipeline_command(CLI::App& bench);
/// `strata bench sequence` (needs LibTorch and Gloo).
void add_bench_sequence_command(CLI::App& bench);
/// `strata bench tp` (needs LibTorch and Gloo).
void add_bench_tp_command(CLI::App& bench);
/// `strata bench hybrid` (needs LibTorch and Gloo).
void add_bench_hybrid_command(CLI::App& bench);
/// `strata bench scale` (needs LibTorch: built only with it).
void add_bench_scale_command(CLI::App& bench);
/// `strata bench checkpoint` (needs LibTorch: built only with it).
void add_bench_checkpoint_command(CLI::App& bench);
/// The NVMe store's raw {write, read} GB/s over `bytes` in `dir` (8 MiB
/// blocks at the store's default queue depth, as many in flight): the
/// ceiling other benchmarks print beside theirs.
std::pair<double, double> nvme_store_gbps(const std::string& dir, uint64_t bytes);

}  // namespace strata::tools
