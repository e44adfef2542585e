// Run by the tests through `strata run -n N`: 1D tensor-parallel layers
// (parallel/include/strata/parallel/tensor_parallel.h) against the same
// single-process LibTorch layers, on every rank. Full tensors are built on
// rank 0 and broadcast; each rank takes its slice.
//   - column-parallel linear (output gathered), row-parallel linear (input
//     sliced here), and the pair as an MLP: forward output and every gradient
//     (input, weights, biases) within 1e-5;
//   - vocab-parallel embedding and a column-parallel head with the
//     vocab-parallel cross-entropy: loss and gradients;
//   - a layer size the group does not divide: refused at construction;
//   - a model of them trained 10 steps by strata (attach, three chunk pages of
//     device per rank, gradient-norm clipping active) with the same gradient
//     norms, losses and weights as one process with clip_grad_norm_ and
//     torch::optim::AdamW.
// Prints "rank R: tensor parallel (1D, P ranks) matches single-process LibTorch" or fails.
#include <torch/torch.h>

#include <cstdio>

#include "strata/core/error.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/tensor_collectives.h"
#include "strata/parallel/tensor_parallel.h"

using namespace strata::parallel;

namespace {

double worst = 0;

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what, double tol = 1e-5) {
  STRATA_CHECK(got.sizes() == want.sizes(), what, ": shape ", got.sizes(), " vs ", want.sizes());
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  const double diff = (got - want).abs().max().item<double>() / scale;
  worst = std::max(worst, diff);
  STRATA_CHECK(diff < tol, what, " differs from single-process LibTorch by ", diff, " (relative to its largest value)");
}

// Rank 0's values on every rank.
torch::Tensor shared(Communicator& comm, torch::Tensor t) {
  t = t.contiguous();
  broadcast(comm, t, 0)->wait();
  return t;
}

void share_module(Communicator& comm, torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(shared(comm, p.detach().clone()));
}

torch::Tensor rows(const torch::Tensor& t, Communicator& comm) {
  const auto [b, e] = slice_of(t.size(0), comm, "rows");
  return t.narrow(0, b, e - b);
}
torch::Tensor cols(const torch::Tensor& t, Communicator& comm) {
  const auto [b, e] = slice_of(t.size(1), comm, "columns");
  return t.narrow(1, b, e - b);
}

void layers(Communicator& comm) {
  // A size the group does not divide: a clear error at construction, before any collective.
  bool refused = false;
  try {
    ColumnParallelLinear(8, 9, comm);
  } catch (const strata::Error& e) {
    refused = std::string(e.what()).find("splits the output features (9) evenly") != std::string::npos;
  }
  STRATA_CHECK(refused, "a column-parallel layer of 9 outputs over ", comm.world_size(), " ranks was not refused");
  torch::manual_seed(comm.rank() + 1);  // replicas differ until shared
  // Column-parallel, output gathered.
  torch::nn::Linear full(8, 12);
  share_module(comm, *full);
  ColumnParallelLinear col(full, comm, /*gather_output=*/true);
  const torch::Tensor x = shared(comm, torch::randn({6, 8})), w = shared(comm, torch::randn({6, 12}));
  torch::Tensor xr = x.clone().requires_grad_(), xt = x.clone().requires_grad_();
  torch::Tensor yr = full->forward(xr), yt = col->forward(xt);
  expect_close(yt, yr, "column-parallel output");
  (yr * w).sum().backward();
  (yt * w).sum().backward();
  expect_close(xt.grad(), xr.grad(), "column-parallel input gradient");
  expect_close(col->weight.grad(), rows(full->weight.grad(), comm), "column-parallel weight gradient");
  expect_close(col->bias.grad(), rows(full->bias.grad().unsqueeze(1), comm).squeeze(1), "column-parallel bias gradient");

  // Row-parallel, input sliced here.
  torch::nn::Linear full_row(12, 8);
  share_module(comm, *full_row);
  RowParallelLinear row(full_row, comm, /*input_is_parallel=*/false);
  const torch::Tensor x2 = shared(comm, torch::randn({6, 12})), w2 = shared(comm, torch::randn({6, 8}));
  torch::Tensor ar = x2.clone().requires_grad_(), at = x2.clone().requires_grad_();
  torch::Tensor zr = full_row->forward(ar), zt = row->forward(at);
  expect_close(zt, zr, "row-parallel output");
  (zr * w2).sum().backward();
  (zt * w2).sum().backward();
  expect_close(at.grad(), ar.grad(), "row-parallel input gradient");
  expect_close(row->weight.grad(), cols(full_row->weight.grad(), comm), "row-parallel weight gradient");
  expect_close(row->bias.grad(), full_row->bias.grad(), "row-parallel bias gradient");

  // The Megatron MLP: column (sliced output) -> GELU -> row (sliced input).
  torch::nn::Linear up(8, 16), down(16, 8);
  share_module(comm, *up);
  share_module(comm, *down);
  ColumnParallelLinear tup(up, comm);
  RowParallelLinear tdown(down, comm);
  torch::Tensor mr = x.clone().requires_grad_(), mt = x.clone().requires_grad_();
  torch::Tensor outr = down->forward(torch::gelu(up->forward(mr)));
  torch::Tensor outt = tdown->forward(torch::gelu(tup->forward(mt)));
  expect_close(outt, outr, "MLP output");
  outr.pow(2).sum().backward();
  outt.pow(2).sum().backward();
  expect_close(mt.grad(), mr.grad(), "MLP input gradient");
  expect_close(tup->weight.grad(), rows(up->weight.grad(), comm), "MLP up weight gradient");
  expect_close(tdown->weight.grad(), cols(down->weight.grad(), comm), "MLP down weight gradient");

  // Vocab-parallel embedding, a column-parallel head, the vocab-parallel cross-entropy.
  torch::nn::Embedding emb(20, 8);
  torch::nn::Linear head(torch::nn::LinearOptions(8, 20).bias(false));
  share_module(comm, *emb);
  share_module(comm, *head);
  VocabParallelEmbedding temb(emb, comm);
  ColumnParallelLinear thead(head, comm);
  const torch::Tensor ids = shared(comm, torch::randint(0, 20, {10}).to(torch::kFloat32)).to(torch::kLong);
  const torch::Tensor target = shared(comm, torch::randint(0, 20, {10}).to(torch::kFloat32)).to(torch::kLong);
  torch::Tensor lr = torch::nn::functional::cross_entropy(head->forward(torch::tanh(emb->forward(ids))), target);
  torch::Tensor lt = vocab_parallel_cross_entropy(thead->forward(torch::tanh(temb->forward(ids))), target, comm);
  expect_close(lt, lr, "vocab-parallel cross-entropy");
  lr.backward();
  lt.backward();
  expect_close(temb->weight.grad(), rows(emb->weight.grad(), comm), "vocab-parallel embedding gradient");
  expect_close(thead->weight.grad(), rows(head->weight.grad(), comm), "vocab-parallel head gradient");
}

struct Full : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr}, head{nullptr};
  Full() {
    emb = register_module("emb", torch::nn::Embedding(32, 16));
    up = register_module("up", torch::nn::Linear(16, 64));
    down = register_module("down", torch::nn::Linear(64, 16));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(16, 32).bias(false)));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& target) {
    torch::Tensor x = emb->forward(ids);
    x = x + down->forward(torch::gelu(up->forward(x)));
    return torch::nn::functional::cross_entropy(head->forward(x), target);
  }
};

struct Tp : torch::nn::Module {
  Communicator& comm;
  VocabParallelEmbedding emb{nullptr};
  ColumnParallelLinear up{nullptr}, head{nullptr};
  RowParallelLinear down{nullptr};
  Tp(Full& f, Communicator& c) : comm(c) {
    emb = register_module("emb", VocabParallelEmbedding(f.emb, c));
    up = register_module("up", ColumnParallelLinear(f.up, c));
    down = register_module("down", RowParallelLinear(f.down, c));
    head = register_module("head", ColumnParallelLinear(f.head, c));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& target) {
    torch::Tensor x = emb->forward(ids);
    x = x + down->forward(torch::gelu(up->forward(x)));
    return vocab_parallel_cross_entropy(head->forward(x), target, comm);
  }
};

void training(Communicator& comm) {
  torch::manual_seed(comm.rank() + 7);
  Full reference;
  share_module(comm, reference);
  Tp model(reference, comm);
  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  torch::optim::AdamW adamw(reference.parameters(), torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  EngineOptions o;
  // Three 4 KiB chunk pages on the device: an operator's parameters fit, the rank's model does not.
  o.budgets = {3 * 4096, static_cast<uint64_t>(params) * 64 + (1 << 20), 0};
  o.chunk_elems = 256;
  // Small enough that every step clips: the norm must count slices across
  // the group and the replicated bias once (Note [Clipping across the tensor group]).
  o.clip_norm = 0.5;
  {
    auto engine = attach(model, cfg, o);  // no communicator: the tensor group is not a data-parallel one
    for (int s = 0; s < 10; ++s) {
      const torch::Tensor ids = shared(comm, torch::randint(0, 32, {24}).to(torch::kFloat32)).to(torch::kLong);
      const torch::Tensor target = shared(comm, torch::randint(0, 32, {24}).to(torch::kFloat32)).to(torch::kLong);
      adamw.zero_grad();
      torch::Tensor ref = reference.loss(ids, target);
      ref.backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(reference.parameters(), o.clip_norm);
      STRATA_CHECK(ref_norm > o.clip_norm, "the reference's gradient norm ", ref_norm, " did not need clipping");
      adamw.step();
      const StepResult r = engine->train_step([&] { return model.loss(ids, target); });
      const double norm_diff = std::abs(r.grad_norm - ref_norm) / ref_norm;
      worst = std::max(worst, norm_diff);
      STRATA_CHECK(norm_diff < 1e-5, "rank ", comm.rank(), ": step ", s, " gradient norm ", r.grad_norm,
                   " vs single process ", ref_norm);
      const double diff = std::abs(r.loss - ref.item<double>()) / std::abs(ref.item<double>());
      worst = std::max(worst, diff);
      STRATA_CHECK(diff < 1e-5, "rank ", comm.rank(), ": step ", s, " loss ", r.loss, " vs single process ",
                   ref.item<double>());
    }
    const auto dev = engine->tier_stats(strata::memory::Tier::kDevice);
    STRATA_CHECK(dev.peak <= dev.budget && dev.evictions > 0, "the device tier held ", dev.peak, " of ", dev.budget,
                 " bytes with ", dev.evictions, " evictions: it must have been too small for the model");
  }
  expect_close(model.emb->weight, rows(reference.emb->weight, comm), "trained embedding slice");
  expect_close(model.up->weight, rows(reference.up->weight, comm), "trained up slice");
  expect_close(model.down->weight, cols(reference.down->weight, comm), "trained down slice");
  expect_close(model.down->bias, reference.down->bias, "trained replicated bias");
  expect_close(model.head->weight, rows(reference.head->weight, comm), "trained head slice");
}

}  // namespace

int main() {
  try {
    std::shared_ptr<Communicator> comm = make_gloo_communicator(Rendezvous::from_env());
    layers(*comm);
    training(*comm);
    std::printf("rank %d: tensor parallel (1D, %d ranks) matches single-process LibTorch (worst relative difference "
                "%.2e)\n", comm->rank(), comm->world_size(), worst);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
