// `strata bench pipeline`: the bubble of each pipeline schedule, measured on
// stages of known cost, beside the formula; and each stage's peak activation
// memory from the tracer. Run under the launcher, one rank per stage:
//
//   strata run -n 4 -- strata bench pipeline [--microbatches 4,8] [--ms 20] [--json]
//
// Every stage is layers whose forward, input-gradient and weight-gradient
// passes each sleep a fixed time (--ms per stage, split over an interleaved
// rank's chunks) and save a [microbatch, --width] activation, so the timing
// measures the schedule, not this machine. The bubble is 1 - compute / step
// time, the worst rank's, median of the timed steps; compute is the time the
// rank spent in its passes minus its waits for a neighbour. Formulas:
// (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved (the
// literature's "(p-1)/(m+p-1) divided by v" with the bubble counted against
// the whole step), (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) for ZB-H1. The
// activation peak is the highest non-model byte count the engine's trace
// recorded during a traced step above the step's lowest (memory/trace.h), and
// the same in microbatches: over one microbatch's [microbatch, --width]
// activation times the layers the rank holds.
#include <fmt/format.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_timing.h"
#include "commands.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/memory/trace.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/pipeline.h"

namespace strata::tools {
namespace {

namespace pp = parallel::pipeline;

struct PipelineBenchOptions {
  std::vector<int> microbatches = {4, 8};
  double ms = 80.0;
  int64_t width = 4096;
  int steps = 3;
  bool json = false;
};

void sleep_ms(double ms) { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); }

// y = x * w, each pass sleeping its share.
struct TimedScale : torch::autograd::Function<TimedScale> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               double ms) {
    sleep_ms(ms);
    ctx->save_for_backward({x, w});
    ctx->saved_data["ms"] = ms;
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const double ms = ctx->saved_data["ms"].toDouble();
    torch::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      sleep_ms(ms);
      gx = g[0] * saved[1];
    }
    if (ctx->needs_input_grad(1)) {
      sleep_ms(ms);
      gw = (g[0] * saved[0]).sum(0);
    }
    return {gx, gw, torch::Tensor()};
  }
};

struct TimedLayerImpl : torch::nn::Module {
  torch::Tensor w;
  double ms;
  TimedLayerImpl(int64_t width, double ms_) : ms(ms_) { w = register_parameter("w", torch::ones({width})); }
  torch::Tensor forward(const torch::Tensor& x) { return TimedScale::apply(x, w, ms); }
};
TORCH_MODULE(TimedLayer);

// The highest non-model bytes the traced step recorded, above its lowest
// level (the batch and whatever else lives across the step).
uint64_t activation_peak(const std::string& path) {
  const memory::Trace t = memory::read_trace(path);
  uint64_t peak = 0, floor = UINT64_MAX;
  for (const memory::TraceOp& op : t.ops) {
    peak = std::max(peak, op.non_model_peak);
    floor = std::min(floor, op.non_model_bytes);
  }
  return t.ops.empty() ? 0 : peak - std::min(peak, floor);
}

void run_pipeline_bench(const PipelineBenchOptions& o) {
  STRATA_CHECK(o.ms > 0 && o.width >= 1 && o.steps >= 1, "--ms, --width and --steps must be positive");
  auto world = std::shared_ptr<parallel::Communicator>(
      parallel::make_gloo_communicator(parallel::Rendezvous::from_env()));
  const int p = world->world_size(), rank = world->rank();
  const std::string dir = fmt::format("/tmp/strata-bench-pipeline-{}", ::getpid());
  std::filesystem::create_directories(dir);
  nlohmann::json rows = nlohmann::json::array();
  if (rank == 0 && !o.json) {
    fmt::print("strata bench pipeline: {} stages, {} ms per pass and stage (sleeps), median of {} steps; "
               "activation peak per stage from the trace\n",
               p, o.ms, o.steps);
    fmt::print("{:<17} {:>3} {:>3} {:>3} {:>9} {:>9} {:>7}  {}\n", "schedule", "p", "m", "v", "bubble", "formula",
               "ratio", "activation peak per stage (in microbatches)");
  }
  for (pp::Schedule s : {pp::Schedule::kGPipe, pp::Schedule::k1F1B, pp::Schedule::kInterleaved1F1B,
                         pp::Schedule::kZeroBubbleH1}) {
    for (int m : o.microbatches) {
      const int v = s == pp::Schedule::kInterleaved1F1B && p > 1 ? 2 : 1;
      if (s == pp::Schedule::kInterleaved1F1B && m % p != 0) continue;
      const int batch = m * 4;
      torch::nn::Sequential model;
      for (int i = 0; i < p * v; ++i) model->push_back(TimedLayer(o.width, o.ms / v));
      pp::PipelineOptions po;
      po.schedule = s;
      po.microbatches = m;
      po.virtual_stages = v;
      pp::Pipeline pipe(model, world, po);
      parallel::EngineOptions eo;
      eo.trace_path = fmt::format("{}/{}-{}.json", dir, pp::schedule_name(s), m);
      eo.trace_steps = 1;
      const uint64_t model_bytes = static_cast<uint64_t>(o.width) * v * 4 * 16;
      eo.budgets = {model_bytes * 4 + (1 << 20), model_bytes * 8 + (1 << 20), 0};
      parallel::AdamWConfig cfg;
      pipe.attach(parallel::OptimizerConfig::from(cfg), eo);
      // Inputs that need a gradient: the first stage computes its input
      // gradient too, so every stage's passes cost the same.
      const torch::Tensor x = torch::randn({batch, o.width}).requires_grad_(true), y = torch::randn({batch, o.width});
      const auto loss = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
      std::vector<double> bubbles;
      for (int step = 0; step < o.steps + 1; ++step) {  // the first, traced, is not timed
        pipe.step(x, y, loss);
        if (step == 0) continue;
        const auto t = pipe.last_timing();
        const std::vector<double> all = parallel::all_gather_values(*world, {1.0 - t.compute / t.step});
        bubbles.push_back(*std::max_element(all.begin(), all.end()));
      }
      const std::string trace = fmt::format("{}/{}-{}.stage{}.json", dir, pp::schedule_name(s), m, rank);
      const std::vector<double> peaks = parallel::all_gather_values(
          *world, {static_cast<double>(activation_peak(p > 1 ? trace : eo.trace_path))});
      const double measured = median(bubbles);
      const pp::ActionCosts c{o.ms / v, o.ms / v, o.ms / v};
      const double formula = pp::bubble_formula(s, p, v, m, c);
      if (rank == 0) {
        // One microbatch's activations on a rank: 4 samples x width fp32 per layer it holds.
        const double unit = 4.0 * o.width * 4 * v;
        std::string peak_text;
        for (double b : peaks) {
          peak_text += fmt::format("{}{} ({:.1f})", peak_text.empty() ? "" : " ", format_bytes(static_cast<uint64_t>(b)),
                                   b / unit);
        }
        if (o.json) {
          rows.push_back({{"schedule", pp::schedule_name(s)}, {"p", p}, {"m", m}, {"v", v}, {"bubble", measured},
                          {"formula", formula}, {"activation_peak_bytes", peaks},
                          {"microbatch_activation_bytes", 4.0 * o.width * 4 * v}});
        } else {
          fmt::print("{:<17} {:>3} {:>3} {:>3} {:>9.3f} {:>9.3f} {:>7.2f}  {}\n", pp::schedule_name(s), p, m, v,
                     measured, formula, formula > 0 ? measured / formula : 0.0, peak_text);
        }
      }
    }
  }
  if (rank == 0 && o.json) {
    fmt::print("{}\n", nlohmann::json{{"stages", p}, {"ms_per_pass", o.ms}, {"width", o.width}, {"rows", rows}}.dump(1));
  }
  world->barrier()->wait();
  std::filesystem::remove_all(dir);
}

}  // namespace

void add_bench_pipeline_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand(
      "pipeline", "Pipeline schedules' bubble vs the formulas, and activation peaks (run it under strata run -n P)");
  auto o = std::make_shared<PipelineBenchOptions>();
  cmd->add_option("--microbatches", o->microbatches, "microbatch counts, comma-separated")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  cmd->add_option("--ms", o->ms, "milliseconds each pass of a stage sleeps");
  cmd->add_option("--width", o->width, "activation width (fp32 elements per sample)");
  cmd->add_option("--steps", o->steps, "timed steps (median reported)");
  cmd->add_flag("--json", o->json, "print one JSON document (rank 0)");
  cmd->callback([o] { run_pipeline_bench(*o); });
}

}  // namespace strata::tools
