// strata training vs plain LibTorch training: the same model, seed and data.
#include "strata/parallel/engine.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "strata/core/error.h"

namespace strata::parallel {
namespace {

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::ReLU(), torch::nn::Linear(64, 8));
}

void copy_params(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  ASSERT_EQ(src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-12); }

TEST(Engine, TrainsLikePlainLibTorchAtAQuarterOfModelStateOnDevice) {
  torch::manual_seed(7);
  auto reference = mlp();
  auto model = mlp();
  copy_params(*reference, *model);

  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  cfg.weight_decay = 0.05f;
  torch::optim::AdamW opt(reference->parameters(),
                          torch::optim::AdamWOptions(cfg.lr).betas({cfg.beta1, cfg.beta2}).eps(cfg.eps).weight_decay(
                              cfg.weight_decay));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  EngineOptions o;
  o.budgets = {static_cast<uint64_t>(params) * 16 / 4, 1 << 20, 0};  // device: 25% of model state
  o.chunk_elems = 1024;
  auto engine = attach(*model, cfg, o);
  EXPECT_EQ(engine->managed_parameters(), params);

  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < 20; ++s) {
    xs.push_back(torch::randn({16, 32}));
    ys.push_back(torch::randn({16, 8}));
  }
  for (int s = 0; s < 20; ++s) {
    opt.zero_grad();
    torch::Tensor ref_loss = torch::mse_loss(reference->forward(xs[s]), ys[s]);
    ref_loss.backward();
    opt.step();
    const StepResult r = engine->train_step([&] { return torch::mse_loss(model->forward(xs[s]), ys[s]); });
    ASSERT_TRUE(r.stepped);
    EXPECT_LT(rel(r.loss, ref_loss.item<double>()), 1e-5) << "step " << s;
  }
  const memory::TierStats dev = engine->chunks().tier_stats(memory::Tier::kDevice);
  EXPECT_LE(dev.peak, dev.budget);
  EXPECT_GT(dev.evictions, 20u) << "the device tier must have been too small to hold the model";
  engine.reset();  // parameters get owned memory back
  auto a = reference->parameters();
  auto b = model->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = ((a[i] - b[i]).norm() / a[i].norm()).item<double>();
    EXPECT_LT(err, 1e-5) << "parameter " << i;
  }
}

// Embedding, LayerNorm, Conv2d with BatchNorm (buffers; no conv bias, whose
// gradient BatchNorm cancels to rounding noise that AdamW would amplify), the embedding weight
// tied to the output projection, a parameter in custom arithmetic, an unused
// and a frozen one.
struct Zoo : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::Tensor gain, unused, frozen;
  Zoo() {
    emb = register_module("emb", torch::nn::Embedding(20, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    gain = register_parameter("gain", torch::ones({16}));
    unused = register_parameter("unused", torch::randn({5}));
    frozen = register_parameter("frozen", torch::randn({16}), /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    torch::Tensor x = norm->forward(emb->forward(tokens));                  // [B, T, 16]
    torch::Tensor img = bn->forward(conv->forward(x.unsqueeze(1)));        // [B, 4, T, 16]
    x = x + img.mean(1) * gain + gain.sum() * 1e-3 + frozen;              // custom arithmetic
    return torch::nn::functional::linear(x, emb->weight);                  // tied output projection
  }
};

TEST(Engine, GeneralModelTrainsLikePlainLibTorch) {
  torch::manual_seed(3);
  auto reference = std::make_shared<Zoo>();
  auto model = std::make_shared<Zoo>();
  copy_params(*reference, *model);
  {
    torch::NoGradGuard no_grad;
    auto rb = reference->buffers();
    auto mb = model->buffers();
    for (size_t i = 0; i < rb.size(); ++i) mb[i].copy_(rb[i]);
  }
  AdamWConfig cfg;
  cfg.lr = 5e-3f;
  std::vector<torch::Tensor> trainable;
  for (const auto& p : reference->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  EngineOptions o;
  o.budgets = {64 << 10, 1 << 20, 0};
  o.chunk_elems = 512;
  const torch::Tensor unused_before = model->unused.detach().clone();
  auto engine = attach(*model, cfg, o);
  for (int s = 0; s < 10; ++s) {
    const torch::Tensor tokens = torch::randint(0, 20, {4, 6});
    const torch::Tensor target = torch::randint(0, 20, {4 * 6});
    opt.zero_grad();
    torch::Tensor ref_loss = torch::cross_entropy_loss(reference->forward(tokens).view({-1, 20}), target);
    ref_loss.backward();
    opt.step();
    const StepResult r = engine->train_step(
        [&] { return torch::cross_entropy_loss(model->forward(tokens).view({-1, 20}), target); });
    EXPECT_LT(rel(r.loss, ref_loss.item<double>()), 1e-5) << "step " << s;
  }
  engine.reset();
  EXPECT_TRUE(torch::equal(model->unused, unused_before)) << "an unused parameter is not updated";
  auto a = reference->named_parameters();
  auto b = model->named_parameters();
  for (const auto& item : a) {
    const double err = ((item.value() - b[item.key()]).norm() / item.value().norm().clamp_min(1e-12)).item<double>();
    EXPECT_LT(err, 1e-5) << item.key();
  }
  EXPECT_TRUE(torch::allclose(reference->bn->running_mean, model->bn->running_mean, 1e-5, 1e-6)) << "buffers";
}

TEST(Engine, DeviceBudgetBelowAnOperatorsWorkingSetIsAClearError) {
  auto model = mlp();
  EngineOptions o;
  // The first layer: its 64x32 weight (8 KiB, a chunk of its own) and the chunk
  // holding its bias (4 KiB) must be on the device together: 12 KiB > 8 KiB.
  o.budgets = {8 << 10, 1 << 20, 0};
  o.chunk_elems = 1024;
  auto engine = attach(*model, AdamWConfig{}, o);
  try {
    engine->train_step([&] { return model->forward(torch::randn({2, 32})).sum(); });
    FAIL() << "trained with a device tier smaller than one weight";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("operator aten::"), std::string::npos) << msg;
    EXPECT_NE(msg.find("needs 12.00 KiB of parameter chunks on the device tier at once (2 chunks)"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("raise the device budget"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace strata::parallel
