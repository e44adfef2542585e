#pragma once
// Small LibTorch models shared by the engine's tests and the multi-rank
// checks (no GoogleTest here: dp_check is a plain program).
#include <torch/torch.h>

namespace strata::parallel {

// Elementwise arithmetic, an embedding and reductions: the operators Debian's
// LibTorch 1.13 has fp16 CPU kernels for (no addmm, no softmax), so fp16 runs
// here on the emulated device as well as on a GPU.
struct Scaler : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::Tensor gain, bias;
  Scaler() {
    emb = register_module("emb", torch::nn::Embedding(64, 32));
    gain = register_parameter("gain", torch::ones({32}));
    bias = register_parameter("bias", torch::zeros({32}));
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return emb->forward(tokens) * gain + bias; }
};

}  // namespace strata::parallel
