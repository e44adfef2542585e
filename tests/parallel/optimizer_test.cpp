// The engine's optimizers, parameter groups and learning-rate schedules
// against torch::optim (and, for Lion, which torch lacks, a double-precision
// reference), at a quarter of model state on the device.
#include "strata/parallel/optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>

#include "../error_of.h"
#include "strata/parallel/engine.h"
#include "test_util.h"

namespace strata::parallel {
namespace {

constexpr double kPi = 3.14159265358979323846;

// The device budget of engine_test.cpp's equivalence test: a quarter of the
// model's AdamW state (16 bytes a parameter), smaller than its parameter
// chunks, so chunks are evicted and fetched again all through training
// (each test checks the evictions). For SGD and Lion that is a larger share
// of their smaller state, but the same device.
EngineOptions quarter_on_device(torch::nn::Module& model, const OptimizerConfig&) {
  int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  EngineOptions o;
  o.budgets = {static_cast<uint64_t>(params) * 16 / 4, 1 << 20, 0};
  o.chunk_elems = 1024;
  return o;
}

struct Batches {
  explicit Batches(int n) {
    for (int s = 0; s < n; ++s) {
      xs.push_back(torch::randn({16, 32}));
      ys.push_back(torch::randn({16, 8}));
    }
  }
  std::vector<torch::Tensor> xs, ys;
};

struct TorchCase {
  std::string name;
  OptimizerConfig config;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> make;
};

class Optimizers : public ::testing::TestWithParam<TorchCase> {};

TEST_P(Optimizers, MatchTorchOverTwentyStepsAtAQuarterOfModelStateOnTheDevice) {
  const TorchCase& c = GetParam();
  torch::manual_seed(11);
  auto reference = mlp();
  auto model = mlp();
  copy_params(*reference, *model);
  auto opt = c.make(reference->parameters());
  const EngineOptions o = quarter_on_device(*model, c.config);
  auto engine = attach(*model, c.config, o);
  EXPECT_EQ(engine->optimizer(), c.config.kind);
  const Batches data(20);
  for (int s = 0; s < 20; ++s) {
    opt->zero_grad();
    torch::Tensor ref_loss = torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]);
    ref_loss.backward();
    opt->step();
    const StepResult r = engine->train_step([&] { return torch::mse_loss(model->forward(data.xs[s]), data.ys[s]); });
    ASSERT_TRUE(r.stepped);
    EXPECT_LT(rel(r.loss, ref_loss.item<double>()), 1e-5) << "step " << s;
  }
  const memory::TierStats dev = engine->chunks().tier_stats(memory::Tier::kDevice);
  EXPECT_LE(dev.peak, dev.budget);
  EXPECT_GT(dev.evictions, 20u) << "the device tier must have been too small to hold the model";
  engine.reset();
  expect_params_close(*reference, *model);
}

// Optimizer state chunks resident on the device now.
int optim_state_on_device(const memory::ChunkManager& mgr) {
  int n = 0;
  for (size_t c = 0; c < mgr.num_chunks(); ++c) {
    const memory::Chunk& chunk = mgr.chunk(static_cast<memory::ChunkId>(c));
    n += chunk.role() == memory::ChunkRole::kOptimState && chunk.location() == memory::Tier::kDevice;
  }
  return n;
}

// Note [The optimizer where its state lives]: half the families updated on
// the device (the emulated device here: its kernels are the CPU's, on device
// memory) while a worker updates the rest on host, against torch::optim, and
// against the same run with every family on host, bit for bit.
TEST_P(Optimizers, SplitBetweenDeviceAndHostTrainsLikeTorch) {
  const TorchCase& c = GetParam();
  const Batches data(8);
  std::vector<std::vector<torch::Tensor>> finals;
  for (double fraction : {0.0, 0.5}) {
    torch::manual_seed(11);
    auto reference = mlp();
    auto model = mlp();
    copy_params(*reference, *model);
    auto opt = c.make(reference->parameters());
    EngineOptions o = quarter_on_device(*model, c.config);
    o.budgets.device *= 2;  // half the model state: a family's whole update fits beside an operator's chunks
    o.device_optim_fraction = fraction;
    auto engine = attach(*model, c.config, o);
    int resident_after_steps = 0;
    for (int s = 0; s < 8; ++s) {
      opt->zero_grad();
      torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]).backward();
      opt->step();
      ASSERT_TRUE(engine->train_step([&] { return torch::mse_loss(model->forward(data.xs[s]), data.ys[s]); }).stepped);
      resident_after_steps += optim_state_on_device(engine->chunks());
    }
    if (fraction == 0.0) {
      EXPECT_EQ(resident_after_steps, 0) << "optimizer state went to the device with device_optim_fraction 0";
    } else if (c.config.state_count() > 0) {  // plain SGD keeps no state
      EXPECT_GT(resident_after_steps, 0) << "no family's optimizer state was updated on the device";
    }
    const memory::TierStats dev = engine->chunks().tier_stats(memory::Tier::kDevice);
    EXPECT_LE(dev.peak, dev.budget);
    EXPECT_LE(engine->chunks().device().arena_stats().live, dev.budget) << "the arena holds no more than the budget";
    engine.reset();
    expect_params_close(*reference, *model);
    std::vector<torch::Tensor> params;
    for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
    finals.push_back(params);
  }
  for (size_t i = 0; i < finals[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(finals[0][i], finals[1][i])) << "parameter " << i << " differs from the all-host run";
  }
}

TEST(DeviceOptimizer, RefusesAFractionOverlappingTheNvmeFamilies) {
  auto model = mlp();
  EngineOptions o = quarter_on_device(*model, OptimizerConfig{});
  o.device_optim_fraction = 1.5;
  EXPECT_NE(error_of([&] { attach(*model, OptimizerConfig{}, o); }).find("device_optim_fraction"), std::string::npos);
  o.device_optim_fraction = 1.0;
  EXPECT_NE(error_of([&] { attach(*model, OptimizerConfig{}, o); }).find("more than the device budget"),
            std::string::npos)
      << "a family's update must fit on the device";
  o.budgets.device *= 4;
  o.device_optim_fraction = 0.75;
  o.budgets.nvme = 1 << 20;
  o.nvme_dir = ::testing::TempDir() + "strata-device-optim-nvme";
  o.nvme_optim_fraction = 0.5;
  EXPECT_NE(error_of([&] { attach(*model, OptimizerConfig{}, o); }).find("lower one of the two fractions"),
            std::string::npos);
  for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32) << "a refused attach changed the module";
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, Optimizers,
    ::testing::Values(
        TorchCase{"AdamW", OptimizerConfig::adamw(1e-2, 0.05),
                  [](std::vector<torch::Tensor> p) {
                    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
                  }},
        TorchCase{"AdamL2", OptimizerConfig::adam(1e-2, 0.05, 0.8, 0.99, 1e-6),
                  [](std::vector<torch::Tensor> p) {
                    return std::make_unique<torch::optim::Adam>(
                        p, torch::optim::AdamOptions(1e-2).weight_decay(0.05).betas({0.8, 0.99}).eps(1e-6));
                  }},
        TorchCase{"SgdMomentum", OptimizerConfig::sgd(5e-2, 0.9, 1e-3, false, 0.1),
                  [](std::vector<torch::Tensor> p) {
                    return std::make_unique<torch::optim::SGD>(
                        p, torch::optim::SGDOptions(5e-2).momentum(0.9).weight_decay(1e-3).dampening(0.1));
                  }},
        TorchCase{"SgdNesterov", OptimizerConfig::sgd(5e-2, 0.9, 1e-3, true),
                  [](std::vector<torch::Tensor> p) {
                    return std::make_unique<torch::optim::SGD>(
                        p, torch::optim::SGDOptions(5e-2).momentum(0.9).weight_decay(1e-3).nesterov(true));
                  }},
        TorchCase{"SgdPlain", OptimizerConfig::sgd(5e-2),
                  [](std::vector<torch::Tensor> p) {
                    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(5e-2));
                  }}),
    [](const ::testing::TestParamInfo<TorchCase>& info) { return info.param.name; });

TEST(Lion, MatchesADoublePrecisionReferenceOverTwentySteps) {
  torch::manual_seed(12);
  auto reference = mlp();
  auto model = mlp();
  copy_params(*reference, *model);
  const OptimizerConfig cfg = OptimizerConfig::lion(1e-3, 0.1, 0.9, 0.99);
  auto engine = attach(*model, cfg, quarter_on_device(*model, cfg));
  // The reference: fp32 forward and backward, the update in double.
  std::vector<torch::Tensor> params = reference->parameters(), master, exp_avg;
  for (const auto& p : params) {
    master.push_back(p.detach().to(torch::kFloat64));
    exp_avg.push_back(torch::zeros_like(master.back()));
  }
  const Batches data(20);
  for (int s = 0; s < 20; ++s) {
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]).backward();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor g = params[i].grad().to(torch::kFloat64);
        const torch::Tensor c = exp_avg[i] * cfg.beta1 + g * (1 - cfg.beta1);
        master[i] = master[i] * (1 - cfg.lr * cfg.weight_decay) - c.sign() * cfg.lr;
        exp_avg[i] = exp_avg[i] * cfg.beta2 + g * (1 - cfg.beta2);
        params[i].copy_(master[i]);
      }
    }
    ASSERT_TRUE(engine->train_step([&] { return torch::mse_loss(model->forward(data.xs[s]), data.ys[s]); }).stepped);
  }
  engine.reset();
  auto trained = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const double err = ((trained[i].to(torch::kFloat64) - master[i]).norm() / master[i].norm()).item<double>();
    EXPECT_LT(err, 1e-5) << "parameter " << i;
  }
}

TEST(ParamGroups, NoDecaySplitAndNamedGroupsTrainLikeTorchParamGroups) {
  torch::manual_seed(13);
  auto reference = deep_mlp(13);
  auto model = deep_mlp(13);
  copy_params(*reference, *model);
  OptimizerConfig cfg = OptimizerConfig::adamw(1e-2, 0.1);
  cfg.groups.push_back(no_decay_group(*model));
  ParamGroup head = group_by_names("head", {"6.*"});
  head.lr = 3e-3;
  head.beta2 = 0.95;
  cfg.groups.push_back(head);
  auto engine = attach(*model, cfg, quarter_on_device(*model, cfg));
  EXPECT_EQ(engine->param_groups(), (std::vector<std::string>{"no_decay", "head", "default"}));
  EXPECT_EQ(engine->group_parameters("no_decay"), (std::vector<std::string>{"0.bias", "2.bias", "4.bias", "6.bias"}));
  EXPECT_EQ(engine->group_parameters("head"), (std::vector<std::string>{"6.weight"}));
  EXPECT_EQ(engine->group_parameters("default"), (std::vector<std::string>{"0.weight", "2.weight", "4.weight"}));
  EXPECT_NE(error_of([&] { engine->lr("decay"); }).find("the groups are no_decay, head, default"), std::string::npos);

  // torch::optim::AdamW with the same three groups, built from the engine's membership.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  const auto named = reference->named_parameters();
  for (const std::string& g : engine->param_groups()) {
    std::vector<torch::Tensor> ps;
    for (const std::string& name : engine->group_parameters(g)) ps.push_back(named[name]);
    auto options = std::make_unique<torch::optim::AdamWOptions>(1e-2);
    options->weight_decay(0.1);
    if (g == "no_decay") options->weight_decay(0.0);
    if (g == "head") options->lr(3e-3).betas({0.9, 0.95});
    groups.emplace_back(ps, std::move(options));
  }
  torch::optim::AdamW opt(groups, torch::optim::AdamWOptions(1e-2));
  const Batches data(20);
  for (int s = 0; s < 20; ++s) {
    opt.zero_grad();
    torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]).backward();
    opt.step();
    ASSERT_TRUE(engine->train_step([&] { return torch::mse_loss(model->forward(data.xs[s]), data.ys[s]); }).stepped);
  }
  engine.reset();
  expect_params_close(*reference, *model);
}

TEST(ParamGroups, NoDecayFindsEmbeddingsAndNormsByModuleType) {
  torch::nn::Sequential m(torch::nn::Embedding(10, 4), torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})),
                          torch::nn::Linear(4, 4));
  NoDecayOptions which;
  which.biases = false;
  which.one_dimensional = false;
  const ParamGroup g = no_decay_group(*m, which);
  EXPECT_EQ(g.weight_decay, 0.0);
  EXPECT_TRUE(g.select("0.weight", {10, 4}));  // the embedding, although 2-D
  EXPECT_TRUE(g.select("1.weight", {4}));
  EXPECT_TRUE(g.select("1.bias", {4}));  // a norm's bias goes with the norm
  EXPECT_FALSE(g.select("2.weight", {4, 4}));
  EXPECT_FALSE(g.select("2.bias", {4}));
  which.biases = true;
  EXPECT_TRUE(no_decay_group(*m, which).select("2.bias", {4}));
  EXPECT_TRUE(glob_match("layers.*.attn.*", "layers.3.attn.qkv.weight"));
  EXPECT_FALSE(glob_match("layers.?.bias", "layers.10.bias"));
}

// torch's LinearLR and CosineAnnealingLR in their recursive (chainable) form,
// as torch.optim.lr_scheduler computes them step by step, under SequentialLR.
std::vector<double> torch_warmup_cosine(double base, int warmup, int total, double start, double eta_min_ratio,
                                        int steps) {
  std::vector<double> lrs;
  double lr = base * start;
  const int t_max = total - warmup;
  const double eta_min = base * eta_min_ratio;
  for (int e = 0; e < steps; ++e) {
    if (e < warmup) {
      if (e > 0) lr = lr * (1 + (1 - start) / (warmup * start + (e - 1) * (1 - start)));
    } else {
      const int c = e - warmup;  // the cosine scheduler's last_epoch
      if (c == 0) {
        lr = base;
      } else {
        lr = (1 + std::cos(kPi * c / t_max)) / (1 + std::cos(kPi * (c - 1) / t_max)) * (lr - eta_min) + eta_min;
      }
    }
    lrs.push_back(lr);
  }
  return lrs;
}

TEST(LrSchedule, WarmupCosineMatchesTorchsSchedulersStepForStep) {
  const LrSchedule s = LrSchedule::warmup_cosine(5, 25, 0.1, 0.2);
  const std::vector<double> torch_lrs = torch_warmup_cosine(0.5, 5, 25, 0.2, 0.1, 25);
  for (int k = 0; k < 25; ++k) EXPECT_NEAR(0.5 * s.factor(k), torch_lrs[k], 1e-12) << "step " << k;
  EXPECT_DOUBLE_EQ(s.factor(25), 0.1);   // after total_steps it stays at the minimum
  EXPECT_DOUBLE_EQ(s.factor(1000), 0.1);
  // Start factor 0: the usual t / warmup ramp (no torch LinearLR takes 0).
  const LrSchedule ramp = LrSchedule::warmup_cosine(4, 10);
  EXPECT_DOUBLE_EQ(ramp.factor(0), 0.0);
  EXPECT_DOUBLE_EQ(ramp.factor(2), 0.5);
  EXPECT_DOUBLE_EQ(ramp.factor(4), 1.0);
  EXPECT_NEAR(ramp.factor(7), 0.5, 1e-12);  // half way down the cosine
}

TEST(LrSchedule, WarmupLinearMatchesTorchsLinearLR) {
  const LrSchedule s = LrSchedule::warmup_linear(3, 13, 0.25, 0.5);
  double lr = 0.5;  // LinearLR(0.5, 1.0, 3) then LinearLR(1.0, 0.25, 10), recursively
  for (int e = 0; e < 13; ++e) {
    if (e > 0 && e < 3) lr *= 1 + 0.5 / (3 * 0.5 + (e - 1) * 0.5);
    if (e == 3) lr = 1.0;
    if (e > 3) lr *= 1 + (0.25 - 1.0) / (10 * 1.0 + (e - 4) * (0.25 - 1.0));
    EXPECT_NEAR(s.factor(e), lr, 1e-12) << "step " << e;
  }
  EXPECT_DOUBLE_EQ(s.factor(13), 0.25);
  EXPECT_NE(error_of([] { LrSchedule::warmup_linear(10, 5).validate(); }).find("at most total_steps"),
            std::string::npos);
}

TEST(LrSchedule, TheEngineAppliesItAndSetLrLikeTorch) {
  torch::manual_seed(14);
  auto reference = mlp();
  auto model = mlp();
  copy_params(*reference, *model);
  OptimizerConfig cfg = OptimizerConfig::adamw(2e-2, 0.01);
  cfg.schedule = LrSchedule::warmup_cosine(4, 16, 0.1);
  auto engine = attach(*model, cfg, quarter_on_device(*model, cfg));
  torch::optim::AdamW opt(reference->parameters(), torch::optim::AdamWOptions(2e-2).weight_decay(0.01));
  const Batches data(20);
  double base = 2e-2;
  for (int s = 0; s < 20; ++s) {
    if (s == 12) {  // a manual change of the base lr mid-run, as a user might
      base = 5e-3;
      engine->set_lr(base);
    }
    const double lr = base * cfg.schedule.factor(s);
    EXPECT_NEAR(engine->lr(), lr, 1e-15) << "step " << s;
    static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr(lr);
    opt.zero_grad();
    torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]).backward();
    opt.step();
    ASSERT_TRUE(engine->train_step([&] { return torch::mse_loss(model->forward(data.xs[s]), data.ys[s]); }).stepped);
    EXPECT_EQ(engine->optimizer_steps(), s + 1);
  }
  engine.reset();
  expect_params_close(*reference, *model);
}

TEST(LrSchedule, CheckpointsKeepTheScheduleAndTheHyperParameters) {
  const std::string dir = temp_path("schedule-checkpoint");
  const Batches data(12);
  OptimizerConfig cfg = OptimizerConfig::sgd(5e-2, 0.9, 1e-3);
  cfg.schedule = LrSchedule::warmup_linear(3, 12, 0.2);
  const auto train = [&](torch::nn::Sequential& m, Engine& e, int from, int to) {
    for (int s = from; s < to; ++s) {
      ASSERT_TRUE(e.train_step([&] { return torch::mse_loss(m->forward(data.xs[s]), data.ys[s]); }).stepped);
    }
  };
  auto a = deep_mlp(15);
  auto whole = deep_mlp(15);
  {
    auto engine = attach(*whole, cfg, quarter_on_device(*whole, cfg));
    train(whole, *engine, 0, 12);
  }
  {
    auto engine = attach(*a, cfg, quarter_on_device(*a, cfg));
    train(a, *engine, 0, 5);
    engine->save(dir);
  }
  auto b = deep_mlp(99);
  OptimizerConfig other = OptimizerConfig::sgd(1.0, 0.9, 0.5);  // hyper-parameters the checkpoint replaces
  {
    auto engine = attach(*b, other, quarter_on_device(*b, other));
    engine->load(dir);
    EXPECT_EQ(engine->optimizer_steps(), 5);
    EXPECT_EQ(engine->schedule().kind, LrSchedule::Kind::kWarmupLinear);
    EXPECT_NEAR(engine->lr(), 5e-2 * cfg.schedule.factor(5), 1e-15);
    train(b, *engine, 5, 12);
  }
  expect_params_close(*whole, *b, 1e-7);

  auto lion_model = deep_mlp(16);
  const OptimizerConfig lion = OptimizerConfig::lion();
  auto engine = attach(*lion_model, lion, quarter_on_device(*lion_model, lion));
  const std::string e = error_of([&] { engine->load(dir); });
  EXPECT_NE(e.find("holds the state of optimizer sgd (momentum_buffer), but this engine runs lion (exp_avg)"),
            std::string::npos)
      << e;
  std::filesystem::remove_all(dir);
}

TEST(OptimizerConfig, RefusesBadHyperParametersAndGroups) {
  EXPECT_NE(error_of([] { OptimizerConfig::adamw(-1).validate(); }).find("lr must be a finite number >= 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { OptimizerConfig::adam(1e-3, 0, 1.0).validate(); }).find("beta1 must be in [0, 1)"),
            std::string::npos);
  EXPECT_NE(error_of([] { OptimizerConfig::sgd(0.1, 0.0, 0.0, true).validate(); }).find("nesterov needs SGD with momentum"),
            std::string::npos);
  OptimizerConfig twice = OptimizerConfig::adamw();
  twice.groups = {group_by_names("a", {"x"}), group_by_names("a", {"y"})};
  EXPECT_NE(error_of([&] { twice.validate(); }).find("two parameter groups are named a"), std::string::npos);
  OptimizerConfig unnamed = OptimizerConfig::adamw();
  unnamed.groups = {group_by_names("default", {"x"})};
  EXPECT_NE(error_of([&] { unnamed.validate(); }).find("needs a name of its own"), std::string::npos);
  EXPECT_EQ(parse_optimizer("lion"), OptimizerKind::kLion);
  EXPECT_NE(error_of([] { parse_optimizer("adagrad"); }).find("choose adamw, adam, lion or sgd"), std::string::npos);
  EXPECT_EQ(OptimizerConfig::sgd(0.1).state_count(), 0);
  EXPECT_EQ(OptimizerConfig::sgd(0.1, 0.9).state_count(), 1);
  EXPECT_EQ(OptimizerConfig::lion().state_count(), 1);
}

}  // namespace
}  // namespace strata::parallel
