// Run by the tests through `strata run -n N`: data-parallel strata training
// against single-process plain LibTorch on the combined batch, on every rank.
//   dp_check [--offload] [--accumulation K] [--unused]
//   --offload       device budget a quarter of the model state, optimizer state on NVMe
//   --accumulation  K micro-steps per step (communication only on the last)
//   --unused        a branch only rank 0 uses: its gradients exist on one rank only
// Prints "rank R: data parallel matches single-process training (...)" or fails.
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "strata/core/error.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/engine.h"

using namespace strata::parallel;

struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, side{nullptr}, c{nullptr};
  Net() {
    a = register_module("a", torch::nn::Linear(32, 64));
    b = register_module("b", torch::nn::Linear(64, 64));
    side = register_module("side", torch::nn::Linear(64, 64));
    c = register_module("c", torch::nn::Linear(64, 8));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_side) {
    torch::Tensor h = torch::relu(b->forward(torch::relu(a->forward(x))));
    if (use_side) h = h + torch::tanh(side->forward(h));
    return c->forward(h);
  }
};

int main(int argc, char** argv) {
  bool offload = false, unused = false;
  int accumulation = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--offload") offload = true;
    if (a == "--unused") unused = true;
    if (a == "--accumulation" && i + 1 < argc) accumulation = std::atoi(argv[++i]);
  }
  try {
    std::shared_ptr<Communicator> comm = make_gloo_communicator(Rendezvous::from_env());
    const int rank = comm->rank(), world = comm->world_size();
    torch::manual_seed(100 + rank);  // replicas start apart: attach broadcasts rank 0's parameters
    auto model = std::make_shared<Net>();
    torch::manual_seed(1);
    auto reference = std::make_shared<Net>();  // rank 0's initial weights, as in every rank's reference
    if (rank == 0) {
      torch::NoGradGuard g;
      auto src = reference->parameters();
      auto dst = model->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    AdamWConfig cfg;
    cfg.lr = 1e-2f;
    torch::optim::AdamW opt(reference->parameters(), torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    EngineOptions o;
    o.chunk_elems = 64 * 64 + 64;
    o.grad_accumulation = accumulation;
    o.budgets = {static_cast<uint64_t>(params) * 16, static_cast<uint64_t>(params) * 32, 0};
    const std::string nvme = "/tmp/strata-dp-check-" + std::to_string(::getpid());
    if (offload) {
      o.budgets = {static_cast<uint64_t>(params) * 16 / 4 / 4096 * 4096 + 8192, static_cast<uint64_t>(params) * 16,
                   static_cast<uint64_t>(params) * 64};
      o.nvme_dir = nvme;
      o.nvme_optim_fraction = 1.0;
    }
    const int steps = 5, batch = 8;
    {
      auto engine = attach(*model, cfg, o, comm);
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        for (auto& p : reference->parameters()) p.mutable_grad() = torch::Tensor();
        for (int m = 0; m < accumulation; ++m) {
          torch::manual_seed(1000 + s * 10 + m);  // the same combined batch on every rank
          const torch::Tensor x = torch::randn({world * batch, 32}), y = torch::randn({world * batch, 8});
          // Reference: the mean over ranks of each rank's loss, on one process.
          torch::Tensor ref = torch::zeros({});
          for (int r = 0; r < world; ++r) {
            const bool side = unused && r == 0;
            ref = ref + torch::mse_loss(reference->forward(x.slice(0, r * batch, (r + 1) * batch), side),
                                        y.slice(0, r * batch, (r + 1) * batch));
          }
          (ref / (world * accumulation)).backward();
          const torch::Tensor xr = x.slice(0, rank * batch, (rank + 1) * batch), yr = y.slice(0, rank * batch, (rank + 1) * batch);
          engine->train_step([&] { return torch::mse_loss(model->forward(xr, unused && rank == 0), yr); });
        }
        opt.step();
      }
      const int64_t expected = static_cast<int64_t>(steps) * (static_cast<int64_t>(engine->num_families()) + 1);
      STRATA_CHECK(engine->collectives() == expected, "issued ", engine->collectives(), " collectives, expected ",
                   expected, " (one per family and one for the flags per step, none on accumulation micro-steps)");
      const auto dev = engine->tier_stats(strata::memory::Tier::kDevice);
      STRATA_CHECK(dev.peak <= dev.budget, "device peak over budget");
    }  // detached: the module holds the trained weights
    double worst = 0;
    auto pa = reference->parameters();
    auto pb = model->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      worst = std::max(worst, ((pa[i] - pb[i]).norm() / pa[i].norm()).item<double>());
    }
    STRATA_CHECK(worst < 1e-5, "rank ", rank, ": parameters differ from single-process training by ", worst,
                 " (relative L2)");
    std::printf("rank %d: data parallel matches single-process training (worst relative difference %.2e)\n", rank,
                worst);
    std::string cmd = "rm -rf " + nvme;
    if (offload) std::system(cmd.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
