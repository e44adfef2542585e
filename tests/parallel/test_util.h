#pragma once
// Helpers shared by the engine's tests: small models, parameter copies and
// comparisons, temporary paths.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>

#include "strata/parallel/engine_options.h"

namespace strata::parallel {

// LibTorch's AdamW with the engine's hyper-parameters: the reference strata
// training is compared with.
inline torch::optim::AdamW reference_adamw(torch::nn::Module& m, const AdamWConfig& cfg) {
  return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(cfg.lr)
                                                 .betas({cfg.beta1, cfg.beta2})
                                                 .eps(cfg.eps)
                                                 .weight_decay(cfg.weight_decay));
}

inline torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::ReLU(), torch::nn::Linear(64, 8));
}

inline void copy_params(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  ASSERT_EQ(src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

inline double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-12); }

// Every parameter of `b` within `tol` (relative L2) of `a`'s.
inline void expect_params_close(torch::nn::Module& a, torch::nn::Module& b, double tol = 1e-5) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LT(((pa[i] - pb[i]).norm() / pa[i].norm()).item<double>(), tol) << "parameter " << i;
  }
}

// A per-process path in the temporary directory.
inline std::string temp_path(const std::string& name, const std::string& extension = "") {
  return (std::filesystem::temp_directory_path() / ("strata-" + name + "-" + std::to_string(::getpid()) + extension))
      .string();
}

// Four Linear layers: enough chunks that a fifth of the model state evicts.
inline torch::nn::Sequential deep_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::ReLU(), torch::nn::Linear(64, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 8));
}

// Nine Linear layers of width 64: enough families that a fraction of the
// state on host spills parameters, gradients and optimizer state to NVMe.
inline torch::nn::Sequential nine_layer_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential model(torch::nn::Linear(32, 64));
  for (int l = 0; l < 8; ++l) {
    model->push_back(torch::nn::ReLU());
    model->push_back(torch::nn::Linear(64, 64));
  }
  return model;
}

}  // namespace strata::parallel
