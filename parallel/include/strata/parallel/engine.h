#pragma once
// Engine: strata attached to an unmodified torch::nn::Module (world size 1).
//
// attach() moves every trainable parameter into chunk families (parameter,
// gradient, AdamW exp_avg and exp_avg_sq) owned by a ChunkManager. The
// module's torch::Tensor objects stay the same objects: each gets a storage of
// its own whose data pointer strata sets to the parameter's slot in its chunk
// while that chunk is on the compute (device) tier, and to null otherwise
// (Note [Parameter storages follow their chunk]). An OpHook makes the chunks
// of every operator's parameters resident and pins them (COMPUTE) for the
// operator, in forward and backward. Gradient hooks add each gradient into
// its slot of the gradient chunk. step() runs the fused AdamW kernel chunk by
// chunk on the host tier, with global grad-norm clipping.
//
// This is the first slice of the engine issue: fp32 only (no bf16/fp16 master
// weights or loss scaling yet), no double-buffered NVMe optimizer pipeline,
// frozen parameters and buffers stay where they are.

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/kernels/optim.h"
#include "strata/memory/chunk_manager.h"

namespace strata::parallel {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
};

struct EngineOptions {
  memory::TierBudgets budgets;
  std::string nvme_dir;        // needed when budgets.nvme > 0
  int64_t chunk_elems = 0;     // 0: least padding, at most a quarter of the device budget (ChunkManager)
  double clip_norm = 0.0;      // 0: no clipping
  int grad_accumulation = 1;   // micro-steps per optimizer step; gradients are averaged
};

struct StepResult {
  double loss = 0.0;
  bool stepped = false;    // false on accumulation micro-steps
  double grad_norm = 0.0;  // before clipping, when stepped
};

class Engine {
 public:
  Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options);
  /// Gives the parameters owned memory again (their current values).
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Runs `loss_fn` (forward) and backward under the operator hook, then the
  /// optimizer step on accumulation boundaries.
  StepResult train_step(const std::function<torch::Tensor()>& loss_fn);
  /// Runs `fn` (e.g. evaluation) under the operator hook, without gradients.
  torch::Tensor run(const std::function<torch::Tensor()>& fn);
  void zero_grad();

  memory::ChunkManager& chunks();
  int64_t managed_parameters() const;
  int64_t model_state_bytes() const;  // parameters, gradients and optimizer state

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// attach(module, optimizer, options): the entry point a LibTorch user calls.
std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options);

}  // namespace strata::parallel
