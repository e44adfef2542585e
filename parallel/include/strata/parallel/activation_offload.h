#pragma once
// Activation offload: a block's saved activations wait in host memory, not on
// the device, between its forward and its backward.
//
//   x = strata::parallel::offload_activations([&](const torch::Tensor& h) { return block->forward(h); }, x);
//
// The block runs as it would (nothing is recomputed, so training is exactly
// the same); when its forward returns, the tensors it made that its autograd
// graph keeps for backward (its saved activations) are copied to host memory
// and their device memory released. Backward brings them back before the
// block's backward runs, and starts bringing back the previous offloaded
// block's meanwhile (in forward order: the next to run backward), so the
// copy overlaps the computation. Works with or without an attached engine,
// and with activation checkpointing: checkpointed blocks keep nothing but
// their inputs, offloaded ones keep everything, off the device.
//
// Tensors made inside the block other than its outputs must not be used
// outside it: their memory is on the host until the block's backward.

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace strata::parallel {

using OffloadFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `fn(inputs)` and moves the activations its graph saved to host
/// memory until its backward (Note [Offloading a block's activations]).
/// Without grad mode (evaluation), or while a checkpointed block is
/// recomputed, it just calls `fn`.
std::vector<torch::Tensor> offload_activations(const OffloadFn& fn, const std::vector<torch::Tensor>& inputs);
torch::Tensor offload_activations(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                  const torch::Tensor& input);

/// Process-wide counts since the start.
struct ActivationOffloadStats {
  uint64_t offloaded_bytes = 0;  // copied to host after forwards
  uint64_t restored_bytes = 0;   // copied back before backwards
  uint64_t prefetched_bytes = 0;  // of those, brought back ahead of their backward
  uint64_t blocks = 0;           // offloaded forwards
};
ActivationOffloadStats activation_offload_stats();

}  // namespace strata::parallel
