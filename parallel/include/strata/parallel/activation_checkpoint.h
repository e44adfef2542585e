#pragma once
// Activation checkpointing for LibTorch C++ (which has no torch.utils.checkpoint):
// a block's forward keeps none of its activations, and backward runs it again.
//
//   x = strata::parallel::checkpoint([&](const torch::Tensor& h) { return block->forward(h); }, x);
//
// Works with or without an attached engine. Under one, the recomputation's
// operators pass through the operator hook like any other (their parameter
// chunks are made resident, gathered at ZeRO stage 3), and a memory trace
// records them in the phase "recompute" (Note [Recomputing in backward]).

#include <torch/types.h>

#include <functional>
#include <vector>

namespace strata::parallel {

using CheckpointFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `fn(inputs)` without recording its graph, keeping only `inputs`;
/// backward runs `fn` again on them, with the random number generators
/// (CPU, and CUDA for CUDA inputs) as they were in forward, so dropout draws
/// the same masks, and back-propagates through the recomputed graph. `fn`
/// must return tensors computed from `inputs` and the module's parameters,
/// and compute the same thing when run again.
std::vector<torch::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<torch::Tensor>& inputs);
torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& input);

/// True on a thread while it recomputes a checkpointed function in backward.
bool recomputing();

}  // namespace strata::parallel
