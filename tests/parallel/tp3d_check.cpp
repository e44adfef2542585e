// Run by the tests through `strata run -n 8` (3D, d = 2): the 3D layers
// (parallel/include/strata/parallel/tensor_parallel_3d.h) against the same
// single-process LibTorch layers, on every rank; full tensors built on rank 0
// and broadcast, each rank taking its part by cube coordinate.
//   - Linear3D from either side, LayerNorm3D, Embedding3D, and a classifier
//     (Linear3D) with cross_entropy_3d: forward output and every gradient
//     within 1e-5;
//   - a size the cube does not divide: a clear error;
//   - the block stack of rank_check.h trained 10 steps by strata, resident
//     and at a quarter-state device budget, as one process.
// Run on 4 ranks it checks that a non-cube is refused, before any collective.
// Prints "rank R: tensor parallel (3D, d x d x d) matches single-process LibTorch" or fails.
#include <torch/torch.h>

#include <cstdio>

#include "strata/parallel/communicator.h"
#include "strata/parallel/tensor_parallel_3d.h"
#include "rank_check.h"

using namespace strata::parallel;
using namespace strata::parallel::rank_check;

namespace {

// Rows of W (output features) this rank holds for inputs on `side`: piece i of output block (piece axis).
torch::Tensor weight_part(const torch::Tensor& w, CubeGrid& g, Side3D side) {
  const int d = g.d();
  const torch::Tensor out_block = vec_block(w, d, g.coord(CubeGrid::piece_axis(side)));
  return block(vec_block(out_block, d, g.i()), 1, 0, d, g.coord(CubeGrid::feature_axis(side)));
}

void layers(Communicator& world, CubeGrid& g) {
  const int d = g.d();
  const int64_t batch = 2 * d * d;
  torch::manual_seed(world.rank() + 1);
  for (const Side3D side : {Side3D::kA, Side3D::kB}) {
    const std::string s = side == Side3D::kA ? " (side A)" : " (side B)";
    const Side3D out = CubeGrid::other(side);
    torch::nn::Linear full(8, 12);
    share_module(world, *full);
    Linear3D lin(full, g, side);
    const torch::Tensor x = shared(world, torch::randn({batch, 3, 8})), w = shared(world, torch::randn({batch, 3, 12}));
    torch::Tensor xr = x.clone().requires_grad_(), xt = g.split(x, side).requires_grad_();
    torch::Tensor yr = full->forward(xr), yt = lin->forward(xt);
    expect_close(yt, g.split(yr, out), "Linear3D output" + s);
    (yr * w).sum().backward();
    (yt * g.split(w, out)).sum().backward();
    expect_close(xt.grad(), g.split(xr.grad(), side), "Linear3D input gradient" + s);
    expect_close(lin->weight.grad(), weight_part(full->weight.grad(), g, side), "Linear3D weight gradient" + s);
    expect_close(lin->bias.grad(), vec_block(full->bias.grad(), d, g.coord(CubeGrid::piece_axis(side))),
                 "Linear3D bias gradient" + s);

    torch::nn::LayerNorm ln_full(torch::nn::LayerNormOptions({8}));
    {
      torch::NoGradGuard no_grad;
      ln_full->weight.normal_();
      ln_full->bias.normal_();
    }
    share_module(world, *ln_full);
    LayerNorm3D ln(ln_full, g, side);
    const torch::Tensor v = shared(world, torch::randn({batch, 3, 8}) * 2 + 1), u = shared(world, torch::randn({batch, 3, 8}));
    torch::Tensor vr = v.clone().requires_grad_(), vt = g.split(v, side).requires_grad_();
    torch::Tensor nr = ln_full->forward(vr), nt = ln->forward(vt);
    expect_close(nt, g.split(nr, side), "LayerNorm3D output" + s);
    (nr * u).sum().backward();
    (nt * g.split(u, side)).sum().backward();
    expect_close(vt.grad(), g.split(vr.grad(), side), "LayerNorm3D input gradient" + s);
    const int f = g.coord(CubeGrid::feature_axis(side));
    expect_close(ln->weight.grad(), vec_block(ln_full->weight.grad(), d, f), "LayerNorm3D weight gradient" + s);
    expect_close(ln->bias.grad(), vec_block(ln_full->bias.grad(), d, f), "LayerNorm3D bias gradient" + s);

    torch::nn::Embedding emb_full(12, 16);
    share_module(world, *emb_full);
    Embedding3D emb(emb_full, g, side);
    const torch::Tensor ids = shared_ids(world, 12, {batch, 3}), e = shared(world, torch::randn({batch, 3, 16}));
    torch::Tensor er = emb_full->forward(ids), et = emb->forward(g.split_batch(ids, side));
    expect_close(et, g.split(er, side), "Embedding3D output" + s);
    (er * e).sum().backward();
    (et * g.split(e, side)).sum().backward();
    const int piece = g.i() * d + g.coord(CubeGrid::piece_axis(side));
    expect_close(emb->weight.grad(), block(block(emb_full->weight.grad(), 1, 0, d, f), 1, 0, d * d, piece),
                 "Embedding3D weight gradient" + s);
  }
  {
    torch::nn::Linear full(torch::nn::LinearOptions(8, 16).bias(false));
    share_module(world, *full);
    Linear3D head(full, g, Side3D::kA);
    const torch::Tensor x = shared(world, torch::randn({batch, 8})), target = shared_ids(world, 16, {batch});
    torch::Tensor xr = x.clone().requires_grad_(), xt = g.split(x, Side3D::kA).requires_grad_();
    torch::Tensor lr = torch::nn::functional::cross_entropy(full->forward(xr), target);
    torch::Tensor lt = cross_entropy_3d(head->forward(xt), g.split_batch(target, Side3D::kB), g, Side3D::kB);
    expect_close(lt, lr, "cross_entropy_3d loss");
    lr.backward();
    lt.backward();
    expect_close(xt.grad(), g.split(xr.grad(), Side3D::kA), "classifier input gradient");
    expect_close(head->weight.grad(), weight_part(full->weight.grad(), g, Side3D::kA), "classifier weight gradient");
  }
  const std::string odd = error_of([&] { Linear3D(torch::nn::Linear(8, 2 * d + 1), g, Side3D::kA); });
  STRATA_CHECK(odd.find("splits the output features (" + std::to_string(2 * d + 1) + ")") != std::string::npos,
               "a Linear3D of ", 2 * d + 1, " outputs gave: ", odd);
}

struct Tp3d : torch::nn::Module {
  CubeGrid& g;
  Embedding3D emb{nullptr};
  std::vector<LayerNorm3D> norms;
  std::vector<Linear3D> ups, downs;
  LayerNorm3D final_norm{nullptr};
  Linear3D head{nullptr};
  // Activations between blocks on side A; the up projection goes to B and the down one back.
  Tp3d(BlockStack& f, CubeGrid& grid) : g(grid) {
    emb = register_module("emb", Embedding3D(f.emb, g, Side3D::kA));
    for (size_t b = 0; b < f.ups.size(); ++b) {
      norms.push_back(register_module("norm" + std::to_string(b), LayerNorm3D(f.norms[b], g, Side3D::kA)));
      ups.push_back(register_module("up" + std::to_string(b), Linear3D(f.ups[b], g, Side3D::kA)));
      downs.push_back(register_module("down" + std::to_string(b), Linear3D(f.downs[b], g, Side3D::kB)));
    }
    final_norm = register_module("final_norm", LayerNorm3D(f.final_norm, g, Side3D::kA));
    head = register_module("head", Linear3D(f.head, g, Side3D::kA));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& target) {
    torch::Tensor x = emb->forward(g.split_batch(ids, Side3D::kA));
    for (size_t b = 0; b < ups.size(); ++b) x = x + downs[b]->forward(torch::gelu(ups[b]->forward(norms[b]->forward(x))));
    const torch::Tensor logits = head->forward(final_norm->forward(x));  // side B
    return cross_entropy_3d(logits.reshape({-1, logits.size(-1)}), g.split_batch(target, Side3D::kB).reshape(-1), g,
                            Side3D::kB);
  }
};

void training(Communicator& world, CubeGrid& g, bool budgeted) {
  torch::manual_seed(world.rank() + 7);
  BlockStack reference(world);
  Tp3d model(reference, g);
  train_against(world, reference, [&](const torch::Tensor& i, const torch::Tensor& t) { return reference.loss(i, t); },
                model, [&](const torch::Tensor& i, const torch::Tensor& t) { return model.loss(i, t); }, kVocab, 2 * g.d() * g.d(),
                budgeted ? DeviceBudget::kQuarter : DeviceBudget::kResident);
  const int d = g.d();
  for (size_t b = 0; b < reference.ups.size(); ++b) {
    expect_close(model.ups[b]->weight, weight_part(reference.ups[b]->weight, g, Side3D::kA), "trained up part");
    expect_close(model.downs[b]->weight, weight_part(reference.downs[b]->weight, g, Side3D::kB), "trained down part");
    expect_close(model.norms[b]->weight, vec_block(reference.norms[b]->weight, d, g.k()), "trained norm block");
  }
  expect_close(model.head->weight, weight_part(reference.head->weight, g, Side3D::kA), "trained head part");
}

}  // namespace

int main() {
  try {
    std::shared_ptr<Communicator> world = make_gloo_communicator(Rendezvous::from_env());
    if (world->world_size() != 8) {
      const std::string wrong = error_of([&] { CubeGrid grid(*world); });
      STRATA_CHECK(wrong.find("3D tensor parallelism needs d x d x d ranks") != std::string::npos,
                   "a cube of ", world->world_size(), " ranks gave: ", wrong);
      std::printf("rank %d: 3D on %d ranks refused: %s\n", world->rank(), world->world_size(), wrong.c_str());
      world->barrier()->wait();  // rank 0 serves the rendezvous: nobody leaves early
      return 0;
    }
    CubeGrid grid(*world);
    layers(*world, grid);
    training(*world, grid, /*budgeted=*/false);
    training(*world, grid, /*budgeted=*/true);
    std::printf("rank %d: tensor parallel (3D, %d x %d x %d) matches single-process LibTorch (worst relative "
                "difference %.2e)\n", world->rank(), grid.d(), grid.d(), grid.d(), worst());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp3d_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
