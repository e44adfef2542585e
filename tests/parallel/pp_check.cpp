// Run by the tests through `strata run -n N`: pipeline-parallel strata
// training against single-process plain LibTorch on the same batch, on every rank.
//   pp_check [--schedule S] [--microbatches M] [--virtual V] [--dp D] [--zero-stage Z]
//   pp_check --bad-partition | --empty-stage
//   pp_check --throw-at-step K
//   pp_check --checkpoint DIR
//   --schedule      gpipe, 1f1b, interleaved-1f1b or zb-h1
//   --dp            data-parallel replicas of the pipeline (world = dp x pp)
//   --zero-stage    ZeRO stage over the data axis
//   Every run trains 10 steps twice: with every stage's model state resident,
//   and with each stage's device budget at a quarter of its model state and
//   its optimizer state on NVMe. Gradients are clipped (by the whole model's
//   norm, reduced across the stages). Losses and every parameter must equal
//   the reference's within 1e-5 (parameters: relative L2).
//   --bad-partition a partition that does not cover the model: a clear error
//                   on every rank before any training
//   --empty-stage   a partition with an empty stage: the same
//   --throw-at-step a layer of rank 1 throws at step K: rank 1 reports it,
//                   the others fail at their timeout (STRATA_COMM_TIMEOUT)
//   --overflow-at-step a layer of rank 1 sends an infinite gradient back at
//                   step K: every stage skips that step (the overflow is
//                   agreed across the stages), the reference skips it too
//   --manual        each rank builds its own stage modules (a manual split)
//   Every training run also checks Pipeline::forward (evaluation) against
//   the reference on the last stage.
//   --checkpoint    saves after 3 steps, trains 2 more; a fresh pipeline
//                   loads the checkpoint and trains the same 2: bit for bit
// Prints "rank R: pipeline (...) matches single-process training" or fails.
#include <torch/torch.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/core/error.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/pipeline.h"

using namespace strata::parallel;
namespace pp = strata::parallel::pipeline;

constexpr int64_t kDim = 48;
int g_throw_at = -1;
int g_overflow_at = -1;
int g_step = 0;

// A residual block: every layer of the model has parameters.
struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  bool may_throw = false;
  BlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kDim, kDim));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (may_throw && g_step == g_throw_at) throw std::runtime_error("a layer failed at step " + std::to_string(g_step));
    if (may_throw && g_step == g_overflow_at && x.requires_grad()) {
      // The gradient leaving this block for the earlier ones is infinite; this stage's own stay finite.
      torch::Tensor y = x * 1.0;
      y.register_hook([](torch::Tensor g) { return g * std::numeric_limits<float>::infinity(); });
      return y + torch::tanh(fc->forward(norm->forward(x)));
    }
    return x + torch::tanh(fc->forward(norm->forward(x)));
  }
};
TORCH_MODULE(Block);

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential s;
  s->push_back(torch::nn::Linear(16, kDim));
  for (int i = 0; i < 6; ++i) s->push_back(Block());
  s->push_back(torch::nn::Linear(kDim, 4));
  return s;
}

struct Options {
  std::string schedule = "1f1b";
  int microbatches = 4, virtual_stages = 1, dp = 1, zero_stage = 0;
  bool bad_partition = false, empty_stage = false, manual = false;
  std::string checkpoint;
};

constexpr double kClip = 0.05;
constexpr int kBatch = 12;

torch::Tensor batch_inputs(int step, int part) {
  torch::manual_seed(1000 + step * 10 + part);
  return torch::randn({kBatch, 16});
}
torch::Tensor batch_targets(int step, int part) {
  torch::manual_seed(5000 + step * 10 + part);
  return torch::randn({kBatch, 4});
}

const pp::Pipeline::LossFn kLoss = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };

// The reference's parameter for an attached one: "stage<s>.<layer>.<rest>" is "<layer>.<rest>".
std::string reference_name(const std::string& name) { return name.substr(name.find('.') + 1); }

double compare(const std::string& what, torch::nn::Module& attached, torch::nn::Module& reference) {
  auto ref = reference.named_parameters();
  double worst = 0.0;
  for (const auto& item : attached.named_parameters()) {
    const torch::Tensor want = ref[reference_name(item.key())];
    // Relative L2, as dp_check: summation order differs (microbatches), and
    // Adam amplifies it where gradients are near zero.
    const double diff = ((item.value().detach() - want).norm() / want.norm().clamp_min(1e-12)).item<double>();
    worst = std::max(worst, diff);
    STRATA_CHECK(diff <= 1e-5, what, ": parameter ", item.key(), " differs from the reference by ", diff,
                 " (relative L2)");
  }
  return worst;
}

struct Run {
  std::shared_ptr<Communicator> pipe_group, data_group;
  int dp_rank = 0, dp = 1;
};

// Trains `steps` steps of a fresh pipeline and of the single-process reference; checks both.
void train(const Run& run, const Options& opt, bool offload, const std::string& label) {
  torch::nn::Sequential model = make_model();
  torch::nn::Sequential reference = make_model();
  pp::PipelineOptions po;
  po.schedule = pp::schedule_from_name(opt.schedule);
  po.microbatches = opt.microbatches;
  po.virtual_stages = opt.virtual_stages;
  // --manual: each rank builds its own stages from the same layers (the
  // balanced partition's boundaries), as a hand-made split would.
  std::unique_ptr<pp::Pipeline> made;
  if (opt.manual) {
    const std::vector<int> bounds = pp::partition_balanced(pp::parameter_costs(model), run.pipe_group->world_size() * opt.virtual_stages);
    std::vector<torch::nn::Sequential> mine;
    for (int c = 0; c < opt.virtual_stages; ++c) {
      const int s = c * run.pipe_group->world_size() + run.pipe_group->rank();
      torch::nn::Sequential seq;
      for (int i = bounds[s]; i < bounds[s + 1]; ++i) seq->push_back(std::to_string(i), *(model->begin() + i));
      mine.push_back(seq);
    }
    made = std::make_unique<pp::Pipeline>(mine, run.pipe_group, po);
  } else {
    made = std::make_unique<pp::Pipeline>(model, run.pipe_group, po);
  }
  pp::Pipeline& pipe = *made;
  for (const auto& item : pipe.module().named_modules()) {
    if (auto* b = item.value()->as<BlockImpl>(); b != nullptr && pipe.rank() == 1) b->may_throw = true;
  }
  int64_t params = 0;
  for (const auto& p : pipe.module().parameters()) params += p.numel();
  EngineOptions o;
  o.clip_norm = kClip;
  o.zero_stage = opt.zero_stage;
  o.budgets = {static_cast<uint64_t>(params) * 32, static_cast<uint64_t>(params) * 64, 0};
  const std::string nvme = "/tmp/strata-pp-check-" + std::to_string(::getpid());
  if (offload) {
    o.budgets = {static_cast<uint64_t>(params) * 16 / 4 / 4096 * 4096 + 8192, static_cast<uint64_t>(params) * 32 + 65536,
                 static_cast<uint64_t>(params) * 64};
    o.nvme_dir = nvme;
    o.nvme_optim_fraction = 1.0;
  }
  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  pipe.attach(OptimizerConfig::from(cfg), o, run.dp > 1 ? run.data_group : nullptr);
  torch::optim::AdamW adamw(reference->parameters(), torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  const int steps = 10;
  std::vector<std::vector<torch::Tensor>> saved;  // --checkpoint: parameters after each of the last 2 steps
  for (int s = 0; s < steps; ++s) {
    g_step = s;
    // Reference: the whole combined batch of every data-parallel replica.
    adamw.zero_grad();
    torch::Tensor ref_loss_mine;
    torch::Tensor total = torch::zeros({});
    for (int d = 0; d < run.dp; ++d) {
      torch::Tensor l = torch::mse_loss(reference->forward(batch_inputs(s, d)), batch_targets(s, d));
      if (d == run.dp_rank) ref_loss_mine = l.detach();
      total = total + l / run.dp;
    }
    total.backward();
    torch::nn::utils::clip_grad_norm_(reference->parameters(), kClip);
    if (s != g_overflow_at) adamw.step();  // the pipeline skips that step on every stage
    StepResult r;
    if (opt.empty_stage || opt.bad_partition) STRATA_FAIL("internal: no training with a bad partition");
    try {
      r = pipe.step(batch_inputs(s, run.dp_rank), batch_targets(s, run.dp_rank), kLoss);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: step %d failed: %s\n", pipe.rank(), s, e.what());
      std::fflush(stderr);
      if (s == g_throw_at && pipe.rank() == 1) {
        ::sleep(60);  // the others time out meanwhile; the launcher stops this one
      }
      std::_Exit(1);
    }
    if (s == g_overflow_at) {
      STRATA_CHECK(!r.stepped && r.overflow, label, ": step ", s, " had an infinite gradient on an earlier stage but "
                   "pipeline rank ", pipe.rank(), " did not skip it");
    } else {
      STRATA_CHECK(r.stepped, label, ": step ", s, " was skipped");
    }
    const double want = ref_loss_mine.item<double>();
    STRATA_CHECK(std::fabs(r.loss - want) <= 1e-5 * std::max(1.0, std::fabs(want)), label, ": step ", s, " loss ",
                 r.loss, ", the reference's ", want);
    if (!opt.checkpoint.empty() && s == 2) pipe.save(opt.checkpoint);
    if (!opt.checkpoint.empty() && s >= 3 && s < 5) {
      std::vector<torch::Tensor> now;
      for (const auto& p : pipe.module().parameters()) now.push_back(p.detach().clone());
      saved.push_back(now);
    }
    if (!opt.checkpoint.empty() && s == 4) break;
  }
  if (opt.checkpoint.empty()) {
    compare(label, pipe.module(), *reference);
    // Evaluation: every microbatch forward, the output on the last stage;
    // then one sample, fewer than the microbatches (one microbatch runs).
    for (const torch::Tensor& x : {batch_inputs(99, 0), batch_inputs(98, 0).narrow(0, 0, 1)}) {
      const torch::Tensor got = pipe.forward(x);
      if (pipe.rank() == pipe.num_ranks() - 1) {
        torch::NoGradGuard no_grad;
        const torch::Tensor want = reference->forward(x);
        STRATA_CHECK(got.defined() && got.sizes() == want.sizes(), label, ": the pipeline's evaluation output has "
                     "shape ", got.defined() ? got.sizes() : torch::IntArrayRef{}, ", one process's ", want.sizes());
        const double diff = ((got - want).norm() / want.norm()).item<double>();
        STRATA_CHECK(diff <= 1e-5, label, ": the pipeline's evaluation output differs from one process's by ", diff);
      } else {
        STRATA_CHECK(!got.defined(), label, ": pipeline rank ", pipe.rank(), " got an evaluation output");
      }
    }
    std::printf("rank %d: pipeline (%s) matches single-process training: %d steps, stage parameters equal\n",
                run.pipe_group->rank() + run.dp_rank * run.pipe_group->world_size(), label.c_str(), steps);
    std::fflush(stdout);
    return;
  }
  // A fresh pipeline resumes from the checkpoint: the same 2 steps, bit for bit.
  torch::nn::Sequential model2 = make_model();
  pp::Pipeline pipe2(model2, run.pipe_group, po);
  pipe2.attach(OptimizerConfig::from(cfg), o, run.dp > 1 ? run.data_group : nullptr);
  pipe2.load(opt.checkpoint);
  for (int s = 3; s < 5; ++s) {
    pipe2.step(batch_inputs(s, run.dp_rank), batch_targets(s, run.dp_rank), kLoss);
    const auto params2 = pipe2.module().parameters();
    for (size_t i = 0; i < params2.size(); ++i) {
      STRATA_CHECK(torch::equal(params2[i].detach(), saved[s - 3][i]), label, ": after resuming, step ", s,
                   " parameter ", i, " differs from the uninterrupted run");
    }
  }
  std::printf("rank %d: pipeline checkpoint (%s) resumes bit for bit\n", run.pipe_group->rank(), label.c_str());
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] {
      STRATA_CHECK(i + 1 < argc, a, " needs a value");
      return std::string(argv[++i]);
    };
    if (a == "--schedule") opt.schedule = next();
    else if (a == "--microbatches") opt.microbatches = std::stoi(next());
    else if (a == "--virtual") opt.virtual_stages = std::stoi(next());
    else if (a == "--dp") opt.dp = std::stoi(next());
    else if (a == "--zero-stage") opt.zero_stage = std::stoi(next());
    else if (a == "--bad-partition") opt.bad_partition = true;
    else if (a == "--empty-stage") opt.empty_stage = true;
    else if (a == "--throw-at-step") g_throw_at = std::stoi(next());
    else if (a == "--overflow-at-step") g_overflow_at = std::stoi(next());
    else if (a == "--checkpoint") opt.checkpoint = next();
    else if (a == "--manual") opt.manual = true;
    else STRATA_FAIL("unknown option ", a);
  }
  try {
    // make_gloo_communicator takes the timeout from STRATA_COMM_TIMEOUT.
    std::shared_ptr<Communicator> world = make_gloo_communicator(Rendezvous::from_env());
    STRATA_CHECK(world->world_size() % opt.dp == 0, "world ", world->world_size(), " is not a multiple of dp ", opt.dp);
    const int pipe_ranks = world->world_size() / opt.dp;
    DeviceMesh mesh = DeviceMesh::create(*world, {opt.dp, pipe_ranks, 1, 1});
    Run run;
    run.dp = opt.dp;
    run.dp_rank = mesh.coord(DeviceMesh::kData);
    run.pipe_group = mesh.group(DeviceMesh::kPipeline);
    run.data_group = mesh.group(DeviceMesh::kData);
    if (opt.bad_partition || opt.empty_stage) {
      torch::nn::Sequential model = make_model();
      pp::PipelineOptions po;
      std::vector<int> bounds;
      for (int s = 0; s <= pipe_ranks; ++s) bounds.push_back(s);  // ends at layer p, short of the model's 8
      if (opt.empty_stage) {
        bounds.back() = static_cast<int>(model->size());
        bounds[1] = 0;  // stage 0 empty
      }
      try {
        pp::Pipeline pipe(model, run.pipe_group, po, bounds);
      } catch (const strata::Error& e) {
        std::printf("rank %d: refused: %s\n", world->rank(), e.what());
        std::fflush(stdout);
        // Rank 0 serves the rendezvous store: no rank leaves while another
        // still forms its groups (the refusal itself needed no communication).
        world->barrier()->wait();
        return 0;
      }
      STRATA_FAIL("the bad partition was accepted");
    }
    std::string label = fmt::format("{}, {} ranks x {} microbatches", opt.schedule, pipe_ranks, opt.microbatches);
    if (opt.virtual_stages > 1) label += fmt::format(", {} virtual", opt.virtual_stages);
    if (opt.dp > 1) label += fmt::format(", dp {} zero {}", opt.dp, opt.zero_stage);
    if (opt.manual) label += ", manual split";
    if (g_overflow_at >= 0) label += fmt::format(", overflow at step {}", g_overflow_at);
    train(run, opt, false, label);
    if (opt.checkpoint.empty()) {
      train(run, opt, true, label + ", offload");
      std::filesystem::remove_all("/tmp/strata-pp-check-" + std::to_string(::getpid()));  // after the engines
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pp_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
