// Lazy construction (Note [Replaying initialisers]): a module built under
// LazyInit holds no memory for its weights, yet materialises to exactly what
// eager construction from the same seed builds, leaves the random stream
// where eager construction does, trains under attach exactly as the eager
// module does, takes its weights from safetensors, and keeps peak RSS within
// the tiers' budgets for a model four times the host budget.
#include "strata/parallel/lazy_init.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "error_of.h"
#include "parallel/test_util.h"
#include "strata/checkpoint/safetensors.h"
#include "strata/parallel/engine.h"

namespace strata::parallel {
namespace {

// Every way a constructor initialises: module defaults (kaiming_uniform_,
// normal_, ones), a later GPT-style normal_ over everything, views of a fused
// weight initialised block by block, data() in place, buffers, and a random
// tensor built and copied in.
struct Zoo : torch::nn::Module {
  torch::nn::Embedding tok{nullptr};
  torch::nn::Linear fused{nullptr}, out{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::Tensor scale, table;

  explicit Zoo(bool gpt_init = true) {
    tok = register_module("tok", torch::nn::Embedding(50, 16));
    fused = register_module("fused", torch::nn::Linear(16, 48));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3)));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    out = register_module("out", torch::nn::Linear(16, 4));
    scale = register_parameter("scale", torch::ones({16}));
    table = register_buffer("table", torch::zeros({4, 4}));
    torch::NoGradGuard no_grad;
    for (int64_t b = 0; b < 3; ++b) fused->weight.narrow(0, b * 16, 16).normal_(0.0, 0.01 * (b + 1));
    out->weight.data().mul_(0.5);
    out->bias.t().add_(1.0);
    table.copy_(torch::rand({4, 4}));
    if (gpt_init) {
      for (auto& p : tok->parameters()) p.normal_(0.0, 0.02);
    }
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    torch::Tensor h = ln->forward(tok->forward(idx)) * scale;
    h = fused->forward(h).narrow(-1, 0, 16);
    return out->forward(torch::gelu(bn->forward(h)));
  }
};

std::vector<torch::Tensor> state_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> s;
  for (const auto& p : m.parameters()) s.push_back(p);
  for (const auto& b : m.buffers()) s.push_back(b);
  return s;
}

TEST(LazyInit, MaterialisesWhatEagerConstructionBuilds) {
  torch::manual_seed(7);
  Zoo eager;
  const torch::Tensor eager_next = torch::rand({8});

  torch::manual_seed(7);
  std::optional<Zoo> lazy;
  {
    LazyInit guard;
    lazy.emplace();
  }
  // The random stream is where eager construction left it.
  EXPECT_TRUE(torch::equal(torch::rand({8}), eager_next));

  const std::vector<torch::Tensor> want = state_of(eager), have = state_of(*lazy);
  ASSERT_EQ(want.size(), have.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(is_lazy(have[i]), have[i].is_floating_point()) << "tensor " << i;  // BatchNorm's counter is int64
    EXPECT_EQ(have[i].sizes(), want[i].sizes());
    EXPECT_EQ(have[i].device(), torch::Device(torch::kCPU));
    EXPECT_TRUE(torch::equal(materialized_copy(have[i]), want[i])) << "tensor " << i;
    EXPECT_EQ(is_lazy(have[i]), have[i].is_floating_point()) << "materialized_copy left tensor " << i << " lazy";
  }
  EXPECT_TRUE(lazy->fused->weight.requires_grad());
  EXPECT_FALSE(lazy->table.requires_grad());

  materialize(*lazy);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_FALSE(is_lazy(have[i]));
    EXPECT_TRUE(torch::equal(have[i], want[i])) << "tensor " << i;
  }
}

TEST(LazyInit, ReadingALazyTensorGivesItItsValues) {
  torch::manual_seed(3);
  Zoo eager;
  torch::manual_seed(3);
  std::optional<Zoo> lazy;
  {
    LazyInit guard;
    lazy.emplace();
  }
  const torch::Tensor idx = torch::randint(0, 50, {6});
  eager.eval();
  lazy->eval();
  // forward reads every parameter: each is materialised in place as it is read.
  EXPECT_TRUE(torch::equal(lazy->forward(idx), eager.forward(idx)));
  for (const torch::Tensor& p : {lazy->tok->weight, lazy->fused->weight, lazy->fused->bias, lazy->scale}) {
    EXPECT_FALSE(is_lazy(p));
  }
  // The convolution is not in forward: nothing read it, so it holds no memory yet.
  EXPECT_TRUE(is_lazy(lazy->conv->weight));
  materialize(*lazy);
  EXPECT_TRUE(torch::equal(lazy->conv->weight, eager.conv->weight));
  // Tensors made outside the guard are ordinary.
  EXPECT_FALSE(is_lazy(torch::zeros({3})));
}

TEST(LazyInit, DifferentSeedsDiffer) {
  // The replay really draws from the recorded state: another seed, other values.
  torch::manual_seed(1);
  std::optional<Zoo> a, b;
  {
    LazyInit guard;
    a.emplace();
  }
  torch::manual_seed(2);
  {
    LazyInit guard;
    b.emplace();
  }
  EXPECT_FALSE(torch::equal(materialized_copy(a->tok->weight), materialized_copy(b->tok->weight)));
  EXPECT_FALSE(torch::equal(materialized_copy(a->fused->weight), materialized_copy(b->fused->weight)));
}

// Training a lazily constructed module under attach equals training the
// eager one, step for step, with the state spilling to NVMe.
TEST(LazyInit, AttachMaterialisesIntoChunksAndTrainsAsEager) {
  const torch::Tensor idx = torch::randint(0, 50, {32}), y = torch::randn({32, 4});
  std::vector<double> losses[2];
  std::vector<torch::Tensor> finals[2];
  for (int lazy_run = 0; lazy_run < 2; ++lazy_run) {
    torch::manual_seed(11);
    std::optional<Zoo> m;
    if (lazy_run) {
      LazyInit guard;
      m.emplace();
    } else {
      m.emplace();
    }
    EngineOptions o;
    o.budgets = {8 << 10, 16 << 10, 64 << 20};
    o.nvme_dir = temp_path("lazy-nvme");
    o.chunk_elems = 1024;
    {
      auto engine = attach(*m, AdamWConfig{}, o);
      for (const auto& p : m->parameters()) EXPECT_FALSE(is_lazy(p));
      for (int s = 0; s < 3; ++s) {
        losses[lazy_run].push_back(engine->train_step([&] { return torch::mse_loss(m->forward(idx), y); }).loss);
      }
      // Read through the engine: destroyed, it gives a lazily built module
      // its values back only within the host budget, which this one's 16 KiB is not.
      for (const auto& p : m->parameters()) finals[lazy_run].push_back(p.detach().clone());
    }
    std::filesystem::remove_all(o.nvme_dir);
  }
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t s = 0; s < losses[0].size(); ++s) EXPECT_EQ(losses[1][s], losses[0][s]) << "step " << s;
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TRUE(torch::equal(finals[1][i], finals[0][i])) << i;
}

TEST(LazyInit, InitWeightsFromSafetensors) {
  torch::manual_seed(21);
  Zoo source;
  const std::string path = temp_path("lazy-init", ".safetensors");
  {
    std::vector<checkpoint::SafetensorsWriter::Spec> specs;
    for (const auto& item : source.named_parameters()) {
      specs.push_back({item.key(), "F32", item.value().sizes().vec()});
    }
    checkpoint::SafetensorsWriter w(path, specs);
    for (const auto& item : source.named_parameters()) {
      const torch::Tensor c = item.value().detach().contiguous();
      w.append(c.data_ptr(), static_cast<size_t>(c.numel()) * sizeof(float));
    }
    w.finish();
  }
  torch::manual_seed(99);  // other values than the file's
  std::optional<Zoo> m;
  {
    LazyInit guard;
    m.emplace();
  }
  EngineOptions o;
  o.budgets = {64 << 10, 1 << 20, 0};
  o.init_weights = path;
  auto engine = attach(*m, AdamWConfig{}, o);
  const auto want = source.named_parameters();
  for (const auto& item : m->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value().detach().to(torch::kFloat32), *want.find(item.key()))) << item.key();
  }
  engine.reset();
  std::filesystem::remove(path);
}

// A field of /proc/self/status in bytes: VmHWM (peak resident memory so far) or VmRSS.
uint64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) << 10;
  }
  return 0;
}
uint64_t peak_rss() { return status_bytes("VmHWM"); }
uint64_t current_rss() { return status_bytes("VmRSS"); }

struct Tower : torch::nn::Module {
  std::vector<torch::nn::Linear> layers;
  explicit Tower(int n, int width) {
    for (int i = 0; i < n; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(width, width)));
    }
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.normal_(0.0, 0.02);  // as GPT initialises: a second pass over every weight
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l->forward(x));
    return x;
  }
};

// A model of 256 MiB fp32 weights, built lazily and attached with a 64 MiB
// host and 16 MiB device budget: peak RSS grows by no more than the budgets
// and a fixed overhead, far less than the model.
TEST(LazyInit, PeakRssStaysWithinTheBudgetsForAModelLargerThanThem) {
  constexpr uint64_t kMiB = 1 << 20;
  constexpr int kLayers = 64, kWidth = 1024;  // 64 x 4 MiB
  constexpr uint64_t kHost = 64 * kMiB, kDevice = 16 * kMiB, kOverhead = 64 * kMiB;
  const uint64_t model_bytes = uint64_t{kLayers} * kWidth * (kWidth + 1) * sizeof(float);
  ASSERT_GT(model_bytes, kHost + kDevice + kOverhead);
  // Reset the high-water mark to the current RSS (Linux >= 4.0).
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  const uint64_t before = current_rss();
  torch::manual_seed(5);
  std::optional<Tower> m;
  {
    LazyInit guard;
    m.emplace(kLayers, kWidth);
  }
  EngineOptions o;
  o.budgets = {kDevice, kHost, 5 * model_bytes};  // parameters, gradients and Adam's two states
  o.nvme_dir = temp_path("lazy-rss");
  uint64_t grown = 0;
  {
    auto engine = attach(*m, AdamWConfig{}, o);
    const torch::Tensor x = torch::randn({4, kWidth});
    const double loss = engine->train_step([&] { return m->forward(x).pow(2).mean(); }).loss;
    EXPECT_TRUE(std::isfinite(loss));
    grown = peak_rss() - before;
  }
  std::filesystem::remove_all(o.nvme_dir);
  // Larger than the host budget, the parameters come back without values
  // (Note [Giving a model larger than memory back]), and reading one says so.
  EXPECT_TRUE(is_lazy(m->layers[0]->weight));
  EXPECT_LT(current_rss(), before + model_bytes / 2);
  const std::string error = error_of([&] { (void)m->layers[0]->weight.sum(); });
  EXPECT_NE(error.find("export_weights or save before destroying the engine"), std::string::npos) << error;
  EXPECT_LT(grown, kHost + kDevice + kOverhead) << "peak RSS grew by " << grown / kMiB << " MiB for a "
                                                << model_bytes / kMiB << " MiB model";
  std::printf("lazy construction, attach and a step of a %llu MiB model: peak RSS +%llu MiB\n",
              static_cast<unsigned long long>(model_bytes / kMiB), static_cast<unsigned long long>(grown / kMiB));
}

}  // namespace
}  // namespace strata::parallel
