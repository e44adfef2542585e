// `strata bench hybrid`: a GPT of fixed size (the model as layers,
// models/gpt) trained through parallel::Trainer under every layout of the
// launcher's ranks that the plan accepts (dp x pp x tp x sp, powers of two):
// per rank and step, the bytes sent on each axis (counting communicators
// under the mesh's groups), the model state and the step time, each beside
// what the layout predicts, and the step time beside one process training
// every replica's batch. Run under the launcher:
//
//   strata run -n 8 -- strata bench hybrid [--dim 64] [--layers 4] [--context 32] [--batch 8] [--json]
//
// Predicted bytes per step (b: the replica's batch, t: its positions on
// this rank (context / sp), d: width, A = b t d x 4 bytes, T: tp, S: sp,
// R = dp x sp the replica group, P: this rank's parameters, G = 4 P):
//   pp  A to the next stage and A back to the previous, for each of this
//       rank's stages that has one (1f1b: one stage per rank); A/T in the
//       grid modes (each rank's block);
//   tp  4 all-reduces of A per block (attention and MLP outputs forward,
//       their inputs' gradients backward), one for the vocabulary
//       embedding's lookups, and on the head's stage the logits' all-gather
//       ((T-1) b t V/T x 4) and its input gradient's all-reduce; an all-reduce
//       counts 2 (T-1)/T of its buffer (the ring);
//   tp in the grid modes (no sp; m = b t / (q d) this rank's tokens, M the
//       microbatches: the weights' terms come once per microbatch), per
//       layer, elements x 4:
//       2d/2.5d (q x q x d) a Linear(in, out): SUMMA's broadcasts forward
//         and backward and its two reduce-scatters, 3 (q-1) (X + W) with
//         X = m in/q and W = (out/q)(in/q) (Note [SUMMA]), M times its
//         gradient's all-reduce over the depth, 2 (d-1)/d W, and M times
//         the bias's over the batch group, 2 (qd-1)/(qd) out/q; a LayerNorm
//         four all-reduces of m statistics along the row, 2 (q-1)/q m each,
//         and M times its weight's and bias's over the batch group; the
//         token table the ids' all-gather ((q-1) 2m words) and the rows'
//         reduce-scatter and its backward, 2 (q-1) m D/q, plus M depth
//         all-reduces of the table's (V/q)(D/q); the position table an
//         all-gather and a reduce-scatter of (q-1) t D/q^2 a microbatch, plus
//         its depth all-reduce; the head's logits gathered over the batch
//         group, (qd-1) m V/q, then along the row, (q-1) b t V/q;
//       3d (c x c x c) a Linear(in, out): 2 (c-1) (X + W + Y), X = b t/c^2
//         in/c, W = out/c^2 in/c (M times), Y = b t/c^2 out/c (Note [3D
//         linear]), and the bias's all-reduce over a plane (c^2 ranks); a
//         LayerNorm four all-reduces of b t/c^2 statistics along an axis and
//         M times its parameters' over a plane; each table all-gathered over
//         a plane and reduce-scattered back, 2 (c^2-1) rows D/c^3 a
//         microbatch; the logits gathered over the plane, (c^2-1) b t/c^2
//         V/c, then the axis, (c-1) b t V/c;
//   sp  per block, in units of one local q (b x heads/T x t x head_dim x 4):
//       Ulysses 8 (S-1)/S, ring self-attention 4 (S-1), ring attention 6 S - 4
//       (bench sequence's derivation);
//   dp  the replica group's gradients: ZeRO 0 an all-reduce of G, 1 and the
//       parameters' all-gather after the step, 2 a reduce-scatter and the
//       all-gather, 3 a reduce-scatter and each parameter chunk gathered once
//       (kept from forward to backward while the device holds it) ((R-1)/R G
//       each). When dp is 1 the replica group is the sequence group, and these
//       bytes count on sp.
// Activations: the peak of this rank's non-model memory during a step above
// where it began (the engine's CPU counter, parallel/memory_counter.h: every
// LibTorch allocation outside the chunks), beside what autograd saves for
// backward, in fp32, per microbatch of mb = b / microbatches sequences and
// per block: mb t d (4 + 12/T) (the norms' inputs and outputs, q k v, the
// attention output, the MLP's two inner activations, those of qkv and the
// MLP split over tp) plus mb (heads/T) t c for the attention weights (c the
// keys each query sees: the context, or t for ring attention's blocks), and
// on the head's stage mb t (2 d + 2 V) (the final norm, the logits and their
// log-softmax); in the grid modes every activation of a block is split over
// the T ranks, mb t d 16/T plus mb heads t^2/T (3d: its linears keep their
// inputs gathered over an axis, mb t 7d (1/c^2 - 1/T) more, and their
// weights, 12 d^2/c^2), and the head's logits are whole on every rank,
// mb t (2 d/T + 2 V); times the microbatches in flight on this rank (1f1b: p - r,
// at most the microbatches). The measured peak exceeds it by the transient
// buffers of backward (each operator's input gradients while its output's
// are alive) and the collectives' host copies.
// Model state: what this rank's tiers hold between steps, beside 12 bytes
// per parameter it trains (fp32 parameter and AdamW's two moments; the
// gradients are released after each step), the moments sharded over R at
// ZeRO 1 and 2, everything at ZeRO 3. Measured bytes exceed the prediction by
// chunk padding, the small agreements (shapes, flags, norms, rounds) and, at
// ZeRO 3 under a tight device budget, re-gathers.
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "commands.h"
#include "counting_communicator.h"
#include "gpt_model.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/memory_counter.h"
#include "strata/parallel/parallelize.h"
#include "strata/parallel/pipeline.h"
#include "strata/parallel/plan.h"
#include "strata/parallel/trainer.h"

namespace strata::tools {
namespace {

namespace sp = parallel;

struct HybridBenchOptions {
  int dim = 64, layers = 4, heads = 4, context = 32, batch = 8, steps = 3, zero_stage = 1;
  std::string sp_mode = "ring-attention";
  /// Tensor modes laid out where the tensor size forms their grid (1d always).
  std::vector<std::string> tp_modes = {"1d", "2d", "2.5d", "3d"};
  bool json = false;
};

enum Axis { kDp = 0, kPp = 1, kTp = 2, kSp = 3, kOther = 4 };
constexpr const char* kAxisNames[] = {"dp", "pp", "tp", "sp", "other"};

// The world, with every mesh group it splits counting into its axis's
// totals (by the mesh's group names, Note [Device mesh]); groups split from
// those count into the same.
struct AxisCounts {
  explicit AxisCounts(sp::Communicator& inner) : world(inner) {
    for (auto& c : counts) c = std::make_shared<CountingCommunicator::Counts>();
    world.counts_for_split = [this](const std::string& name) {
      for (int a : {kDp, kPp, kTp, kSp}) {  // "mesh-dp-" also names the replica group ("mesh-dp-sp-")
        if (name.rfind(fmt::format("mesh-{}-", kAxisNames[a]), 0) == 0) return counts[a];
      }
      return counts[kOther];
    };
  }
  /// Bytes sent on each axis since the last take().
  std::array<uint64_t, 5> take() {
    std::array<uint64_t, 5> b{};
    for (int a = 0; a < 5; ++a) b[a] = counts[a]->bytes.exchange(0);
    return b;
  }
  std::array<std::shared_ptr<CountingCommunicator::Counts>, 5> counts;
  CountingCommunicator world;
};

// The tensor axis's bytes in the grid modes (the header's formulas): this
// rank's `blocks` blocks, and the embedding's and head's layers where it holds them.
double grid_tp_bytes(const HybridBenchOptions& o, const sp::HybridPlan& p, int blocks, bool embedding, bool head) {
  const double B = o.batch, t = o.context, D = o.dim, V = examples::GptConfig().vocab;
  const double M = p.pp.size > 1 ? p.pp.microbatches : 1;
  const auto all_reduce = [](double n, double elems) { return n > 1 ? 2 * (n - 1) / n * elems : 0.0; };
  std::function<double(double, double, bool)> linear;
  std::function<double()> norm;
  double tables = 0, logits = 0;
  if (p.tp.mode == sp::TensorMode::k3D) {
    const double c = sp::tensor_grid_side(p.tp.mode, p.tp.size), pieces = B * t / (c * c);
    linear = [=](double in, double out, bool bias) {
      return 2 * (c - 1) * (pieces * in / c + M * out / (c * c) * in / c + pieces * out / c) +
             (bias ? M * all_reduce(c * c, out / c) : 0.0);
    };
    norm = [=] { return 4 * all_reduce(c, pieces) + 2 * M * all_reduce(c * c, D / c); };
    tables = M * 2 * (c * c - 1) * (V + t) * D / (c * c * c);
    logits = (c * c - 1) * pieces * V / c + (c - 1) * B * t * V / c;
  } else {
    const double d = p.tp.depth, q = sp::tensor_grid_side(p.tp.mode, p.tp.size, p.tp.depth), m = B * t / (q * d);
    linear = [=](double in, double out, bool bias) {
      const double W = out / q * in / q;
      return 3 * (q - 1) * (m * in / q + M * W) + M * all_reduce(d, W) + (bias ? M * all_reduce(q * d, out / q) : 0.0);
    };
    norm = [=] { return 4 * all_reduce(q, m) + 2 * M * all_reduce(q * d, D / q); };
    tables = (q - 1) * 2 * m + 2 * (q - 1) * m * D / q + M * all_reduce(d, V / q * D / q) +
             M * (2 * (q - 1) * t * D / (q * q) + all_reduce(d, t * D / (q * q)));
    logits = (q * d - 1) * m * V / q + (q - 1) * B * t * V / q;
  }
  const double block = 2 * norm() + linear(D, 3 * D, true) + linear(D, D, true) + linear(D, 4 * D, true) +
                       linear(4 * D, D, true);
  return 4 * (blocks * block + (embedding ? tables : 0.0) + (head ? norm() + linear(D, V, false) + logits : 0.0));
}

// What the layout predicts for this rank (the header's formulas): its
// layers [first, last] of the model as layers (0 the embedding, 1..L the
// blocks, L+1 the head), whether they begin and end the model.
std::array<double, 5> predicted_bytes(const HybridBenchOptions& o, const sp::HybridPlan& p, int first, int last,
                                      int64_t params) {
  std::array<double, 5> b{};
  const double T = p.tp.size, S = p.sp.size, R = static_cast<double>(p.dp) * p.sp.size;
  const double t = static_cast<double>(o.context) / S;
  const double A = static_cast<double>(o.batch) * t * o.dim * 4;
  const int blocks = std::min(last, o.layers) - std::max(first, 1) + 1;
  const bool embedding = first == 0, head = last == o.layers + 1;
  // The grid modes send each rank's block of the activation, 1/T of it.
  const double boundary = p.tp.mode == sp::TensorMode::k1D ? A : A / T;
  if (p.pp.size > 1) b[kPp] = (head ? 0.0 : boundary) + (embedding ? 0.0 : boundary);
  if (T > 1 && p.tp.mode != sp::TensorMode::k1D) {
    b[kTp] = grid_tp_bytes(o, p, blocks, embedding, head);
  } else if (T > 1) {
    const double ring = 2 * (T - 1) / T;
    b[kTp] = blocks * 4 * ring * A + (embedding ? ring * A : 0.0) +
             (head ? (T - 1) * o.batch * t * (examples::GptConfig().vocab / T) * 4 + ring * A : 0.0);
  }
  if (S > 1) {
    const double local = static_cast<double>(o.batch) * (o.heads / T) * t * (o.dim / o.heads) * 4;
    const double units = p.sp.mode == sp::sequence::Mode::kUlysses           ? 8 * (S - 1) / S
                         : p.sp.mode == sp::sequence::Mode::kRingSelfAttention ? 4 * (S - 1)
                                                                              : 6 * S - 4;
    b[kSp] = blocks * units * local;
  }
  if (R > 1) {
    const double G = 4.0 * static_cast<double>(params), part = (R - 1) / R * G;
    const double grads = p.zero_stage == 1 ? 3 * part : 2 * part;
    b[p.dp > 1 ? kDp : kSp] += grads;
  }
  return b;
}

// What autograd keeps for backward on this rank at the step's peak (the header's formula).
double predicted_activations(const HybridBenchOptions& o, const sp::HybridPlan& p, int first, int last, int pipe_rank) {
  const double T = p.tp.size, S = p.sp.size;
  const double m = p.pp.size > 1 ? p.pp.microbatches : 1;
  const double mb = o.batch / m, t = static_cast<double>(o.context) / S, d = o.dim;
  const double keys = p.sp.mode == sp::sequence::Mode::kRingAttention && S > 1 ? t : o.context;
  const int blocks = std::min(last, o.layers) - std::max(first, 1) + 1;
  const bool head = last == o.layers + 1;
  const double V = examples::GptConfig().vocab;
  const bool grid = T > 1 && p.tp.mode != sp::TensorMode::k1D;
  double per_block = grid ? (mb * t * d * 16 + mb * o.heads * t * keys) / T
                          : mb * t * d * (4 + 12 / T) + mb * (o.heads / T) * t * keys;
  if (grid && p.tp.mode == sp::TensorMode::k3D) {  // the linears keep their gathered inputs and weights
    const double c = sp::tensor_grid_side(p.tp.mode, p.tp.size);
    per_block += mb * t * 7 * d * (1 / (c * c) - 1 / T) + 12 * d * d / (c * c);
  }
  const double per_mb = 4 * (blocks * per_block + (head ? mb * t * ((grid ? 2 * d / T : 2 * d) + 2 * V) : 0.0));
  const double in_flight = p.pp.size > 1 ? std::min(m, static_cast<double>(p.pp.size - pipe_rank)) : 1.0;
  return per_mb * in_flight;
}

// Between steps (the gradients are released after each step).
double predicted_state(const sp::HybridPlan& p, int64_t params) {
  const double R = static_cast<double>(p.dp) * p.sp.size, P = static_cast<double>(params);
  switch (p.zero_stage) {
    case 0: return 12 * P;             // the parameter and AdamW's two moments
    case 1: case 2: return 4 * P + 8 * P / R;  // the moments sharded
    default: return 12 * P / R;        // and the parameter
  }
}

struct Layout {
  std::array<int, 4> dims;  // dp, pp, tp, sp
  sp::TensorMode mode = sp::TensorMode::k1D;
  int depth = 1;
  std::string name() const {
    std::string n = fmt::format("{}x{}x{}x{}", dims[0], dims[1], dims[2], dims[3]);
    if (mode != sp::TensorMode::k1D) n += fmt::format(" {}", sp::tensor_mode_name(mode));
    if (depth > 1) n += fmt::format("/{}", depth);
    return n;
  }
};

// Every power-of-two layout of `world` ranks, data axis last to vary; the
// tensor axis in each of `modes` whose grid its size forms (1d always; the
// grid modes without sequence parallelism, which they refuse).
std::vector<Layout> layouts(int world, const std::vector<std::string>& modes) {
  std::vector<Layout> out;
  const auto wanted = [&](const char* m) { return std::find(modes.begin(), modes.end(), m) != modes.end(); };
  for (int pp = 1; pp <= world; pp *= 2) {
    for (int tp = 1; pp * tp <= world; tp *= 2) {
      for (int sq = 1; pp * tp * sq <= world; sq *= 2) {
        if (world % (pp * tp * sq) != 0) continue;
        const std::array<int, 4> dims = {world / (pp * tp * sq), pp, tp, sq};
        if (wanted("1d") || tp == 1) out.push_back({dims});
        if (tp == 1 || sq > 1) continue;
        if (wanted("2d") && sp::tensor_grid_side(sp::TensorMode::k2D, tp) > 1) out.push_back({dims, sp::TensorMode::k2D});
        for (int depth = 2; depth < tp && wanted("2.5d"); depth *= 2) {
          if (sp::tensor_grid_side(sp::TensorMode::k2_5D, tp, depth) > 1) out.push_back({dims, sp::TensorMode::k2_5D, depth});
        }
        if (wanted("3d") && sp::tensor_grid_side(sp::TensorMode::k3D, tp) > 1) out.push_back({dims, sp::TensorMode::k3D});
      }
    }
  }
  return out;
}

examples::GptConfig model_config(const HybridBenchOptions& o) {
  examples::GptConfig c;
  c.dim = o.dim;
  c.layers = o.layers;
  c.heads = o.heads;
  c.context = o.context;
  return c;
}

// One process on every replica's batch: plain LibTorch AdamW on the model as layers.
double one_process_step(const HybridBenchOptions& o, int replicas) {
  torch::manual_seed(0);
  torch::nn::Sequential model = examples::gpt_layers(model_config(o));
  torch::optim::AdamW adamw(examples::unique_parameters(*model), torch::optim::AdamWOptions(1e-3));
  const torch::Tensor x = torch::randint(0, 256, {o.batch * replicas, o.context});
  std::vector<double> t;
  for (int s = 0; s <= o.steps; ++s) {
    const double secs = seconds([&] {
      adamw.zero_grad();
      examples::gpt_loss(model->forward(x), x).backward();
      adamw.step();
    });
    if (s > 0) t.push_back(secs);
  }
  return median(t);
}

void run_hybrid_bench(const HybridBenchOptions& o) {
  std::shared_ptr<sp::Communicator> world = sp::make_gloo_communicator(sp::Rendezvous::from_env());
  const int rank = world->rank(), n = world->world_size();
  const sp::ModelShape shape{o.dim, o.heads, o.context, o.layers + 2};
  nlohmann::json rows = nlohmann::json::array();
  if (rank == 0 && !o.json) {
    fmt::print("strata bench hybrid: GPT dim {} x {} layers, {} heads, context {}, batch {} per replica, ZeRO {}, {} "
               "ranks; per step, the rank that sends most on each axis: measured / predicted\n",
               o.dim, o.layers, o.heads, o.context, o.batch, o.zero_stage, n);
    fmt::print("{:<22} {:>19} {:>19} {:>19} {:>19} {:>21} {:>21} {:>9} {:>9}\n", "layout", "dp", "pp", "tp", "sp",
               "state/rank", "activations/rank", "step ms", "1 proc");
  }
  for (const Layout& layout : layouts(n, o.tp_modes)) {
    const std::array<int, 4>& dims = layout.dims;
    sp::HybridPlan plan;
    plan.dp = dims[0];
    plan.zero_stage = o.zero_stage;
    plan.pp.size = dims[1];
    plan.pp.microbatches = std::min(2 * dims[1], o.batch);  // each microbatch a sequence at least
    plan.tp.size = dims[2];
    plan.tp.mode = layout.mode;
    plan.tp.depth = layout.depth;
    plan.sp.size = dims[3];
    plan.sp.mode = sp::sequence::parse_mode(o.sp_mode);
    examples::GptConfig mc = model_config(o);
    if (plan.tp.size > 1) plan.tp.layers = examples::gpt_layers_tensor_parallel_plan(mc);
    try {
      plan = plan.validated(n, shape);
    } catch (const Error& e) {
      if (rank == 0 && !o.json) fmt::print("{:<22} does not fit: {}\n", layout.name(), e.what());
      continue;  // the same refusal on every rank
    }
    AxisCounts counting(*world);
    sp::DeviceMesh mesh = sp::DeviceMesh::create(counting.world, plan.dims());
    if (plan.sp.size > 1) mc.sequence_attention = sp::sequence_attention(mesh, plan);
    torch::manual_seed(0);
    torch::nn::Sequential layers = examples::gpt_layers(mc);
    int64_t full = 0;
    for (const auto& p : layers->parameters()) full += p.numel();
    sp::EngineOptions eo;
    eo.budgets = {static_cast<uint64_t>(full) * 64 + (16u << 20), static_cast<uint64_t>(full) * 64 + (16u << 20), 0};
    sp::AdamWConfig adamw;
    sp::Trainer trainer(layers, mesh, plan, sp::OptimizerConfig::from(adamw), eo, shape);
    int first = 0, last = o.layers + 1;
    if (auto* pipe = trainer.pipeline()) {
      first = pipe->boundaries()[pipe->stages().front()];
      last = pipe->boundaries()[pipe->stages().back() + 1] - 1;
    }
    torch::manual_seed(1 + mesh.coord(sp::DeviceMesh::kData));
    const torch::Tensor x = torch::randint(0, 256, {o.batch, o.context});
    std::vector<double> times;
    std::array<double, 5> sent{};
    sp::NonModelCounter& memory = sp::cpu_non_model_counter();
    double activations = 0;
    for (int s = 0; s <= o.steps; ++s) {
      counting.take();
      const uint64_t before = memory.current();
      memory.reset_peak();
      const double secs = seconds([&] { trainer.step(x, x, examples::gpt_loss); });
      const uint64_t peak = memory.peak();
      const auto b = counting.take();
      if (s == 0) continue;  // warm-up: the first step agrees shapes and plans
      activations = std::max(activations, peak > before ? static_cast<double>(peak - before) : 0.0);
      times.push_back(secs);
      for (int a = 0; a < 5; ++a) sent[a] += static_cast<double>(b[a]) / o.steps;
    }
    const sp::RankReport report = trainer.report();
    const auto want = predicted_bytes(o, plan, first, last, report.parameters);
    const double state_want = predicted_state(plan, report.parameters);
    const double act_want = predicted_activations(o, plan, first, last, mesh.coord(sp::DeviceMesh::kPipeline));
    // Every rank's figures to rank 0: per axis the rank that sends most.
    std::vector<double> mine = {median(times), static_cast<double>(report.held_bytes), state_want, activations, act_want};
    for (int a = 0; a < 4; ++a) {
      mine.push_back(sent[a]);
      mine.push_back(want[a]);
    }
    const std::vector<double> all = sp::all_gather_values(*world, mine);
    const size_t k = mine.size();
    double step = 0, state = 0, state_pred = 0, act = 0, act_pred = 0;
    std::array<double, 4> axis{}, axis_pred{};
    for (int r = 0; r < n; ++r) {
      const double* v = &all[r * k];
      step = std::max(step, v[0]);
      if (v[1] > state) {
        state = v[1];
        state_pred = v[2];
      }
      if (v[3] >= act) {
        act = v[3];
        act_pred = v[4];
      }
      for (int a = 0; a < 4; ++a) {
        if (v[5 + 2 * a] >= axis[a]) {
          axis[a] = v[5 + 2 * a];
          axis_pred[a] = v[6 + 2 * a];
        }
      }
    }
    const double one = rank == 0 ? one_process_step(o, plan.dp) : 0.0;
    world->barrier()->wait();
    if (rank != 0) continue;
    const std::string name = plan.describe();
    if (o.json) {
      nlohmann::json row = {{"layout", name}, {"dims", plan.dims()}, {"tp_mode", sp::tensor_mode_name(layout.mode)},
                            {"tp_depth", layout.depth}, {"step_seconds", step},
                            {"one_process_seconds", one}, {"model_state_bytes", state},
                            {"predicted_model_state_bytes", state_pred}, {"activation_bytes", act},
                            {"predicted_activation_bytes", act_pred}};
      for (int a = 0; a < 4; ++a) {
        row[std::string(kAxisNames[a]) + "_bytes"] = axis[a];
        row[std::string(kAxisNames[a]) + "_predicted_bytes"] = axis_pred[a];
      }
      rows.push_back(row);
    } else {
      const auto pair = [](double got, double want) {
        return fmt::format("{} / {}", format_bytes(static_cast<uint64_t>(got)), format_bytes(static_cast<uint64_t>(want)));
      };
      fmt::print("{:<22} {:>19} {:>19} {:>19} {:>19} {:>21} {:>21} {:>9.1f} {:>9.1f}\n",
                 layout.name(), pair(axis[0], axis_pred[0]),
                 pair(axis[1], axis_pred[1]), pair(axis[2], axis_pred[2]), pair(axis[3], axis_pred[3]),
                 pair(state, state_pred), pair(act, act_pred), step * 1e3, one * 1e3);
      std::fflush(stdout);
    }
  }
  if (rank == 0 && o.json) fmt::print("{}\n", nlohmann::json{{"ranks", n}, {"layouts", rows}}.dump(2));
}

}  // namespace

void add_bench_hybrid_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("hybrid", "Every dp x pp x tp x sp layout of a GPT: bytes per axis, model state and "
                                             "step time per rank beside the layout's formulas (strata run -n 8)");
  auto o = std::make_shared<HybridBenchOptions>();
  cmd->add_option("--dim", o->dim, "model width");
  cmd->add_option("--layers", o->layers, "transformer blocks");
  cmd->add_option("--heads", o->heads, "attention heads");
  cmd->add_option("--context", o->context, "positions per sequence");
  cmd->add_option("--batch", o->batch, "sequences per replica per step");
  cmd->add_option("--steps", o->steps, "timed steps after a warm-up");
  cmd->add_option("--zero-stage", o->zero_stage, "ZeRO stage over the replica group");
  cmd->add_option("--sp-mode", o->sp_mode, "ring-attention, ulysses or ring-self-attention");
  cmd->add_option("--tp-modes", o->tp_modes, "tensor modes to lay out where the tensor size forms their grid")
      ->delimiter(',')
      ->check(CLI::IsMember({"1d", "2d", "2.5d", "3d"}))
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "print one JSON document (rank 0)");
  cmd->callback([o] { run_hybrid_bench(*o); });
}

}  // namespace strata::tools
