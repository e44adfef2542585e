// `strata bench step`: one training step of examples/gpt's model, plain
// LibTorch with everything resident (the baseline) against strata with the
// device budget at 100%, 50% and 25% of the model state, and with the
// optimizer state on NVMe, all measured in the same run. The strata rows use
// the auto policy; rows at 25% use LRU and static placement, to show what
// planning saves, and one with optimizer state on NVMe runs without
// read-ahead, to show what prefetching saves: time spent waiting for chunks
// ("wait ms") and bytes the training thread moved itself ("on demand").
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "bench_timing.h"
#include "commands.h"
#include "gpt_model.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/engine.h"

namespace strata::tools {
namespace {

using examples::Gpt;
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
};

uint64_t total(const std::array<std::array<uint64_t, mem::kNumTiers>, mem::kNumTiers>& bytes) {
  uint64_t n = 0;
  for (const auto& from : bytes) {
    for (uint64_t b : from) n += b;
  }
  return n;
}

using Batches = std::vector<std::pair<torch::Tensor, torch::Tensor>>;

// Median step time of plain LibTorch: AdamW over resident parameters, with
// the same clipping as the engine.
Row run_baseline(const GptConfig& mc, const Batches& data, const StepBenchOptions& o) {
  torch::manual_seed(0);
  Gpt model(mc);
  parallel::AdamWConfig cfg;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  std::vector<double> times;
  Row r;
  for (size_t i = 0; i < data.size(); ++i) {
    const double t = seconds([&] {
      opt.zero_grad();
      torch::Tensor loss = model->loss(data[i].first, data[i].second);
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
      opt.step();
      r.loss = loss.item<double>();
    });
    if (static_cast<int>(i) >= o.warmup) times.push_back(t);
  }
  r.params = examples::count_parameters(*model);
  r.config = "plain LibTorch";
  r.step_ms = median(times) * 1e3;
  return r;
}

Row run_strata(const GptConfig& mc, const Batches& data, const StepBenchOptions& o, double device_fraction,
               bool nvme, const std::string& policy = "auto", bool prefetch = true) {
  torch::manual_seed(0);
  Gpt model(mc);
  const DType precision = parse_dtype(o.precision);
  const int64_t params = examples::count_parameters(*model);
  const uint64_t state = static_cast<uint64_t>(params) * parallel::model_state_bytes_per_param(precision);
  parallel::EngineOptions eo;
  eo.precision = precision;
  eo.clip_norm = 1.0;
  eo.policy = policy;
  eo.prefetch = prefetch;
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
  std::vector<double> times;
  {
    auto engine = parallel::attach(*model, parallel::AdamWConfig{}, eo);
    uint64_t moved_before = 0, demand_before = 0;
    parallel::Engine::DataWait wait_before;
    for (size_t i = 0; i < data.size(); ++i) {
      if (static_cast<int>(i) == o.warmup) {
        moved_before = total(engine->move_stats().bytes);
        demand_before = total(engine->move_stats().demand_bytes);
        wait_before = engine->data_wait();
      }
      const double t = seconds(
          [&] { r.loss = engine->train_step([&] { return model->loss(data[i].first, data[i].second); }).loss; });
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
  }
  r.step_ms = median(times) * 1e3;
  return r;
}

void run_step_bench(const StepBenchOptions& o) {
  STRATA_CHECK(o.steps >= 1 && o.warmup >= 0, "--steps must be at least 1 and --warmup at least 0");
  std::vector<Row> rows;
  if (!o.json) {
    fmt::print("strata bench step: examples/gpt's model, batch {} x context {}, median of {} steps after {} warm-up\n",
               o.batch, o.context, o.steps, o.warmup);
    fmt::print("{:<8} {:>10} {:<46} {:>12} {:>10} {:>8} {:>12} {:>12} {:>9}\n", "size", "params", "configuration",
               "device", "step ms", "ratio", "moved/step", "on demand", "wait ms");
  }
  for (const std::string& size : o.sizes) {
    const GptConfig mc = examples::parse_gpt_size(size, o.context);
    torch::manual_seed(1);
    Batches data;
    for (int i = 0; i < o.warmup + o.steps; ++i) {
      data.emplace_back(torch::randint(0, mc.vocab, {o.batch, o.context}),
                        torch::randint(0, mc.vocab, {o.batch, o.context}));
    }
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
                                      {"batch", o.batch},
                                      {"context", o.context},
                                      {"steps", o.steps},
                                      {"rows", j}}
                           .dump(2));
  }
}

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
  cmd->add_flag("--json", o->json, "print one JSON document");
  cmd->callback([o] {
    try {
      run_step_bench(*o);
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
