#pragma once
// Helpers of the multi-rank checks run through `strata run -n` (tp_check,
// tp2d_check, tp3d_check): rank 0's tensors on every rank, and comparisons
// against single-process LibTorch that throw strata::Error naming the tensor.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "strata/core/error.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/tensor_collectives.h"

namespace strata::parallel::rank_check {

/// The largest relative difference any expect_close saw (printed at the end).
inline double& worst() {
  static double w = 0;
  return w;
}

/// `got` within `tol` of `want`, relative to want's largest value.
inline void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what,
                         double tol = 1e-5) {
  STRATA_CHECK(got.sizes() == want.sizes(), what, ": shape ", got.sizes(), " vs ", want.sizes());
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  const double diff = (got - want).abs().max().item<double>() / scale;
  worst() = std::max(worst(), diff);
  STRATA_CHECK(diff < tol, what, " differs from single-process LibTorch by ", diff, " (relative to its largest value)");
}

/// Rank 0's values on every rank.
inline torch::Tensor shared(Communicator& comm, torch::Tensor t) {
  t = t.contiguous();
  broadcast(comm, t, 0)->wait();
  return t;
}
inline torch::Tensor shared_ids(Communicator& comm, int64_t vocab, std::vector<int64_t> shape) {
  return shared(comm, torch::randint(0, vocab, shape).to(torch::kFloat32)).to(torch::kLong);
}
inline void share_module(Communicator& comm, torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(shared(comm, p.detach().clone()));
}

/// Block (b0, b1) of a matrix cut into n0 x n1 blocks; block b of a vector cut into n.
inline torch::Tensor block(const torch::Tensor& t, int n0, int b0, int n1, int b1) {
  const int64_t r = t.size(0) / n0, c = t.size(1) / n1;
  return t.narrow(0, r * b0, r).narrow(1, c * b1, c);
}
inline torch::Tensor vec_block(const torch::Tensor& t, int n, int b) {
  return t.narrow(0, t.size(0) / n * b, t.size(0) / n);
}

/// Stops answering, as a dead or hung rank would, until the launcher stops
/// this process (after the rank under test failed); exits 3 if it never does.
[[noreturn]] inline void hang_until_stopped() {
  std::this_thread::sleep_for(std::chrono::seconds(60));
  std::_Exit(3);
}

/// What `f` threw (a strata::Error), or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const strata::Error& e) {
    return e.what();
  }
  return "no error";
}

/// A reference model for the tensor-parallel modes: an embedding, two
/// pre-norm MLP blocks with residuals, a final norm and a classifier, with
/// non-trivial norms; rank 0's values on every rank.
constexpr int kVocab = 64;

struct BlockStack : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  std::vector<torch::nn::LayerNorm> norms;
  std::vector<torch::nn::Linear> ups, downs;
  torch::nn::LayerNorm final_norm{nullptr};
  torch::nn::Linear head{nullptr};
  explicit BlockStack(Communicator& world) {
    emb = register_module("emb", torch::nn::Embedding(kVocab, 32));
    for (int b = 0; b < 2; ++b) {
      norms.push_back(register_module("norm" + std::to_string(b), torch::nn::LayerNorm(torch::nn::LayerNormOptions({32}))));
      ups.push_back(register_module("up" + std::to_string(b), torch::nn::Linear(32, 64)));
      downs.push_back(register_module("down" + std::to_string(b), torch::nn::Linear(64, 32)));
    }
    final_norm = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(32, kVocab).bias(false)));
    {
      torch::NoGradGuard no_grad;
      for (auto& n : norms) n->weight.normal_(1.0, 0.2), n->bias.normal_(0.0, 0.2);
    }
    share_module(world, *this);
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& target) {
    torch::Tensor x = emb->forward(ids);
    for (size_t b = 0; b < ups.size(); ++b) x = x + downs[b]->forward(torch::gelu(ups[b]->forward(norms[b]->forward(x))));
    return torch::nn::functional::cross_entropy(head->forward(final_norm->forward(x)).view({-1, kVocab}), target.view(-1));
  }
};

using LossFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

/// How train_against sizes the device tier from this rank's model state.
enum class DeviceBudget {
  kResident,   // everything fits
  kPages,      // three 4 KiB chunk pages of 256 elements: an operator's parameters fit, the model does not
  kQuarter,    // a quarter of the model state, in chunks of 64 elements
};

/// Trains `model` (this rank's parts of `reference`) 10 steps with strata
/// against `reference` with clip_grad_norm_ and torch::optim::AdamW:
/// gradient norms and losses within 1e-5, every step clipping. Each step
/// draws ids and targets [replicas, batch, 4] of `vocab` (rank 0's on every
/// rank; replicas = dp's size, 1 without dp): the reference trains on all of
/// them, `loss(ids, target)` gets this rank's replica's and returns this
/// rank's loss, the mean of the replicas' losses being the reference's. `dp`
/// (the data axis, or null) at `zero_stage` for tensor x data parallelism.
/// Any budget but kResident must evict.
inline void train_against(Communicator& world, torch::nn::Module& reference, const LossFn& reference_loss,
                          torch::nn::Module& model, const LossFn& loss, int64_t vocab, int64_t batch,
                          DeviceBudget budget, std::shared_ptr<Communicator> dp = nullptr, int zero_stage = 0) {
  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  torch::optim::AdamW adamw(reference.parameters(), torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  EngineOptions o;
  const uint64_t state = static_cast<uint64_t>(params) * model_state_bytes_per_param(o.precision);
  const uint64_t room = 4 * state + (1 << 20);
  o.budgets = {budget == DeviceBudget::kResident ? room : (budget == DeviceBudget::kPages ? 3 * 4096 : state / 4),
               room, 0};
  o.chunk_elems = budget == DeviceBudget::kResident ? 0 : (budget == DeviceBudget::kPages ? 256 : 64);
  o.zero_stage = zero_stage;
  o.clip_norm = 0.5;  // every step clips: the norm counts each part once (Note [Clipping across the tensor group])
  const int replicas = dp ? dp->world_size() : 1, replica = dp ? dp->rank() : 0;
  auto engine = attach(model, cfg, o, dp);  // the data axis, never the tensor group
  for (int s = 0; s < 10; ++s) {
    const torch::Tensor ids = shared_ids(world, vocab, {replicas, batch, 4});
    const torch::Tensor target = shared_ids(world, vocab, {replicas, batch, 4});
    adamw.zero_grad();
    torch::Tensor ref = reference_loss(ids.flatten(0, 1), target.flatten(0, 1));
    ref.backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(reference.parameters(), o.clip_norm);
    STRATA_CHECK(ref_norm > o.clip_norm, "the reference's gradient norm ", ref_norm, " did not need clipping");
    adamw.step();
    const StepResult r = engine->train_step([&] { return loss(ids[replica], target[replica]); });
    const double norm_diff = std::abs(r.grad_norm - ref_norm) / ref_norm;
    worst() = std::max(worst(), norm_diff);
    STRATA_CHECK(norm_diff < 1e-5, "rank ", world.rank(), ": step ", s, " gradient norm ", r.grad_norm,
                 " vs single process ", ref_norm);
    double mean = r.loss;
    if (dp) {
      mean = 0;
      for (double l : all_gather_values(*dp, {r.loss})) mean += l / replicas;
    }
    const double diff = std::abs(mean - ref.item<double>()) / std::abs(ref.item<double>());
    worst() = std::max(worst(), diff);
    STRATA_CHECK(diff < 1e-5, "rank ", world.rank(), ": step ", s, " loss ", mean, " vs single process ",
                 ref.item<double>());
  }
  const auto dev = engine->tier_stats(strata::memory::Tier::kDevice);
  STRATA_CHECK(dev.peak <= dev.budget, "the device tier held ", dev.peak, " of its budget ", dev.budget);
  STRATA_CHECK(budget == DeviceBudget::kResident || dev.evictions > 0, "a device budget of ", dev.budget,
               " bytes evicted nothing: it must have been too small for the model");
}

}  // namespace strata::parallel::rank_check
