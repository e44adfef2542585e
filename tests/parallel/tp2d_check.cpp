// Run by the tests through `strata run -n 4` (2D, q = 2) and `-n 8` (2.5D,
// q = 2, depth 2): the 2D layers (parallel/include/strata/parallel/tensor_parallel_2d.h)
// against the same single-process LibTorch layers, on every rank. Full
// tensors are built on rank 0 and broadcast; each rank takes its block by
// grid coordinate.
//   - Linear2D, LayerNorm2D, Embedding2D, VocabEmbedding2D and a classifier
//     (Linear2D) with cross_entropy_2d: forward output and every gradient
//     (input, weights, biases) within 1e-5;
//   - a grid the world does not fit and a size the grid does not divide: clear errors;
//   - a block stack (vocab embedding, pre-norm MLP blocks with residuals, final
//     norm, classifier) trained 10 steps by strata, resident and with a
//     device budget of a quarter of each rank's model state, with clipping at
//     every step: the gradient norms, losses and weights of one process with
//     clip_grad_norm_ and torch::optim::AdamW.
// Prints "rank R: tensor parallel (2D|2.5D, q x q x d) matches single-process LibTorch" or fails.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#include "strata/core/error.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/tensor_collectives.h"
#include "strata/parallel/tensor_parallel.h"
#include "strata/parallel/tensor_parallel_2d.h"
#include "rank_check.h"

using namespace strata::parallel;

namespace {

using rank_check::block;
using rank_check::BlockStack;
using rank_check::DeviceBudget;
using rank_check::kVocab;
using rank_check::train_against;
using rank_check::expect_close;
using rank_check::share_module;
using rank_check::shared;
using rank_check::shared_ids;
using rank_check::vec_block;
using rank_check::worst;

std::string expect_error(const std::function<void()>& f) { return rank_check::error_of(f); }

void layers(Communicator& world, TensorGrid& g) {
  const int q = g.q();
  const int64_t batch = 2 * g.batch_blocks();
  torch::manual_seed(world.rank() + 1);  // replicas differ until shared
  // Linear2D: output, input gradient, weight and bias gradients.
  {
    torch::nn::Linear full(8, 12);
    share_module(world, *full);
    Linear2D lin(full, g);
    const torch::Tensor x = shared(world, torch::randn({batch, 3, 8})), w = shared(world, torch::randn({batch, 3, 12}));
    torch::Tensor xr = x.clone().requires_grad_(), xt = g.split(x).requires_grad_();
    torch::Tensor yr = full->forward(xr), yt = lin->forward(xt);
    expect_close(yt, g.split(yr), "Linear2D output");
    (yr * w).sum().backward();
    (yt * g.split(w)).sum().backward();
    expect_close(xt.grad(), g.split(xr.grad()), "Linear2D input gradient");
    expect_close(lin->weight.grad(), block(full->weight.grad(), q, g.col(), q, g.row()), "Linear2D weight gradient");
    expect_close(lin->bias.grad(), vec_block(full->bias.grad(), q, g.col()), "Linear2D bias gradient");
  }
  // LayerNorm2D.
  {
    torch::nn::LayerNorm full(torch::nn::LayerNormOptions({8}));
    {
      torch::NoGradGuard no_grad;
      full->weight.normal_();
      full->bias.normal_();
    }
    share_module(world, *full);
    LayerNorm2D ln(full, g);
    const torch::Tensor x = shared(world, torch::randn({batch, 3, 8}) * 3 + 1), w = shared(world, torch::randn({batch, 3, 8}));
    torch::Tensor xr = x.clone().requires_grad_(), xt = g.split(x).requires_grad_();
    torch::Tensor yr = full->forward(xr), yt = ln->forward(xt);
    expect_close(yt, g.split(yr), "LayerNorm2D output");
    (yr * w).sum().backward();
    (yt * g.split(w)).sum().backward();
    expect_close(xt.grad(), g.split(xr.grad()), "LayerNorm2D input gradient");
    expect_close(ln->weight.grad(), vec_block(full->weight.grad(), q, g.col()), "LayerNorm2D weight gradient");
    expect_close(ln->bias.grad(), vec_block(full->bias.grad(), q, g.col()), "LayerNorm2D bias gradient");
  }
  // Embedding2D (dim in q^2 blocks) and VocabEmbedding2D.
  {
    torch::nn::Embedding full(12, 8);
    share_module(world, *full);
    Embedding2D emb(full, g);
    VocabEmbedding2D vemb(full, g);
    const torch::Tensor ids = shared_ids(world, 12, {batch, 3}), w = shared(world, torch::randn({batch, 3, 8}));
    torch::Tensor yr = full->forward(ids), yt = emb->forward(g.split_batch(ids)), yv = vemb->forward(g.split_batch(ids));
    expect_close(yt, g.split(yr), "Embedding2D output");
    expect_close(yv, g.split(yr), "VocabEmbedding2D output");
    (yr * w).sum().backward();
    (yt * g.split(w)).sum().backward();
    (yv * g.split(w)).sum().backward();
    expect_close(emb->weight.grad(), block(full->weight.grad(), 1, 0, q * q, g.col() * q + g.row()),
                 "Embedding2D weight gradient");
    expect_close(vemb->weight.grad(), block(full->weight.grad(), q, g.row(), q, g.col()), "VocabEmbedding2D weight gradient");
  }
  // A classifier and its cross-entropy: the loss of the whole batch on every rank, logits never gathered.
  {
    torch::nn::Linear full(torch::nn::LinearOptions(8, 16).bias(false));
    share_module(world, *full);
    Linear2D head(full, g);
    const torch::Tensor x = shared(world, torch::randn({batch, 8})), target = shared_ids(world, 16, {batch});
    torch::Tensor xr = x.clone().requires_grad_(), xt = g.split(x).requires_grad_();
    torch::Tensor lr = torch::nn::functional::cross_entropy(full->forward(xr), target);
    torch::Tensor lt = cross_entropy_2d(head->forward(xt), g.split_batch(target), g);
    expect_close(lt, lr, "cross_entropy_2d loss");
    lr.backward();
    lt.backward();
    expect_close(xt.grad(), g.split(xr.grad()), "classifier input gradient");
    expect_close(head->weight.grad(), block(full->weight.grad(), q, g.col(), q, g.row()), "classifier weight gradient");
  }
  // Sizes the grid does not divide: errors naming the size, at construction.
  const std::string odd = expect_error([&] { Linear2D(torch::nn::Linear(8, 2 * q + 1), g); });
  const std::string want = "splits the output features (" + std::to_string(2 * q + 1) + ") of a Linear2D into";
  STRATA_CHECK(odd.find(want) != std::string::npos,
               "a Linear2D of ", 2 * q + 1, " outputs gave: ", odd);
}

struct Tp2d : torch::nn::Module {
  TensorGrid& g;
  VocabEmbedding2D emb{nullptr};
  std::vector<LayerNorm2D> norms;
  std::vector<Linear2D> ups, downs;
  LayerNorm2D final_norm{nullptr};
  Linear2D head{nullptr};
  Tp2d(BlockStack& f, TensorGrid& grid) : g(grid) {
    emb = register_module("emb", VocabEmbedding2D(f.emb, g));
    for (size_t b = 0; b < f.ups.size(); ++b) {
      norms.push_back(register_module("norm" + std::to_string(b), LayerNorm2D(f.norms[b], g)));
      ups.push_back(register_module("up" + std::to_string(b), Linear2D(f.ups[b], g)));
      downs.push_back(register_module("down" + std::to_string(b), Linear2D(f.downs[b], g)));
    }
    final_norm = register_module("final_norm", LayerNorm2D(f.final_norm, g));
    head = register_module("head", Linear2D(f.head, g));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& target) {
    torch::Tensor x = emb->forward(ids);
    for (size_t b = 0; b < ups.size(); ++b) x = x + downs[b]->forward(torch::gelu(ups[b]->forward(norms[b]->forward(x))));
    const torch::Tensor logits = head->forward(final_norm->forward(x));
    return cross_entropy_2d(logits.reshape({-1, logits.size(-1)}), target.reshape(-1), g);
  }
};

void training(Communicator& world, TensorGrid& g, bool budgeted) {
  torch::manual_seed(world.rank() + 7);
  BlockStack reference(world);
  Tp2d model(reference, g);
  train_against(world, reference, [&](const torch::Tensor& i, const torch::Tensor& t) { return reference.loss(i, t); },
                model, [&](const torch::Tensor& i, const torch::Tensor& t) { return model.loss(g.split_batch(i), g.split_batch(t)); }, kVocab, 2 * g.batch_blocks(),
                budgeted ? DeviceBudget::kQuarter : DeviceBudget::kResident);
  const int q = g.q();
  expect_close(model.emb->weight, block(reference.emb->weight, q, g.row(), q, g.col()), "trained embedding block");
  for (size_t b = 0; b < reference.ups.size(); ++b) {
    expect_close(model.ups[b]->weight, block(reference.ups[b]->weight, q, g.col(), q, g.row()), "trained up block");
    expect_close(model.downs[b]->bias, vec_block(reference.downs[b]->bias, q, g.col()), "trained down bias block");
    expect_close(model.norms[b]->weight, vec_block(reference.norms[b]->weight, q, g.col()), "trained norm block");
  }
  expect_close(model.head->weight, block(reference.head->weight, q, g.col(), q, g.row()), "trained head block");
}

}  // namespace

int main(int argc, char** argv) {
  // --stuck: rank 1 (rank 0's row) stops answering after the grid is built (as
  // a dead or hung rank would); the others must fail with an error within the
  // communicator's timeout (STRATA_COMM_TIMEOUT), not hang.
  const bool stuck = argc > 1 && std::string(argv[1]) == "--stuck";
  try {
    // make_gloo_communicator takes the timeout from STRATA_COMM_TIMEOUT.
    std::shared_ptr<Communicator> world = make_gloo_communicator(Rendezvous::from_env());
    const int depth = world->world_size() == 8 ? 2 : 1;
    // A world the mode does not fit (2D on 8 ranks, 2.5D of depth 2 on 4): refused before any collective.
    const std::string wrong = expect_error([&] { TensorGrid(*world, world->world_size() == 8 ? 1 : 2); });
    STRATA_CHECK(wrong.find("tensor parallelism needs q x q") != std::string::npos, "a grid of the wrong size gave: ",
                 wrong);
    TensorGrid grid(*world, depth);
    if (stuck && world->rank() == 1) {  // in rank 0's row
      rank_check::hang_until_stopped();
    }
    if (stuck) {
      torch::nn::Linear full(8, 8);
      Linear2D lin(full, grid);
      lin->forward(grid.split(torch::randn({2 * grid.batch_blocks(), 8})));
      // Ranks whose groups miss rank 1 may finish; rank 0's row holds it.
      STRATA_CHECK(world->rank() != 0, "a Linear2D forward finished with a rank of the grid not answering");
      rank_check::hang_until_stopped();
    }
    layers(*world, grid);
    training(*world, grid, /*budgeted=*/false);
    training(*world, grid, /*budgeted=*/true);
    std::printf("rank %d: tensor parallel (%s, %d x %d x %d) matches single-process LibTorch (worst relative "
                "difference %.2e)\n", world->rank(), depth == 1 ? "2D" : "2.5D", grid.q(), grid.q(), depth, worst());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp2d_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
