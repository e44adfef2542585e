// gpt: a decoder-only transformer, written with plain LibTorch modules, trained
// on real text by strata with model state several times larger than the
// device budget (emulated device here, a GPU where there is one).
//
//   gpt [--data FILE] [--steps 120] [--layers 4] [--dim 128] [--context 64] [--batch 16]
//       [--device-budget B] [--host-budget B] [--nvme-budget B] [--nvme-dir DIR]
//       [--precision fp32|bf16|fp16] [--grad-accumulation N] [--clip-norm 1] [--update-in-backward]
//       [--nvme-optim-fraction F] [--chunk-elems N] [--lr 3e-3] [--optimizer adamw|adam|lion|sgd]
//       [--weight-decay 0.1] [--warmup N] [--schedule cosine|linear|constant] [--schedule-steps N]
//       [--min-lr-ratio 0.1]
//       [--decay-all] [--baseline]
//       [--save-every N] [--checkpoint-dir DIR] [--resume DIR] [--export-weights FILE]
//       [--export-hf DIR [--export-dtype bf16]]
//       [--zero-stage 0-3] [--pp P [--pp-schedule S] [--microbatches M] [--virtual-stages V]]
//       [--tp T [--tp-mode 1d|2d|2.5d|3d] [--sequence-parallel]] [--sp S [--sp-mode M]] [--config PLAN.json]
//       [--lazy] [--checkpoint-activations | --offload-activations] [--preset 3b] [--sample-tokens 80]
//
// --save-every N saves the full training state to --checkpoint-dir every N
// steps (atomically: the directory always holds one complete checkpoint);
// --resume DIR loads one and continues from its step, with the same data
// order, so an interrupted run resumed finishes as the uninterrupted one.
// --export-weights writes the trained weights as safetensors at the end;
// --export-hf DIR writes one process's weights from any layout in Hugging
// Face's layout (Engine::export_hf).
// The optimizer is AdamW by default, as LLM recipes run it: linear warm-up
// over --warmup steps (a tenth of the schedule by default), then cosine decay
// to --min-lr-ratio of --lr at --schedule-steps (--steps by default; a
// checkpoint keeps the schedule, so --resume continues on it), and no weight decay on biases, norm
// weights and embeddings (--decay-all puts every parameter in one group).
// Every layout is one code path: the model (models/gpt's gpt_layers, the one
// definition) trained through parallel::Trainer under one HybridPlan
// (docs/parallel.md), from a plan file (--config, or STRATA_PLAN) or the
// layout flags: --pp cuts it into P stages (--schedule
// gpipe|1f1b|interleaved-1f1b|zb-h1 or --pp-schedule, --microbatches M),
// --tp T splits it (--tp-mode 1d|2d|2.5d [--tp-depth K]|3d, Megatron's
// --sequence-parallel), --sp S splits each sequence, and under `strata run
// -n N` the ranks the axes leave form the data axis, each replica on batches
// of its own, with --zero-stage sharding optimizer state (1), gradients (2)
// and parameters (3) over them (strata run -n 8 -- gpt --pp 2 --tp 2 --sp 2;
// strata run -n 4 -- gpt --pp 2: dp 2). The output projection is tied to the
// token embedding where the layout allows (tensor mode 1d; under a pipeline
// the first and last stages train tied copies), else a head of its own
// (--untied-head asks for that everywhere).
//
// --lazy constructs the model without memory for its weights (LazyInit), each
// parameter materialised into its chunks at attach; --preset 3b trains a
// 2.9-billion-parameter model that way for 2 steps (docs/scale.md).
//
// The default corpus is Debian's fortunes-min package (/usr/share/games/fortunes),
// read as bytes. Budgets default to 1/4 (device), 1/2 (host) and 2x (nvme) of
// the model state (parameters, gradients, master weights, AdamW state), so
// state streams through all three tiers and the optimizer state of the
// families that do not fit in half the host budget lives on NVMe. Every engine
// option can also come from the environment (STRATA_DEVICE_BUDGET,
// STRATA_PRECISION, ...: EngineOptions::from_env); a flag wins over it.

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fmt/format.h>

#include "gpt_model.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/lazy_init.h"
#include "strata/parallel/pipeline.h"
#include "strata/parallel/plan.h"
#include "strata/parallel/trainer.h"
#include "strata/parallel/sequence_parallel.h"

namespace {

namespace mem = strata::memory;
using strata::examples::GptConfig;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// The tier budgets the flags give; "auto": a quarter (device), half (host)
// and twice (nvme) the model state `state`.
mem::TierBudgets default_budgets(uint64_t state, const std::string& device, const std::string& host,
                                 const std::string& nvme) {
  auto budget = [&](const std::string& s, double fraction) {
    return s == "auto" ? strata::round_up(static_cast<uint64_t>(state * fraction), 4096) : strata::parse_bytes(s);
  };
  return {budget(device, 0.25), budget(host, 0.5), budget(nvme, 2.0)};
}

// This rank's parameters under `plan`: its stages of the balanced cut the
// trainer makes (an even share for a cut of its own), its tensor part of them.
int64_t rank_parameters(torch::nn::Sequential& layers, const strata::parallel::HybridPlan& plan, int pipe_rank) {
  namespace pl = strata::parallel::pipeline;
  int64_t n = 0;
  if (plan.pp.size == 1) {
    n = strata::examples::count_parameters(*layers);
  } else if (plan.pp.boundaries.empty() && plan.pp.trace.empty()) {
    const std::vector<int> cut = pl::partition_balanced(pl::parameter_costs(layers), plan.pp.size * plan.pp.virtual_stages);
    for (int c = 0; c < plan.pp.virtual_stages; ++c) {
      const int s = c * plan.pp.size + pipe_rank;
      for (int i = cut[s]; i < cut[s + 1]; ++i) n += strata::examples::count_parameters(*(layers->begin() + i)->ptr());
    }
  } else {
    n = strata::examples::count_parameters(*layers) / plan.pp.size;
  }
  // A 2.5d grid keeps each weight block on every depth: 1/(q x q) of it.
  return n / (plan.tp.mode == strata::parallel::TensorMode::k2_5D ? plan.tp.size / plan.tp.depth : plan.tp.size);
}

// Everything a run needs besides the plan: the flags, resolved.
struct Run {
  const torch::Tensor& corpus;
  GptConfig mc;
  bool untied_head;
  std::function<strata::parallel::OptimizerConfig(torch::nn::Module&)> optimizer;
  strata::parallel::EngineOptions opts;
  strata::parallel::HybridPlan plan;
  int steps, batch, sample_tokens, save_every;
  bool lazy, print_losses;
  std::string device_budget, host_budget, nvme_budget, nvme_dir, checkpoint_dir, resume, export_weights;
  std::string export_hf, export_dtype;
};

// The model as layers (gpt_layers) trained through a parallel::Trainer under
// one HybridPlan (docs/parallel.md), whatever the layout: one process, the
// data axis, --config FILE or the layout flags (--pp, --tp in any mode,
// --sequence-parallel, --sp, --zero-stage) in any combination; the ranks the
// plan's axes leave form the data axis. Each rank trains its part with
// budgets sized from its own share of the model state.
int train(Run a) {
  namespace sp = strata::parallel;
  const sp::Rendezvous rv = sp::Rendezvous::from_env();
  const sp::ModelShape shape{a.mc.dim, a.mc.heads, a.mc.context, a.mc.layers + 2};
  // The head is tied to the token embedding where the layout allows it: a
  // table a linear layer can use (not a 2D/2.5D/3D one). Under a pipeline
  // the first and last stages each train a copy (Note [Parameters across stages]).
  const bool grid = a.plan.tp.size > 1 && a.plan.tp.mode != sp::TensorMode::k1D;
  a.mc.tied_head = !a.untied_head && !grid;
  if (a.plan.tp.size > 1 && a.plan.tp.layers.empty()) {  // every mode splits by the same module plan
    a.plan.tp.layers = strata::examples::gpt_layers_tensor_parallel_plan(a.mc, a.plan.tp.sequence_parallel);
  }
  const sp::HybridPlan plan = a.plan.validated(rv.world_size, shape);  // before any communicator
  STRATA_CHECK(a.export_weights.empty() || plan.pp.size == 1, "--export-weights with --pp ", plan.pp.size, ": each "
               "stage would write a part of its own; --export-hf DIR writes one process's weights from any layout");
  // Gloo on every machine: the pipeline's links and the example's host-side
  // agreements run on host buffers.
  sp::DeviceMesh mesh = sp::DeviceMesh::create(sp::make_gloo_communicator(rv), plan.dims());
  if (plan.sp.size > 1) a.mc.sequence_attention = sp::sequence_attention(mesh, plan);
  torch::manual_seed(0);
  const auto build_start = std::chrono::steady_clock::now();
  torch::nn::Sequential layers{nullptr};
  if (a.lazy) {
    sp::LazyInit no_memory;  // parameters materialise into their chunks at attach
    layers = strata::examples::gpt_layers(a.mc);
  } else {
    layers = strata::examples::gpt_layers(a.mc);
  }
  const double build_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - build_start).count();
  const int64_t total = strata::examples::count_parameters(*layers);
  const sp::OptimizerConfig cfg = a.optimizer(*layers);
  const int64_t params = rank_parameters(layers, plan, mesh.coord(sp::DeviceMesh::kPipeline));
  const uint64_t state = static_cast<uint64_t>(params) * sp::model_state_bytes_per_param(a.opts.precision, cfg.state_count());
  a.opts.budgets = default_budgets(state, a.device_budget, a.host_budget, a.nvme_budget);
  // Each rank's NVMe tier has files of its own.
  a.opts.nvme_dir = rv.world_size > 1 ? a.nvme_dir + "/rank" + std::to_string(rv.rank) : a.nvme_dir;
  const auto attach_start = std::chrono::steady_clock::now();
  sp::Trainer trainer(layers, mesh, plan, cfg, a.opts, shape);
  const double attach_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - attach_start).count();
  sp::Engine& engine = trainer.engine();
  const bool lead = rv.rank == 0;
  fmt::print("corpus: {} bytes; model: {} layers, dim {}, context {}, {} parameters, {}\n", a.corpus.size(0),
             a.mc.layers, a.mc.dim, a.mc.context, total, strata::dtype_name(a.opts.precision));
  fmt::print("plan {}: rank {} at dp {}, pp {}, tp {}, sp {}; about {} parameters, model state {} on budgets device {}, "
             "host {}, nvme {}; output projection {}\n",
             plan.describe(), rv.rank, mesh.coord(sp::DeviceMesh::kData), mesh.coord(sp::DeviceMesh::kPipeline),
             mesh.coord(sp::DeviceMesh::kTensor), mesh.coord(sp::DeviceMesh::kSequence), params,
             strata::format_bytes(state), strata::format_bytes(a.opts.budgets.device),
             strata::format_bytes(a.opts.budgets.host), strata::format_bytes(a.opts.budgets.nvme),
             a.mc.tied_head ? "tied to the token embedding"
                            : (a.untied_head ? "of its own (--untied-head)"
                                             : "of its own (a grid mode cannot tie it)"));
  if (plan.tp.size > 1) {
    fmt::print("tensor parallel ({}, {} ranks): {} parameters on this rank\n", sp::tensor_mode_name(plan.tp.mode),
               plan.tp.size, trainer.report().parameters);
  }
  fmt::print("constructed {}in {:.1f} s, attached in {:.1f} s\n", a.lazy ? "lazily " : "", build_secs, attach_secs);
  fmt::print("optimizer groups:");
  for (const std::string& g : engine.param_groups()) fmt::print(" {} ({} tensors)", g, engine.group_parameters(g).size());
  fmt::print("\n");
  fmt::print("model state {} (params, grads, master weights, optimizer state) on budgets: device {} ({:.1f}x smaller, "
             "{}), host {}, nvme {} in {}; optimizer state of {} of {} chunk families on nvme\n",
             strata::format_bytes(state), strata::format_bytes(a.opts.budgets.device),
             static_cast<double>(state) / a.opts.budgets.device, engine.chunks().device().name(),
             strata::format_bytes(a.opts.budgets.host), strata::format_bytes(a.opts.budgets.nvme), a.opts.nvme_dir,
             engine.nvme_optim_families(), engine.num_families());
  // Each replica its own batches, the same on all its ranks; one replica
  // draws what one process draws.
  torch::manual_seed(1 + mesh.coord(sp::DeviceMesh::kData));
  int first_step = 1;
  if (!a.resume.empty()) {
    trainer.load(a.resume);  // the data order too: each rank's RNG state
    first_step = static_cast<int>(engine.micro_steps()) + 1;
    STRATA_CHECK(first_step <= a.steps, "--resume ", a.resume, " is at step ", first_step - 1, ", already past --steps ",
                 a.steps, "; give a larger --steps to train on");
    fmt::print("resumed from {} at step {}\n", a.resume, first_step);
  }
  const bool tty = isatty(STDOUT_FILENO);
  const auto start = std::chrono::steady_clock::now();
  double first = 0, avg = 0, last = 0;
  for (int step = first_step; step <= a.steps; ++step) {
    const auto [x, y] = strata::examples::sample_batch(a.corpus, a.batch, a.mc.context);
    const sp::StepResult r = trainer.step(x, y, strata::examples::gpt_loss);
    double loss = r.loss;  // the replica's; averaged over the replicas for the log
    if (plan.dp > 1) {
      const std::vector<double> all = sp::all_gather_values(*mesh.group(sp::DeviceMesh::kData), {r.loss});
      loss = 0;
      for (double l : all) loss += l / static_cast<double>(all.size());
    }
    if (a.print_losses && lead) fmt::print("step {} loss {:.8g}\n", step, loss);
    if (step == first_step) first = avg = loss;
    last = r.loss;
    if (a.save_every > 0 && step % a.save_every == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      trainer.save(a.checkpoint_dir);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!tty) fmt::print("saved step {} to {} in {:.2f} s\n", step, a.checkpoint_dir, secs);
    }
    avg = 0.95 * avg + 0.05 * loss;
    if (tty || step % 25 == 0 || step == a.steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const mem::MoveStats m = engine.chunks().move_stats();
      auto moved = [&](mem::Tier from, mem::Tier to) { return strata::format_bytes(m.bytes[int(from)][int(to)]); };
      const int width = 24, done = width * step / a.steps;
      fmt::print("{}[{}{}] step {}/{} loss {:.3f} lr {:.2e} tok/s {:.0f} (all replicas){} | h>d {} d>h {} h>n {} n>h {} "
                 "n>d {}{}",
                 tty ? "\r" : "", std::string(done, '#'), std::string(width - done, '.'), step, a.steps, avg,
                 engine.lr(), (step - first_step + 1) * a.batch * a.mc.context * plan.dp / secs,
                 a.opts.precision == strata::DType::kFloat16 ? fmt::format(" scale {:g}", engine.loss_scale()) : "",
                 moved(mem::Tier::kHost, mem::Tier::kDevice), moved(mem::Tier::kDevice, mem::Tier::kHost),
                 moved(mem::Tier::kHost, mem::Tier::kNvme), moved(mem::Tier::kNvme, mem::Tier::kHost),
                 moved(mem::Tier::kNvme, mem::Tier::kDevice), tty ? "   " : "\n");
      std::fflush(stdout);
    }
  }
  if (tty) fmt::print("\n");
  for (mem::Tier t : {mem::Tier::kDevice, mem::Tier::kHost, mem::Tier::kNvme}) {
    const mem::TierStats s = engine.chunks().tier_stats(t);
    fmt::print("{:<7} peak {} of budget {}\n", mem::tier_name(t), strata::format_bytes(s.peak),
               strata::format_bytes(s.budget));
  }
  fmt::print("{}\n", trainer.report().describe());
  fmt::print("loss {:.3f} -> {:.3f} over {} steps; last step's loss {:.6f}\n", first, avg, a.steps - first_step + 1,
             last);
  if (!a.export_weights.empty()) {
    engine.export_weights(a.export_weights);
    if (lead) fmt::print("weights written to {} (safetensors)\n", a.export_weights);
  }
  if (!a.export_hf.empty()) {
    engine.export_hf(a.export_hf, 5000000000ull, strata::parse_dtype(a.export_dtype));
    if (lead) fmt::print("weights written to {} (Hugging Face's layout, {})\n", a.export_hf, a.export_dtype);
  }
  // Sample a line from the trained model where one rank holds whole
  // sequences and whole batches: not under sequence parallelism (Megatron's
  // or --sp), a pipeline, or a grid mode, whose batch blocks a batch of one
  // cannot fill.
  if (plan.sp.size == 1 && plan.pp.size == 1 && !plan.tp.sequence_parallel && !grid && a.sample_tokens > 0) {
    torch::Tensor idx = a.corpus.slice(0, 0, 8).unsqueeze(0);
    for (int i = 0; i < a.sample_tokens; ++i) {
      const torch::Tensor ctx = idx.slice(1, std::max<int64_t>(0, idx.size(1) - a.mc.context));
      const torch::Tensor logits = trainer.evaluate(ctx).select(1, -1).to(torch::kCPU, torch::kFloat32);
      idx = torch::cat({idx, torch::multinomial(torch::softmax(logits, -1), 1)}, 1);
    }
    std::string sample;
    for (int64_t i = 0; i < idx.size(1); ++i) {
      // Printable ASCII as it is, newlines and tabs as spaces, any other byte as
      // '?': never raw control bytes or invalid UTF-8 on the terminal.
      const int64_t c = idx[0][i].item<int64_t>();
      sample += c == '\n' || c == '\t' ? ' ' : (c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?');
    }
    fmt::print("sample: {}\n", sample);
  }
  // Fewer than 3 steps measure (--preset 3b); from 3 the loss must fall.
  if (a.steps - first_step + 1 >= 3 && !(avg < first)) {
    std::fprintf(stderr, "gpt: the smoothed loss did not fall (%.3f -> %.3f over %d steps); exit status 1\n", first,
                 avg, a.steps - first_step + 1);
    return 1;
  }
  return 0;
}

int run(int argc, char** argv) {
  int steps = 120, batch = 16;
  GptConfig mc;
  double lr = 3e-3, weight_decay = 0.1, min_lr_ratio = 0.1;
  int warmup = -1, schedule_steps = 0;
  std::string optimizer = "adamw", schedule = "cosine";
  bool decay_all = false;
  int pp = 1, microbatches = 0, virtual_stages = 1, seq_ranks = 1, tp = 1;
  std::string sp_mode = "ring-attention", tp_mode = "1d";
  bool print_losses = false, untied_head = false;
  std::string pp_schedule = "1f1b";
  // Engine options: the environment first, flags over it.
  strata::parallel::EngineOptions defaults;
  defaults.clip_norm = 1.0;
  defaults.budgets = {1, 1, 0};  // placeholders: "auto" below sizes them from the model
  strata::parallel::EngineOptions opts = strata::parallel::EngineOptions::from_env(defaults);
  std::string precision = strata::dtype_name(opts.precision);
  std::string data, device_budget = env_or("STRATA_DEVICE_BUDGET", "auto"),
                    host_budget = env_or("STRATA_HOST_BUDGET", "auto"),
                    nvme_budget = env_or("STRATA_NVME_BUDGET", "auto"),
                    nvme_dir = env_or("STRATA_NVME_DIR", "/tmp/strata-gpt-nvme");
  CLI::App app{"Train a small GPT on text with strata"};
  app.option_defaults()->always_capture_default();
  const CLI::Validator finite_number(
      [](std::string& s) {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        return end != s.c_str() && std::isfinite(v) ? std::string() : std::string("must be a finite number");
      },
      "FINITE");
  app.add_option("--data", data, "text file (default: Debian's fortunes-min corpus)");
  app.add_option("--steps", steps, "training steps (optimizer steps times --grad-accumulation)")->check(CLI::PositiveNumber);
  app.add_option("--layers", mc.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--dim", mc.dim, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", mc.heads, "attention heads (divides --dim)")->check(CLI::PositiveNumber);
  app.add_option("--context", mc.context, "tokens (bytes) per sequence")->check(CLI::PositiveNumber);
  app.add_flag("--checkpoint-activations", mc.checkpoint_blocks,
               "recompute each block's activations in backward instead of keeping them (activation checkpointing)");
  app.add_flag("--offload-activations", mc.offload_blocks,
               "keep each block's saved activations in host memory until its backward (activation offload)");
  app.add_option("--batch", batch, "sequences per step")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "peak learning rate")->check(CLI::NonNegativeNumber & finite_number);
  app.add_option("--optimizer", optimizer, "adamw, adam, lion or sgd")
      ->check(CLI::IsMember({"adamw", "adam", "lion", "sgd"}));
  app.add_option("--weight-decay", weight_decay, "weight decay of the decayed group")->check(CLI::NonNegativeNumber & finite_number);
  app.add_option("--warmup", warmup, "linear warm-up steps; -1: a tenth of --steps")->check(CLI::Range(-1, 1 << 30));
  app.add_option("--schedule", schedule,
                 "decay after warm-up: cosine, linear or constant; or, with --pp, the pipeline schedule "
                 "(gpipe, 1f1b, interleaved-1f1b, zb-h1; as --pp-schedule)")
      ->check(CLI::IsMember({"cosine", "linear", "constant", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}));
  std::string config;
  app.add_option("--config", config, "the layout as a plan file (docs/parallel.md: dp, zero_stage, pipeline, tensor, "
                 "sequence); STRATA_PLAN names one too. Trains the model as layers through parallel::Trainer");
  app.add_option("--pp", pp, "pipeline stages (ranks of strata run -n divided by --pp form the data axis)")
      ->check(CLI::PositiveNumber);
  app.add_option("--pp-schedule", pp_schedule, "pipeline schedule: gpipe, 1f1b, interleaved-1f1b or zb-h1")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}));
  app.add_option("--microbatches", microbatches, "microbatches per pipeline step; 0: twice --pp")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--virtual-stages", virtual_stages, "model chunks per rank (interleaved-1f1b)")
      ->check(CLI::PositiveNumber);
  app.add_option("--sp", seq_ranks, "sequence-parallel ranks: each holds --context / --sp positions of every sequence "
                 "(ranks of strata run -n beyond --sp form the data axis)")
      ->check(CLI::PositiveNumber);
  app.add_option("--sp-mode", sp_mode, "sequence-parallel attention: ring-attention (zigzag layout), ulysses or "
                 "ring-self-attention")
      ->check(CLI::IsMember({"ring-attention", "ulysses", "ring-self-attention"}));
  app.add_option("--tp", tp, "tensor-parallel ranks: each holds 1/--tp of every block's weights and of the vocabulary "
                 "(ranks of strata run -n beyond --tp form the data axis)")
      ->check(CLI::PositiveNumber);
  int tp_depth = 2;
  app.add_option("--tp-mode", tp_mode, "tensor parallelism: 1d (Megatron's split), 2d (SUMMA over a q x q grid), "
                 "2.5d (Tesseract, q x q x --tp-depth) or 3d (a d x d x d cube); 2d, 2.5d and 3d split the model as "
                 "layers through the plan (an output projection of its own), with --pp too")
      ->check(CLI::IsMember({"1d", "2d", "2.5d", "3d"}));
  app.add_option("--tp-depth", tp_depth, "2.5d: the grid's depth")->check(CLI::PositiveNumber);
  bool tp_sequence = false;
  app.add_flag("--sequence-parallel", tp_sequence, "with --tp-mode 1d: Megatron's sequence parallelism, the norms and "
               "the residual stream on 1/--tp of the positions each");
  app.add_flag("--untied-head", untied_head, "an output projection of its own, not the token embedding (as the "
               "model as layers has)");
  app.add_flag("--print-losses", print_losses, "print every step's loss (averaged over the ranks) with 8 digits");
  app.add_option("--schedule-steps", schedule_steps,
                 "the schedule's length in steps; 0: --steps (set it to stop early and --resume later on the same schedule)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--min-lr-ratio", min_lr_ratio, "the decay ends at this fraction of --lr")->check(CLI::Range(0.0, 1.0));
  app.add_flag("--decay-all", decay_all, "weight decay on every parameter (default: none on biases, norms, embeddings)");
  app.add_option("--device-budget", device_budget, "auto: a quarter of the model state");
  app.add_option("--host-budget", host_budget, "auto: half of the model state");
  app.add_option("--nvme-budget", nvme_budget, "auto: twice the model state; 0: no nvme tier");
  app.add_option("--nvme-dir", nvme_dir, "directory for the NVMe tier's files");
  app.add_option("--precision", precision, "fp32, bf16 or fp16 (fp16 with dynamic loss scaling)");
  app.add_option("--grad-accumulation", opts.grad_accumulation, "micro-steps per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--clip-norm", opts.clip_norm, "global grad-norm clipping; 0: none");
  app.add_flag("--update-in-backward", opts.update_in_backward,
               "update each chunk family in backward as soon as its gradients are final (docs/scale.md): exact "
               "without clipping; with --clip-norm, relaxed: clipped by the norm as far as backward knows it");
  app.add_option("--nvme-optim-fraction", opts.nvme_optim_fraction,
                 "fraction of chunk families whose optimizer state lives on NVMe; -1: auto");
  app.add_option("--chunk-elems", opts.chunk_elems, "elements per chunk; 0: auto");
  app.add_option("--zero-stage", opts.zero_stage,
                 "under strata run -n N: 0 data parallel, 1 shard optimizer state, 2 and gradients, 3 and parameters")
      ->check(CLI::Range(0, 3));
  int save_every = 0;
  std::string checkpoint_dir = "gpt-checkpoint", resume, export_weights;
  app.add_option("--save-every", save_every, "save a checkpoint every N steps to --checkpoint-dir; 0: never")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-dir", checkpoint_dir, "where --save-every saves (replaced atomically each time)");
  app.add_option("--resume", resume, "load this checkpoint and continue from its step");
  app.add_option("--export-weights", export_weights, "write the trained weights here as safetensors at the end");
  std::string export_hf, export_dtype = "fp32";
  app.add_option("--export-hf", export_hf, "write one process's weights here at the end, from any layout, in Hugging "
                 "Face's layout (sharded safetensors and model.safetensors.index.json)");
  app.add_option("--export-dtype", export_dtype, "--export-hf's dtype: fp32, bf16 or fp16");
  bool baseline = false, lazy = false;
  std::string preset;
  int sample_tokens = 80;
  app.add_option("--preset", preset, "3b: a 2.9-billion-parameter GPT (26 layers, dim 3072, 24 heads; 46 GB of fp32 "
                 "model state), built lazily, checkpointing every block, on budgets device 1GiB, host 12GiB, nvme "
                 "40GiB, for 2 steps of 1 x 64 tokens (docs/scale.md); flags given as well override it")
      ->check(CLI::IsMember({"3b"}));
  app.add_flag("--lazy", lazy, "construct the model lazily (strata::parallel::LazyInit): no parameter takes memory "
               "until attach materialises it into its chunks");
  app.add_option("--sample-tokens", sample_tokens, "bytes to sample from the trained model at the end; 0: none")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--baseline", baseline, "train with plain LibTorch and torch::optim::AdamW instead (for comparison)");
  CLI11_PARSE(app, argc, argv);
  if (preset == "3b") {
    // Flags given explicitly win over the preset's values.
    const auto unless_given = [&](const char* flag, auto& value, auto preset_value) {
      if (app.count(flag) == 0) value = preset_value;
    };
    unless_given("--layers", mc.layers, 26);
    unless_given("--dim", mc.dim, 3072);
    unless_given("--heads", mc.heads, 24);
    unless_given("--context", mc.context, 64);
    unless_given("--batch", batch, 1);
    unless_given("--steps", steps, 2);
    unless_given("--lr", lr, 3e-4);
    unless_given("--sample-tokens", sample_tokens, 0);
    if (app.count("--device-budget") == 0 && std::getenv("STRATA_DEVICE_BUDGET") == nullptr) device_budget = "1GiB";
    if (app.count("--host-budget") == 0 && std::getenv("STRATA_HOST_BUDGET") == nullptr) host_budget = "12GiB";
    if (app.count("--nvme-budget") == 0 && std::getenv("STRATA_NVME_BUDGET") == nullptr) nvme_budget = "40GiB";
    mc.checkpoint_blocks = true;
    lazy = true;
  }
  STRATA_CHECK(!(mc.checkpoint_blocks && mc.offload_blocks), "--checkpoint-activations and --offload-activations: "
               "a checkpointed block keeps nothing to offload; choose one");
  STRATA_CHECK(!lazy || !baseline, "--lazy with --baseline: plain LibTorch needs the whole model in memory; drop one");
  if (schedule != "cosine" && schedule != "linear" && schedule != "constant") {
    pp_schedule = schedule;  // a pipeline schedule given as --schedule
    schedule = "cosine";
  }
  if (microbatches == 0) microbatches = 2 * pp;
  if (pp_schedule == "interleaved-1f1b" && virtual_stages == 1) virtual_stages = 2;
  opts.precision = strata::parse_dtype(precision);
  if (opts.precision == strata::DType::kFloat16 && !torch::cuda::is_available()) {
    // Debian's LibTorch 1.13 has almost no fp16 CPU kernels (docs/engine.md):
    // say so before building anything, not with a LibTorch backtrace mid-step.
    try {
      const torch::Tensor h = torch::ones({2, 2}, torch::kHalf);
      torch::softmax(torch::addmm(h, h, h), -1);
    } catch (const std::exception&) {
      STRATA_FAIL("--precision fp16 needs fp16 matrix and softmax kernels on the CPU, which this LibTorch (",
                  TORCH_VERSION, ") lacks; use --precision bf16, or a LibTorch 2.x or GPU build for fp16");
    }
  }
  // Paths the run will write: checked now, not after the training they would end.
  if (save_every > 0) strata::parallel::Engine::check_save_target(checkpoint_dir);
  if (!export_hf.empty()) strata::parallel::Engine::check_save_target(export_hf);  // a directory replaced as a checkpoint's
  if (!export_weights.empty()) strata::parallel::Engine::check_export_target(export_weights);
  mc.vocab = 256;

  const torch::Tensor corpus = strata::examples::load_corpus(data);
  namespace sp = strata::parallel;
  if (schedule_steps == 0) schedule_steps = steps;
  if (warmup < 0) warmup = schedule_steps / 10;
  warmup = std::min(warmup, schedule_steps);
  // The optimizer for a model's parameters: groups by its names.
  const auto make_optimizer = [&](torch::nn::Module& m) {
    sp::OptimizerConfig cfg;
    cfg.kind = sp::parse_optimizer(optimizer);
    cfg.lr = lr;
    cfg.weight_decay = weight_decay;
    if (cfg.kind == sp::OptimizerKind::kLion) cfg.beta2 = 0.99;
    if (cfg.kind == sp::OptimizerKind::kSgd) cfg.momentum = 0.9;
    if (!decay_all) cfg.groups.push_back(sp::no_decay_group(m));
    if (schedule == "cosine") cfg.schedule = sp::LrSchedule::warmup_cosine(warmup, schedule_steps, min_lr_ratio);
    if (schedule == "linear") cfg.schedule = sp::LrSchedule::warmup_linear(warmup, schedule_steps, min_lr_ratio);
    return cfg;
  };
  if (baseline) {
    // Plain LibTorch, everything resident: the reference point for strata's
    // figures (AdamW, one group, the same schedule), on the same model.
    for (const char* flag : {"--config", "--pp", "--tp", "--sp", "--zero-stage", "--lazy", "--update-in-backward"}) {
      STRATA_CHECK(app.count(flag) == 0, "--baseline trains one process with plain LibTorch; drop ", flag);
    }
    mc.tied_head = !untied_head;
    torch::manual_seed(0);
    torch::nn::Sequential model = strata::examples::gpt_layers(mc);
    const sp::OptimizerConfig cfg = make_optimizer(*model);
    const std::vector<torch::Tensor> params = strata::examples::unique_parameters(*model);  // a tied table once
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(lr).weight_decay(cfg.weight_decay));
    torch::manual_seed(1);
    const auto t0 = std::chrono::steady_clock::now();
    double loss = 0;
    for (int step = 1; step <= steps; ++step) {
      const auto [x, y] = strata::examples::sample_batch(corpus, batch, mc.context);
      static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr(lr * cfg.schedule.factor(step - 1));
      opt.zero_grad();
      torch::Tensor l = strata::examples::gpt_loss(model->forward(x), y);
      l.backward();
      if (opts.clip_norm > 0) torch::nn::utils::clip_grad_norm_(params, opts.clip_norm);
      opt.step();
      loss = l.item<double>();
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("plain LibTorch: {} steps, last loss {:.3f}, {:.0f} tok/s\n", steps, loss,
               steps * batch * mc.context / secs);
    return 0;
  }
  // One path for every layout: a plan from --config (or STRATA_PLAN), or from
  // the layout flags, the ranks they leave forming the data axis.
  if (!config.empty()) {
    for (const char* flag : {"--pp", "--tp", "--tp-mode", "--tp-depth", "--sp", "--zero-stage", "--microbatches",
                             "--virtual-stages", "--pp-schedule", "--sp-mode", "--sequence-parallel"}) {
      STRATA_CHECK(app.count(flag) == 0, "--config ", config, " gives the layout; drop ", flag);
    }
  }
  sp::HybridPlan base;
  base.zero_stage = opts.zero_stage;
  base.pp.size = pp;
  base.pp.schedule = sp::pipeline::schedule_from_name(pp_schedule);
  base.pp.microbatches = microbatches;
  base.pp.virtual_stages = virtual_stages;
  base.tp.size = tp;
  base.tp.mode = sp::parse_tensor_mode(tp_mode);
  base.tp.depth = tp_mode == "2.5d" ? tp_depth : 1;
  base.tp.sequence_parallel = tp_sequence;
  base.sp.size = seq_ranks;
  base.sp.mode = sp::sequence::parse_mode(sp_mode);
  opts.zero_stage = 0;  // the plan's decides
  return train({corpus, mc, untied_head, make_optimizer, opts,
                config.empty() ? sp::HybridPlan::from_env(base) : sp::HybridPlan::from_file(config), steps, batch,
                sample_tokens, save_every, lazy, print_losses, device_budget, host_budget, nvme_budget, nvme_dir,
                checkpoint_dir, resume, export_weights, export_hf, export_dtype});
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: error: %s\n", e.what());
    return 1;
  }
}
