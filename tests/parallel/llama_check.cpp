// llama_check: a Llama-style model as a user writes it (RMSNorm of their own,
// rotary positions, grouped-query attention, SwiGLU, an untied head) trained
// through parallel::Trainer under a plan read from the environment
// (STRATA_DP, STRATA_PP, STRATA_TP, STRATA_SP, ...: HybridPlan::from_env over
// a module plan written in C++, as docs/parallel.md shows), against plain
// LibTorch AdamW in the same process on every replica's batch. Run under
// `strata run -n <ranks>`:
//
//   llama_check [--clip NORM] [--host-bytes N]
//
// Each step's loss must equal the reference's on this rank's replica
// (relative 1e-5), and after training the model's evaluation of two
// sequences (fewer samples than a pipeline's microbatches) must equal the
// reference's (relative 1e-4; AdamW's first steps amplify rounding where a
// gradient is near zero). Under tensor parallelism q is split by heads and
// k, v by key-value heads (2 here, so tp 2 leaves each rank one); under
// sequence parallelism the rotary angles come from the attention's
// positions (this rank's, in its layout).
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "strata/core/error.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/plan.h"
#include "strata/parallel/trainer.h"

namespace {

using namespace strata::parallel;

constexpr int64_t kVocab = 64, kDim = 32, kHeads = 4, kKvHeads = 2, kHeadDim = kDim / kHeads, kContext = 16, kFf = 64;
constexpr int kBlocks = 2, kSteps = 6, kBatch = 4;

struct RmsNormImpl : torch::nn::Module {
  RmsNormImpl() { weight = register_parameter("weight", torch::ones({kDim})); }
  torch::Tensor forward(const torch::Tensor& x) { return x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * weight; }
  torch::Tensor weight;
};
TORCH_MODULE(RmsNorm);

// Rotary embedding of x [b, heads, t, head_dim] at positions `pos` [t].
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& pos, const torch::Tensor& inv_freq) {
  const torch::Tensor angle = pos.to(torch::kFloat32).unsqueeze(1) * inv_freq.unsqueeze(0);  // [t, head_dim/2]
  const torch::Tensor c = torch::cat({angle.cos(), angle.cos()}, -1), s = torch::cat({angle.sin(), angle.sin()}, -1);
  const torch::Tensor x1 = x.narrow(-1, 0, kHeadDim / 2), x2 = x.narrow(-1, kHeadDim / 2, kHeadDim / 2);
  return (x * c + torch::cat({-x2, x1}, -1) * s).to(x.scalar_type());
}

struct EmbedImpl : torch::nn::Module {
  EmbedImpl() { tok = register_module("tok", torch::nn::Embedding(kVocab, kDim)); }
  torch::Tensor forward(const torch::Tensor& ids) { return tok->forward(ids); }
  torch::nn::Embedding tok{nullptr};
};
TORCH_MODULE(Embed);

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(sequence::Attention a) : attention(std::move(a)) {
    n1 = register_module("n1", RmsNorm());
    wq = register_module("wq", linear(kDim, kHeads * kHeadDim));
    wk = register_module("wk", linear(kDim, kKvHeads * kHeadDim));
    wv = register_module("wv", linear(kDim, kKvHeads * kHeadDim));
    wo = register_module("wo", linear(kHeads * kHeadDim, kDim));
    n2 = register_module("n2", RmsNorm());
    gate = register_module("gate", linear(kDim, kFf));
    up = register_module("up", linear(kDim, kFf));
    down = register_module("down", linear(kFf, kDim));
    if (attention) register_module("attention", attention);
    inv_freq = register_buffer("inv_freq", torch::pow(10000.0, -torch::arange(0, kHeadDim, 2, torch::kFloat32) / kHeadDim));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1);
    const torch::Tensor h = n1->forward(x);
    // Heads from the tensors: tensor parallelism leaves this rank's in each projection.
    const auto heads = [&](const torch::Tensor& y) { return y.reshape({b, t, -1, kHeadDim}).transpose(1, 2); };
    torch::Tensor q = heads(wq->forward(h)), k = heads(wk->forward(h)), v = heads(wv->forward(h));
    const int64_t group = q.size(1) / k.size(1);  // query heads per key-value head
    k = k.repeat_interleave(group, 1);
    v = v.repeat_interleave(group, 1);
    const torch::Tensor pos = attention ? attention->positions(t) : torch::arange(t);
    q = rotate(q, pos, inv_freq);
    k = rotate(k, pos, inv_freq);
    torch::Tensor y;
    if (attention) {
      y = attention->forward(q, k, v);
    } else {
      const torch::Tensor s = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(kHeadDim));
      y = torch::matmul(torch::softmax(s.masked_fill(torch::ones({t, t}, torch::kBool).triu(1), -1e9), -1), v);
    }
    x = x + wo->forward(y.transpose(1, 2).reshape({b, t, -1}));
    const torch::Tensor h2 = n2->forward(x);
    return x + down->forward(torch::silu(gate->forward(h2)) * up->forward(h2));
  }
  RmsNorm n1{nullptr}, n2{nullptr};
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr}, gate{nullptr}, up{nullptr}, down{nullptr};
  sequence::Attention attention;
  torch::Tensor inv_freq;
};
TORCH_MODULE(Block);

struct HeadImpl : torch::nn::Module {
  HeadImpl() {
    n = register_module("n", RmsNorm());
    out = register_module("out", linear(kDim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out->forward(n->forward(x)); }
  RmsNorm n{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Head);

// `attention` null: plain causal attention (the reference).
torch::nn::Sequential make_model(const sequence::Attention& attention) {
  torch::manual_seed(3);
  torch::nn::Sequential s;
  s->push_back(Embed());
  for (int i = 0; i < kBlocks; ++i) s->push_back(Block(attention));
  s->push_back(Head());
  return s;
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

struct Args {
  double clip = 0.0;
  uint64_t host_bytes = 64ull << 20;
};

int train(const Args& a, const std::string& nvme) {
  const Rendezvous r = Rendezvous::from_env();
  HybridPlan base;  // the module plan; the sizes come from the environment
  base.tp.layers = {{"*.wq", ParallelStyle::columnwise()},  {"*.wk", ParallelStyle::columnwise()},
                    {"*.wv", ParallelStyle::columnwise()},  {"*.wo", ParallelStyle::rowwise()},
                    {"*.gate", ParallelStyle::columnwise()}, {"*.up", ParallelStyle::columnwise()},
                    {"*.down", ParallelStyle::rowwise()},   {"0.tok", ParallelStyle::vocab_embedding(/*gather_tied_logits=*/false)},
                    {fmt::format("{}.out", kBlocks + 1), ParallelStyle::columnwise(1, /*gather=*/true)}};
  const ModelShape shape{kDim, kKvHeads, kContext, kBlocks + 2};  // tp must divide the key-value heads
  const HybridPlan plan = HybridPlan::from_env(base).validated(r.world_size, shape);
  DeviceMesh mesh = DeviceMesh::create(make_world(r), plan.dims());
  EngineOptions o;
  o.budgets = {16 << 10, a.host_bytes, 1ull << 30};  // the device tier holds a few chunks
  o.nvme_dir = nvme;
  o.clip_norm = a.clip;
  AdamWConfig adamw;
  adamw.lr = 1e-2f;
  Trainer trainer(make_model(sequence_attention(mesh, plan)), mesh, plan, OptimizerConfig::from(adamw), o, shape);

  torch::nn::Sequential reference = make_model(nullptr);
  torch::optim::AdamW opt(reference->parameters(), torch::optim::AdamWOptions(adamw.lr)
                                                       .weight_decay(adamw.weight_decay)
                                                       .betas({adamw.beta1, adamw.beta2})
                                                       .eps(adamw.eps));
  const int replica = mesh.coord(DeviceMesh::kData);
  for (int s = 0; s < kSteps; ++s) {
    std::vector<torch::Tensor> xs, ys;
    for (int d = 0; d < plan.dp; ++d) {
      torch::manual_seed(1000 + 31 * s + d);
      xs.push_back(torch::randint(0, kVocab, {kBatch, kContext}));
      ys.push_back(torch::randint(0, kVocab, {kBatch, kContext}));
    }
    opt.zero_grad();
    torch::Tensor total = torch::zeros({});
    double want = 0;
    for (int d = 0; d < plan.dp; ++d) {
      const torch::Tensor loss = cross_entropy(reference->forward(xs[d]), ys[d]);
      if (d == replica) want = loss.item<double>();
      total = total + loss / plan.dp;
    }
    total.backward();
    if (a.clip > 0) torch::nn::utils::clip_grad_norm_(reference->parameters(), a.clip);
    opt.step();
    const StepResult got = trainer.step(xs[replica], ys[replica], cross_entropy);
    STRATA_CHECK(std::fabs(got.loss - want) <= 1e-5 * std::fabs(want), "rank ", r.rank, ", step ", s, ": loss ",
                 got.loss, ", the reference's ", want);
  }
  torch::manual_seed(77);
  const torch::Tensor x = torch::randint(0, kVocab, {2, kContext});
  const torch::Tensor got = trainer.evaluate(x);
  if (got.defined()) {  // the last stage
    torch::NoGradGuard no_grad;
    const torch::Tensor want = trainer.shard(reference->forward(x));
    STRATA_CHECK(got.sizes() == want.sizes(), "rank ", r.rank, ": evaluation output ", got.sizes(), ", the reference's ",
                 want.sizes());
    const double diff = ((got - want).norm() / want.norm()).item<double>();
    STRATA_CHECK(diff <= 1e-4, "rank ", r.rank, ": evaluation differs from the reference's by ", diff);
  }
  std::printf("rank %d: %s matches one process: %d steps, evaluation%s\n", r.rank, plan.describe().c_str(), kSteps,
              got.defined() ? " equal" : " on another stage");
  std::fflush(stdout);
  return 0;
}

int run(const Args& a) {
  const std::string nvme = fmt::format("/tmp/strata-llama-check-{}", ::getpid());
  std::filesystem::create_directories(nvme);
  int rc = 1;
  try {
    rc = train(a, nvme);
  } catch (...) {
    std::filesystem::remove_all(nvme);
    throw;
  }
  std::filesystem::remove_all(nvme);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--clip" && i + 1 < argc) {
      a.clip = std::atof(argv[++i]);
    } else if (arg == "--host-bytes" && i + 1 < argc) {
      a.host_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: llama_check [--clip NORM] [--host-bytes N]\n");
      return 2;
    }
  }
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_check: %s\n", e.what());
    return 1;
  }
}
