// `strata bench tp`: what each tensor-parallel mode moves and holds per layer
// and per rank, beside the Colossal-AI paper's formulas. Run under the
// launcher with 8 ranks (smaller modes use the first ranks):
//
//   strata run -n 8 -- strata bench tp [--hidden 256] [--batch 8] [--seq 32] [--iters 3] [--json]
//
// The layer: a square linear (hidden x hidden) on activations of batch x seq
// tokens, measured as a pair (1D: column- then row-parallel; 2D and 2.5D:
// two Linear2D; 3D: side A to B and back), forward and backward, halved.
// With hidden = batch x seq (the default) a weight and an activation are the
// same size, the case the paper's formulas compare.
//   - bytes: what this rank sends, by the ring-algorithm count of
//     counting_communicator.h, and the collectives it joins;
//   - expected: this implementation's count, derived per mode (docs/tensor_parallel.md);
//   - paper: the formula times the layer's activation (tokens x hidden elements):
//     2(P-1)/P, 6(q-1)/q, 3(q-1)(d+1)/(dq), 6(q-1)/q^3;
//   - memory: this rank's parameter and input-activation bytes of the layer,
//     and the activation's fraction of one process's: 1, 1/q^2, 1/(dq^2), 1/q^3;
//   - time: milliseconds per layer forward and backward, beside one process
//     (noisy on a shared 2-core machine; Gloo on loopback).
#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "counting_communicator.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/tensor_collectives.h"
#include "strata/parallel/tensor_parallel.h"
#include "strata/parallel/tensor_parallel_2d.h"
#include "strata/parallel/tensor_parallel_3d.h"

namespace strata::tools {
namespace {

using parallel::Communicator;

struct TpBenchOptions {
  int64_t hidden = 256, batch = 8, seq = 32;
  int iters = 3;
  bool json = false;
};

struct Config {
  std::string mode;
  int ranks, q, d;
};

struct Row {
  double bytes = 0, calls = 0, ms = 0;
  double param_bytes = 0, activation_bytes = 0;
};

// One pair of layers over `group` (or one process when null): forward and
// backward `iters` times after a warm-up, per layer.
Row measure_layout(const Config& c, CountingCommunicator* group, const TpBenchOptions& o) {
  const int64_t h = o.hidden;
  torch::manual_seed(0);  // every rank builds the same whole layers and input
  torch::nn::Linear a(h, h), b(h, h);
  const torch::Tensor x = torch::randn({o.batch, o.seq, h});
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  torch::Tensor input;
  std::vector<torch::Tensor> params;
  std::unique_ptr<parallel::TensorGrid> grid;
  std::unique_ptr<parallel::CubeGrid> cube;
  torch::nn::AnyModule first, second;
  if (group == nullptr) {
    first = torch::nn::AnyModule(a);
    second = torch::nn::AnyModule(b);
    input = x;
  } else if (c.mode == "1d") {
    first = torch::nn::AnyModule(parallel::ColumnParallelLinear(a, *group));
    second = torch::nn::AnyModule(parallel::RowParallelLinear(b, *group));
    input = x;
  } else if (c.mode == "3d") {
    cube = std::make_unique<parallel::CubeGrid>(*group);
    first = torch::nn::AnyModule(parallel::Linear3D(a, *cube, parallel::Side3D::kA));
    second = torch::nn::AnyModule(parallel::Linear3D(b, *cube, parallel::Side3D::kB));
    input = cube->split(x, parallel::Side3D::kA);
  } else {
    grid = std::make_unique<parallel::TensorGrid>(*group, c.d);
    first = torch::nn::AnyModule(parallel::Linear2D(a, *grid));
    second = torch::nn::AnyModule(parallel::Linear2D(b, *grid));
    input = grid->split(x);
  }
  Row r;
  for (const auto& p : first.ptr()->parameters()) r.param_bytes += static_cast<double>(p.numel()) * 4;
  r.activation_bytes = static_cast<double>(input.numel()) * 4;
  const auto step = [&] {
    torch::Tensor in = input.clone().requires_grad_();
    second.forward(first.forward(in)).pow(2).sum().backward();
  };
  step();  // warm-up
  if (group) group->take(), group->take_calls();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.iters; ++i) step();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double per_layer = 2.0 * o.iters;
  if (group) {
    r.bytes = static_cast<double>(group->take()) / per_layer;
    r.calls = static_cast<double>(group->take_calls()) / per_layer;
  }
  r.ms = secs * 1e3 / per_layer;
  return r;
}

// This implementation's bytes per rank per layer (fwd + bwd), elements x 4
// (Note [SUMMA] in layers_2d.cpp, Note [3D linear] in layers_3d.cpp).
double expected_bytes(const Config& c, const TpBenchOptions& o) {
  const double act = static_cast<double>(o.batch * o.seq * o.hidden), w = static_cast<double>(o.hidden * o.hidden);
  const double q = c.q, d = c.d;
  if (c.mode == "1d") return 4 * 2 * (c.ranks - 1.0) / c.ranks * act;
  if (c.mode == "3d") return 4 * (4 * (q - 1) * act + 2 * (q - 1) * w) / (q * q * q);  // q: the cube's side
  const double act_block = act / (q * q * d), w_block = w / (q * q);
  return 4 * (3 * (q - 1) * (act_block + w_block) + 2 * (d - 1) / d * w_block);
}

double paper_bytes(const Config& c, const TpBenchOptions& o) {
  const double act = 4.0 * static_cast<double>(o.batch * o.seq * o.hidden), q = c.q, d = c.d;
  if (c.mode == "1d") return 2 * (c.ranks - 1.0) / c.ranks * act;
  if (c.mode == "2d") return 6 * (q - 1) / q * act;
  if (c.mode == "2.5d") return 3 * (q - 1) * (d + 1) / (d * q) * act;
  return 6 * (q - 1) / (q * q * q) * act;
}

double paper_activation(const Config& c) {
  if (c.mode == "1d") return 1.0;
  if (c.mode == "2d") return 1.0 / (c.q * c.q);
  if (c.mode == "2.5d") return 1.0 / (c.d * c.q * c.q);
  return 1.0 / (c.q * c.q * c.q);
}

void run_tp_bench(const TpBenchOptions& o) {
  auto world = parallel::make_gloo_communicator(parallel::Rendezvous::from_env());
  const int rank = world->rank();
  STRATA_CHECK(world->world_size() == 8, "strata bench tp runs on 8 ranks (strata run -n 8), not ", world->world_size());
  STRATA_CHECK(o.batch % 8 == 0 && o.hidden % 8 == 0 && o.iters > 0,
               "--batch and --hidden must be multiples of 8 (the 2.5D grid's batch blocks, the 3D cube's pieces), "
               "--iters positive");
  const std::vector<Config> configs = {{"1d", 2, 2, 1}, {"1d", 4, 4, 1}, {"1d", 8, 8, 1},
                                       {"2d", 4, 2, 1}, {"2.5d", 8, 2, 2}, {"3d", 8, 2, 1}};  // 3d: q is the side
  const Row one = rank == 0 ? measure_layout({"one", 1, 1, 1}, nullptr, o) : Row{};
  nlohmann::json rows = nlohmann::json::array();
  if (rank == 0 && !o.json) {
    fmt::print("strata bench tp: a {0}x{0} linear on {1} x {2} tokens, per layer and rank, forward and backward; one "
               "process {3:.2f} ms/layer, activation {4}, parameters {5}\n",
               o.hidden, o.batch, o.seq, one.ms, format_bytes(static_cast<uint64_t>(one.activation_bytes)),
               format_bytes(static_cast<uint64_t>(one.param_bytes)));
    fmt::print("{:<5} {:>5} {:>11} {:>11} {:>11} {:>7} {:>6} {:>10} {:>10} {:>8} {:>8} {:>9}\n", "mode", "ranks", "sent",
               "expected", "paper", "sent/pp", "colls", "params", "activ", "activ/1", "paper", "ms/layer");
  }
  for (const Config& c : configs) {
    std::vector<int> members;
    for (int r = 0; r < c.ranks; ++r) members.push_back(r);
    std::unique_ptr<Communicator> sub;
    if (rank < c.ranks) sub = world->split(members, fmt::format("strata-bench-tp-{}-{}", c.mode, c.ranks));
    if (rank < c.ranks) {
      CountingCommunicator counting(*sub);
      const Row r = measure_layout(c, &counting, o);
      if (rank == 0) {
        const double expected = expected_bytes(c, o), paper = paper_bytes(c, o);
        const double activ = r.activation_bytes / one.activation_bytes;
        if (o.json) {
          rows.push_back({{"mode", c.mode}, {"ranks", c.ranks}, {"q", c.q}, {"depth", c.d}, {"sent_bytes", r.bytes},
                          {"expected_bytes", expected}, {"paper_bytes", paper}, {"collectives", r.calls},
                          {"param_bytes", r.param_bytes}, {"activation_bytes", r.activation_bytes},
                          {"activation_vs_one", activ}, {"paper_activation", paper_activation(c)},
                          {"ms_per_layer", r.ms}, {"one_process_ms", one.ms}});
        } else {
          fmt::print("{:<5} {:>5} {:>11} {:>11} {:>11} {:>7.3f} {:>6.1f} {:>10} {:>10} {:>8.4f} {:>8.4f} {:>9.2f}\n",
                     c.mode, c.ranks, format_bytes(static_cast<uint64_t>(r.bytes)),
                     format_bytes(static_cast<uint64_t>(expected)), format_bytes(static_cast<uint64_t>(paper)),
                     r.bytes / paper, r.calls, format_bytes(static_cast<uint64_t>(r.param_bytes)),
                     format_bytes(static_cast<uint64_t>(r.activation_bytes)), activ, paper_activation(c), r.ms);
        }
      }
    }
    world->barrier()->wait();
  }
  if (rank == 0 && o.json) {
    fmt::print("{}\n", nlohmann::json{{"hidden", o.hidden}, {"batch", o.batch}, {"seq", o.seq},
                                       {"one_process_ms", one.ms}, {"rows", rows}}
                           .dump(1));
  }
  world->barrier()->wait();
}

}  // namespace

void add_bench_tp_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("tp", "Tensor-parallel modes: bytes, collectives, memory per layer (strata run -n 8)");
  auto o = std::make_shared<TpBenchOptions>();
  cmd->add_option("--hidden", o->hidden, "the layer's width (a multiple of 8)");
  cmd->add_option("--batch", o->batch, "sequences (a multiple of 8)");
  cmd->add_option("--seq", o->seq, "tokens per sequence");
  cmd->add_option("--iters", o->iters, "timed forward and backward passes");
  cmd->add_flag("--json", o->json, "print one JSON document (rank 0)");
  cmd->callback([o] { run_tp_bench(*o); });
}

}  // namespace strata::tools
