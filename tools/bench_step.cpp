// `strata bench step`: one training step of examples/gpt's model, plain
// LibTorch with everything resident (the baseline) against strata with the
// device budget at 100%, 50% and 25% of the model state, and with the
// optimizer state on NVMe, all measured in the same run. The strata rows use
// the auto policy; rows at 25% use LRU and static placement, to show what
// planning saves, and one with optimizer state on NVMe runs without
// read-ahead, to show what prefetching saves: time spent waiting for chunks
// ("wait ms") and bytes the training thread moved itself ("on demand").
//
// With -n N (N > 1) it starts N local ranks (as `strata run -n N`) and
// compares the ZeRO stages instead: per size, plain LibTorch on each rank's
// batch without any communication (the ceiling), then strata data parallel
// at stages 0 to 3, each with its step time, the model-state bytes each rank
// holds between steps and the collectives per step. Rank 0 writes the table
// (or JSON) to a file the launching process prints when the ranks are done.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <vector>

#include "bench_timing.h"
#include "commands.h"
#include "gpt_model.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/offload/device_memory.h"
#include "strata/parallel/engine.h"
#if defined(STRATA_HAVE_GLOO)
#include "strata/parallel/communicator.h"
#endif

namespace strata::tools {
namespace {

using examples::GptConfig;
namespace mem = memory;

struct StepBenchOptions {
  std::vector<std::string> sizes = {"128x4", "256x4", "384x6"};
  int steps = 3;
  int warmup = 1;
  int batch = 16;
  int context = 64;
  std::string precision = "fp32";
  std::string nvme_dir;
  bool json = false;
  // Where operators run: "auto" (a GPU when one is usable), "cuda" or "emulated"
  // (the CPU, the device tier emulated in host memory). Sets STRATA_DEVICE.
  std::string device = "auto";
  int ranks = 1;       // -n: > 1 compares the ZeRO stages over that many local ranks
  std::string output;  // inside a rank: where rank 0 writes its report
};

struct Row {
  std::string size;
  int64_t params = 0;
  std::string config;
  uint64_t device_budget = 0;  // 0: the baseline
  double step_ms = 0.0;
  double ratio = 1.0;
  uint64_t moved_per_step = 0;  // bytes between tiers per step
  uint64_t demand_per_step = 0;  // of those, moved by the training thread itself (not prefetched)
  uint64_t device_peak = 0;
  double wait_ms = 0.0;  // per step: operators and optimizer waiting for chunks
  double loss = 0.0;
  int stage = -1;              // ZeRO stage (-n rows); -1: single process
  uint64_t held = 0;           // model-state bytes on all tiers after the last step
  double collectives_per_step = 0.0;  // gradient, flag and parameter collectives
  double gathers_per_step = 0.0;      // stage 3 parameter all-gathers
};

uint64_t total(const std::array<std::array<uint64_t, mem::kNumTiers>, mem::kNumTiers>& bytes) {
  uint64_t n = 0;
  for (const auto& from : bytes) {
    for (uint64_t b : from) n += b;
  }
  return n;
}

using Batches = std::vector<std::pair<torch::Tensor, torch::Tensor>>;

// Where the engines below compute (STRATA_DEVICE, set from --device), so the
// baseline runs there too.
torch::Device compute_device() {
  const std::unique_ptr<offload::DeviceMemory> dev = offload::make_device_memory();
  return dev->kind() == offload::DeviceKind::kCuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dev->index()))
                                                   : torch::Device(torch::kCPU);
}

// Median step time of plain LibTorch: AdamW over resident parameters, with
// the same clipping as the engine.
Row run_baseline(const GptConfig& mc, const Batches& data, const StepBenchOptions& o) {
  torch::manual_seed(0);
  torch::nn::Sequential model = examples::gpt_layers(mc);
  const torch::Device device = compute_device();
  model->to(device);
  parallel::AdamWConfig cfg;
  const std::vector<torch::Tensor> params = examples::unique_parameters(*model);  // a tied table once
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  std::vector<double> times;
  Row r;
  for (size_t i = 0; i < data.size(); ++i) {
    const torch::Tensor x = data[i].first.to(device), y = data[i].second.to(device);
    const double t = seconds([&] {
      opt.zero_grad();
      torch::Tensor loss = examples::gpt_loss(model->forward(x), y);
      loss.backward();
      torch::nn::utils::clip_grad_norm_(params, 1.0);
      opt.step();
      r.loss = loss.item<double>();  // waits for the device
    });
    if (static_cast<int>(i) >= o.warmup) times.push_back(t);
  }
  r.params = examples::count_parameters(*model);
  r.config = device.is_cuda() ? "plain LibTorch, all on the GPU" : "plain LibTorch";
  r.step_ms = median(times) * 1e3;
  return r;
}

Row run_strata(const GptConfig& mc, const Batches& data, const StepBenchOptions& o, double device_fraction,
               bool nvme, const std::string& policy = "auto", bool prefetch = true,
               std::shared_ptr<parallel::Communicator> comm = nullptr, int stage = 0) {
  torch::manual_seed(0);
  torch::nn::Sequential model = examples::gpt_layers(mc);
  const DType precision = parse_dtype(o.precision);
  const int64_t params = examples::count_parameters(*model);
  const uint64_t state = static_cast<uint64_t>(params) * parallel::model_state_bytes_per_param(precision);
  parallel::EngineOptions eo;
  eo.precision = precision;
  eo.clip_norm = 1.0;
  eo.policy = policy;
  eo.prefetch = prefetch;
  eo.zero_stage = stage;
  eo.budgets.device = round_up(static_cast<uint64_t>(state * device_fraction), 4096);
  eo.budgets.host = round_up(state * 2, 4096);
  if (nvme) {
    eo.budgets.nvme = round_up(state * 2, 4096);
    eo.nvme_dir = o.nvme_dir;
    eo.nvme_optim_fraction = 1.0;
  }
  Row r;
  r.params = params;
  r.device_budget = eo.budgets.device;
  r.config = fmt::format("strata {} device {:.0f}%{}{}{}", o.precision, device_fraction * 100,
                         policy == "auto" ? "" : ", " + policy, nvme ? ", optim on nvme" : "",
                         prefetch ? "" : ", no prefetch");
  if (comm) {
    r.stage = stage;
    r.config = fmt::format("strata {} ZeRO stage {} on {} ranks", o.precision, stage, comm->world_size());
  }
  std::vector<double> times;
  {
    auto engine = parallel::attach(*model, parallel::AdamWConfig{}, eo, comm);
    uint64_t moved_before = 0, demand_before = 0;
    int64_t collectives_before = 0, gathers_before = 0;
    parallel::Engine::DataWait wait_before;
    for (size_t i = 0; i < data.size(); ++i) {
      // Inputs where the module computes (Engine::to_device), as a user places them.
      const torch::Tensor x = engine->to_device(data[i].first), y = engine->to_device(data[i].second);
      if (static_cast<int>(i) == o.warmup) {
        moved_before = total(engine->move_stats().bytes);
        demand_before = total(engine->move_stats().demand_bytes);
        wait_before = engine->data_wait();
        collectives_before = engine->collectives();
        gathers_before = engine->parameter_gathers();
      }
      const double t = seconds(
          [&] { r.loss = engine->train_step([&] { return examples::gpt_loss(model->forward(x), y); }).loss; });
      if (static_cast<int>(i) >= o.warmup) times.push_back(t);
    }
    r.moved_per_step = (total(engine->move_stats().bytes) - moved_before) / times.size();
    r.demand_per_step = (total(engine->move_stats().demand_bytes) - demand_before) / times.size();
    const parallel::Engine::DataWait w = engine->data_wait();
    r.wait_ms = 1e3 * ((w.operators - wait_before.operators) + (w.optimizer - wait_before.optimizer)) / times.size();
    const mem::TierStats dev = engine->tier_stats(mem::Tier::kDevice);
    STRATA_CHECK(dev.peak <= dev.budget, "device peak ", format_bytes(dev.peak), " over its budget ",
                 format_bytes(dev.budget));
    r.device_peak = dev.peak;
    for (mem::Tier t : {mem::Tier::kDevice, mem::Tier::kHost, mem::Tier::kNvme}) r.held += engine->tier_stats(t).used;
    r.collectives_per_step = static_cast<double>(engine->collectives() - collectives_before) / times.size();
    r.gathers_per_step = static_cast<double>(engine->parameter_gathers() - gathers_before) / times.size();
  }
  r.step_ms = median(times) * 1e3;
  return r;
}

Batches make_batches(const GptConfig& mc, const StepBenchOptions& o, int seed) {
  torch::manual_seed(seed);
  Batches data;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    data.emplace_back(torch::randint(0, mc.vocab, {o.batch, o.context}),
                      torch::randint(0, mc.vocab, {o.batch, o.context}));
  }
  return data;
}

void run_step_bench(const StepBenchOptions& o) {
  STRATA_CHECK(o.steps >= 1 && o.warmup >= 0, "--steps must be at least 1 and --warmup at least 0");
  std::vector<Row> rows;
  const torch::Device device = compute_device();
  if (!o.json) {
    fmt::print("strata bench step: examples/gpt's model, batch {} x context {}, median of {} steps after {} warm-up, "
               "operators on {}\n",
               o.batch, o.context, o.steps, o.warmup, device.is_cuda() ? "the GPU" : "the CPU (device tier emulated)");
    fmt::print("{:<8} {:>10} {:<46} {:>12} {:>10} {:>8} {:>12} {:>12} {:>9}\n", "size", "params", "configuration",
               "device", "step ms", "ratio", "moved/step", "on demand", "wait ms");
  }
  for (const std::string& size : o.sizes) {
    GptConfig mc = examples::parse_gpt_size(size, o.context);
    mc.tied_head = true;  // examples/gpt's default model (one stage)
    const Batches data = make_batches(mc, o, 1);
    std::vector<Row> local;
    local.push_back(run_baseline(mc, data, o));
    for (double f : {1.0, 0.5, 0.25}) local.push_back(run_strata(mc, data, o, f, false));
    local.push_back(run_strata(mc, data, o, 0.25, false, "lru"));  // what the auto policy saves
    local.push_back(run_strata(mc, data, o, 0.25, false, "static"));
    local.push_back(run_strata(mc, data, o, 0.25, true));
    local.push_back(run_strata(mc, data, o, 0.25, true, "auto", /*prefetch=*/false));  // what read-ahead saves
    for (Row& r : local) {
      r.size = size;
      r.ratio = r.step_ms / local.front().step_ms;
      if (!o.json) {
        fmt::print("{:<8} {:>10} {:<46} {:>12} {:>10.1f} {:>7.2f}x {:>12} {:>12} {:>9}\n", r.size, r.params, r.config,
                   r.device_budget ? format_bytes(r.device_budget) : "-", r.step_ms, r.ratio,
                   r.device_budget ? format_bytes(r.moved_per_step) : "-",
                   r.device_budget ? format_bytes(r.demand_per_step) : "-",
                   r.device_budget ? fmt::format("{:.1f}", r.wait_ms) : "-");
        std::fflush(stdout);
      }
      rows.push_back(r);
    }
  }
  if (o.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& r : rows) {
      j.push_back({{"size", r.size},
                   {"params", r.params},
                   {"config", r.config},
                   {"device_budget_bytes", r.device_budget},
                   {"device_peak_bytes", r.device_peak},
                   {"step_ms", r.step_ms},
                   {"ratio_to_baseline", r.ratio},
                   {"moved_bytes_per_step", r.moved_per_step},
                   {"on_demand_bytes_per_step", r.demand_per_step},
                   {"data_wait_ms_per_step", r.wait_ms},
                   {"last_loss", r.loss}});
    }
    fmt::print("{}\n", nlohmann::json{{"benchmark", "step"},
                                      {"device", device.str()},
                                      {"batch", o.batch},
                                      {"context", o.context},
                                      {"steps", o.steps},
                                      {"rows", j}}
                           .dump(2));
  }
}

#if defined(STRATA_HAVE_GLOO)
// Inside each of -n ranks: the baseline and stages 0-3; rank 0 reports.
void run_stage_bench(const StepBenchOptions& o) {
  std::shared_ptr<parallel::Communicator> comm =
      parallel::make_gloo_communicator(parallel::Rendezvous::from_env());
  const int rank = comm->rank();
  StepBenchOptions mine = o;
  mine.nvme_dir += fmt::format("-rank{}", rank);
  std::vector<Row> rows;
  for (const std::string& size : o.sizes) {
    GptConfig mc = examples::parse_gpt_size(size, o.context);
    mc.tied_head = true;  // examples/gpt's default model (one stage)
    const Batches data = make_batches(mc, o, 1 + rank);  // each rank's own batches
    std::vector<Row> local;
    comm->barrier()->wait();
    local.push_back(run_baseline(mc, data, o));
    local.back().config = fmt::format("plain LibTorch, each of {} ranks alone", comm->world_size());
    for (int stage = 0; stage <= 3; ++stage) {
      comm->barrier()->wait();
      local.push_back(run_strata(mc, data, mine, 1.0, false, "auto", true, comm, stage));
    }
    for (Row& r : local) {
      r.size = size;
      r.ratio = r.step_ms / local.front().step_ms;
      rows.push_back(r);
    }
  }
  if (rank != 0) return;
  std::string report;
  if (o.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& r : rows) {
      j.push_back({{"size", r.size}, {"params", r.params}, {"config", r.config}, {"zero_stage", r.stage},
                   {"step_ms", r.step_ms}, {"ratio_to_baseline", r.ratio}, {"model_state_bytes_per_rank", r.held},
                   {"device_peak_bytes", r.device_peak}, {"collectives_per_step", r.collectives_per_step},
                   {"parameter_gathers_per_step", r.gathers_per_step}, {"last_loss", r.loss}});
    }
    report = nlohmann::json{{"benchmark", "step"}, {"ranks", comm->world_size()}, {"batch_per_rank", o.batch},
                            {"context", o.context}, {"steps", o.steps}, {"rows", j}}
                 .dump(2) + "\n";
  } else {
    report = fmt::format("strata bench step -n {}: examples/gpt's model, batch {} x context {} per rank, median of {} "
                         "steps after {} warm-up; device budget = the whole model state, so stages differ by "
                         "communication and what each rank keeps\n",
                         comm->world_size(), o.batch, o.context, o.steps, o.warmup);
    report += fmt::format("{:<8} {:>10} {:<40} {:>10} {:>8} {:>14} {:>12} {:>12} {:>9}\n", "size", "params",
                          "configuration", "step ms", "ratio", "state/rank", "device peak", "collectives", "gathers");
    for (const Row& r : rows) {
      const bool s = r.stage >= 0;
      report += fmt::format("{:<8} {:>10} {:<40} {:>10.1f} {:>7.2f}x {:>14} {:>12} {:>12} {:>9}\n", r.size, r.params,
                            r.config, r.step_ms, r.ratio, s ? format_bytes(r.held) : "-",
                            s ? format_bytes(r.device_peak) : "-",
                            s ? fmt::format("{:.0f}/step", r.collectives_per_step) : "-",
                            s ? fmt::format("{:.0f}/step", r.gathers_per_step) : "-");
    }
  }
  if (o.output.empty()) {
    fmt::print("{}", report);
  } else {
    std::FILE* f = std::fopen(o.output.c_str(), "w");
    STRATA_CHECK(f != nullptr, "cannot write ", o.output, ": ", std::strerror(errno));
    std::fputs(report.c_str(), f);
    std::fclose(f);
  }
}

// The launching process: starts -n copies of this command as ranks and prints rank 0's report.
void launch_stage_bench(const StepBenchOptions& o) {
  const std::string report = o.nvme_dir + "-report";
  std::vector<std::string> cmd = {std::filesystem::read_symlink("/proc/self/exe").string(), "bench", "step"};
  std::string sizes;
  for (const std::string& s : o.sizes) sizes += (sizes.empty() ? "" : ",") + s;
  for (const std::string& a : {std::string("--sizes"), sizes, std::string("--steps"), std::to_string(o.steps),
                               std::string("--warmup"), std::to_string(o.warmup), std::string("--batch"),
                               std::to_string(o.batch), std::string("--context"), std::to_string(o.context),
                               std::string("--precision"), o.precision, std::string("--nvme-dir"), o.nvme_dir,
                               std::string("-n"), std::to_string(o.ranks), std::string("--output"), report}) {
    cmd.push_back(a);
  }
  if (o.json) cmd.push_back("--json");
  const int code = run_local_ranks(o.ranks, cmd);
  std::ifstream in(report);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(report);
  STRATA_CHECK(code == 0 && !text.empty(), "the ", o.ranks, " ranks of the benchmark failed (exit code ", code,
               "); their output is above");
  fmt::print("{}", text);
}
#endif

}  // namespace

void add_bench_step_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("step", "Training step of examples/gpt's model: plain LibTorch vs strata budgets");
  auto o = std::make_shared<StepBenchOptions>();
  o->nvme_dir = (std::filesystem::temp_directory_path() / fmt::format("strata-bench-step-{}", ::getpid())).string();
  cmd->add_option("--sizes", o->sizes, "model sizes DIMxLAYERS")->delimiter(',');
  cmd->add_option("--steps", o->steps, "timed steps per configuration (median reported)");
  cmd->add_option("--warmup", o->warmup, "untimed steps first");
  cmd->add_option("--batch", o->batch)->check(CLI::PositiveNumber);
  cmd->add_option("--context", o->context)->check(CLI::PositiveNumber);
  cmd->add_option("--precision", o->precision, "fp32, bf16 or fp16 for the strata rows");
  cmd->add_option("--nvme-dir", o->nvme_dir, "directory for the NVMe row's files (removed after)");
  cmd->add_option("--device", o->device, "auto (a GPU when one is usable), cuda or emulated (the CPU)")
      ->check(CLI::IsMember({"auto", "cuda", "emulated"}));
  cmd->add_flag("--json", o->json, "print one JSON document");
  cmd->add_option("-n,--ranks", o->ranks, "compare ZeRO stages 0-3 data parallel over this many local ranks")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--output", o->output, "(inside the ranks of -n) where rank 0 writes its report");
  cmd->callback([o] {
    ::setenv("STRATA_DEVICE", o->device.c_str(), 1);  // the device tier of every engine below, and the baseline's
    try {
      if (o->ranks > 1) {
#if defined(STRATA_HAVE_GLOO)
        if (std::getenv("WORLD_SIZE") == nullptr) {
          launch_stage_bench(*o);
        } else {
          run_stage_bench(*o);
        }
#else
        STRATA_FAIL("bench step -n needs Gloo; this strata was built without it");
#endif
      } else {
        run_step_bench(*o);
      }
    } catch (...) {
      std::error_code ec;
      std::filesystem::remove_all(o->nvme_dir, ec);
      throw;
    }
    std::error_code ec;
    std::filesystem::remove_all(o->nvme_dir, ec);
  });
}

}  // namespace strata::tools
