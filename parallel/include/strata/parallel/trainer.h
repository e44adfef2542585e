#pragma once
// Trainer: one entry for every layout. It takes the user's model, a
// HybridPlan (plan.h), the mesh the plan was laid out on, the optimizer and
// the engine options, and applies the plan in the one order that works:
// tensor parallelism splits the weights (parallelize()), the pipeline cuts
// the model into stages and keeps this rank's, and attach() moves what is
// left into this rank's chunks under its budgets, data parallel (ZeRO) over
// the mesh's replica group. docs/parallel.md.
//
//   const Rendezvous r = Rendezvous::from_env();
//   HybridPlan plan = HybridPlan::from_env(base).validated(r.world_size, shape);  // no collective yet
//   DeviceMesh mesh = DeviceMesh::create(make_world(r), plan.dims());
//   torch::nn::Sequential model = build(sequence_attention(mesh, plan));  // the same on every rank
//   Trainer trainer(model, mesh, plan, optimizer, options);
//   for (...) trainer.step(tokens, targets, loss_fn);                      // every rank, every step
//
// Batches: every rank of a replica (the ranks that differ in pp, tp and sp)
// passes the same whole batch; ranks of different replicas (dp) pass their
// own. Under sequence parallelism the trainer keeps this rank's positions of
// inputs and targets along plan.sp.dim, in the layout of the model's
// attention. StepResult::loss is the replica's loss on every rank of it:
// one process's loss on that batch.

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/memory/chunk_manager.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/plan.h"

namespace strata::parallel {

namespace pipeline {
class Pipeline;
}

/// The sequence::Attention the plan's model uses: over the mesh's sequence
/// group (a group of one when sp is 1, where it is plain attention), in the
/// plan's mode. Every attention of the model must be one of these when sp > 1.
sequence::Attention sequence_attention(const DeviceMesh& mesh, const HybridPlan& plan, bool causal = true);

/// What a rank holds and sends, for the memory and traffic report.
struct RankReport {
  int rank = 0;
  std::array<int, 4> coords{};       // dp, pp, tp, sp
  int64_t parameters = 0;            // this rank's parameter elements (after splits and the cut)
  int64_t model_state_bytes = 0;     // parameters, gradients, masters, optimizer state, unsharded
  uint64_t held_bytes = 0;           // what its tiers hold now (its ZeRO shards, chunk padding included)
  memory::TierStats tiers[memory::kNumTiers];
  int64_t pipeline_bytes_sent = 0;   // last step, to the pipeline neighbours
  int64_t data_collectives = 0;      // on the replica group, since attach
  int64_t parameter_gathers = 0;     // ZeRO 3
  std::string describe() const;
};

class Trainer {
 public:
  using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
  /// Applies `plan` (validated again against the mesh; its dims must be the
  /// mesh's) to `model`. Refuses, before any collective: sequence
  /// parallelism without the plan's sequence_attention in the model, and
  /// tensor parallelism without a module plan (a module plan at tp 1 is kept
  /// and not used, so one plan serves every size). Every tensor mode splits the
  /// unmodified model by the plan's module plan (parallelize()); in the grid
  /// modes (2d, 2.5d, 3d) so do its LayerNorms, and every Linear must be named.
  /// Layers may pass a tuple of tensors between them (pipeline.h).
  /// `model` is the whole model, the same on every rank; a module that is no
  /// Sequential goes in as torch::nn::Sequential(module) (no pipeline then).
  /// The optimizer's groups select parameters by the model's names, under a
  /// pipeline too (its stages name them "stage<s>.<name>"). The plan's
  /// zero_stage is the one used; options asking for another are refused.
  Trainer(torch::nn::Sequential model, const DeviceMesh& mesh, const HybridPlan& plan, OptimizerConfig optimizer,
          EngineOptions options, const ModelShape& shape = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// One optimizer step (or accumulation micro-step) on this rank's batch.
  StepResult step(const torch::Tensor& inputs, const torch::Tensor& targets, const LossFn& loss);
  /// Forward only, no gradients: the model's output for `inputs` (this rank's
  /// positions under sequence parallelism); under a pipeline, on its last
  /// stage only (undefined elsewhere).
  torch::Tensor evaluate(const torch::Tensor& inputs);
  /// This rank's positions of a whole batch tensor along plan.sp.dim (the tensor itself without sp).
  torch::Tensor shard(const torch::Tensor& x) const;

  /// Collective checkpoints (Engine::save): one directory, which any other
  /// plan the model validates under loads (Note [Checkpoints across layouts]).
  void save(const std::string& dir);
  void load(const std::string& dir);

  RankReport report() const;
  const HybridPlan& plan() const { return plan_; }
  const DeviceMesh& mesh() const { return mesh_; }
  /// What this rank trains: its stages under a pipeline, else the model.
  torch::nn::Module& module();
  Engine& engine();
  /// The pipeline, or null without one.
  pipeline::Pipeline* pipeline() { return pipeline_.get(); }

 private:
  DeviceMesh mesh_;
  HybridPlan plan_;
  torch::nn::Sequential model_;
  sequence::Attention attention_{nullptr};  // one of the model's, for its layout (sp > 1)
  std::unique_ptr<pipeline::Pipeline> pipeline_;
  std::unique_ptr<Engine> engine_;  // without a pipeline
};

}  // namespace strata::parallel
