// Trains a small MLP and saves a checkpoint after every step; the checkpoint
// crash test runs it with STRATA_CHECKPOINT_KILL_AT set (the process kills
// itself with SIGKILL at that point of a save) or kills it from outside.
//   checkpoint_crash_helper DIR STEPS [NVME_DIR]
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "strata/parallel/engine.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s DIR STEPS [NVME_DIR]\n", argv[0]);
    return 2;
  }
  try {
    torch::manual_seed(7);
    auto model = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 8));
    strata::parallel::EngineOptions o;
    o.budgets = {16 << 10, 1 << 20, argc > 3 ? 4u << 20 : 0};
    if (argc > 3) {
      o.nvme_dir = argv[3];
      o.nvme_optim_fraction = 1.0;
    }
    o.chunk_elems = 1024;
    auto engine = strata::parallel::attach(*model, strata::parallel::AdamWConfig{}, o);
    const int steps = std::atoi(argv[2]);
    for (int s = 1; s <= steps; ++s) {
      const torch::Tensor x = torch::randn({16, 32}), y = torch::randn({16, 8});
      engine->train_step([&] { return torch::mse_loss(model->forward(x), y); });
      engine->save(argv[1]);
      std::printf("saved step %d\n", s);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_crash_helper: %s\n", e.what());
    return 1;
  }
  return 0;
}
