#pragma once
// Residual blocks wide enough that their activations dominate, with dropout:
// the model of the activation checkpointing and offload tests, each block
// kept, checkpointed or offloaded.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "strata/parallel/activation_checkpoint.h"
#include "strata/parallel/activation_offload.h"

namespace strata::parallel {

enum class BlockMode { kKeep, kCheckpoint, kOffload, kMixed };  // kMixed: even blocks offloaded, odd checkpointed

struct DeepBlocks : torch::nn::Module {
  std::vector<torch::nn::Sequential> blocks;
  torch::nn::Linear head{nullptr};
  BlockMode mode = BlockMode::kKeep;
  explicit DeepBlocks(uint64_t seed, int n = 6, int width = 256) {
    torch::manual_seed(seed);
    for (int i = 0; i < n; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i),
                                       torch::nn::Sequential(torch::nn::Linear(width, width), torch::nn::GELU(),
                                                             torch::nn::Dropout(0.1), torch::nn::Linear(width, width),
                                                             torch::nn::Tanh())));
    }
    head = register_module("head", torch::nn::Linear(width, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      const auto run = [m = blocks[i].ptr()](const torch::Tensor& h) { return m->forward(h); };
      const bool offload = mode == BlockMode::kOffload || (mode == BlockMode::kMixed && i % 2 == 0);
      if (offload) {
        x = x + offload_activations(run, x);
      } else if (mode != BlockMode::kKeep) {
        x = x + checkpoint(run, x);
      } else {
        x = x + run(x);
      }
    }
    return head->forward(x);
  }
};

}  // namespace strata::parallel
