#pragma once
// Pipeline parallelism: a model cut into stages along the ranks of a
// pipeline group (DeviceMesh::group(kPipeline), or any Communicator), each
// rank training its stages' parameters in its own chunks. docs/pipeline.md.
//
//   torch::nn::Sequential model = build();            // the same on every rank
//   pipeline::Pipeline pipe(model, pp_group, {.schedule = pipeline::Schedule::k1F1B, .microbatches = 8});
//   pipe.attach(optimizer, options, dp_group);        // this rank's stages, its budgets
//   for (...) pipe.step(tokens, targets, loss_fn);    // every rank, every step
//
// A stage is a torch::nn::Sequential. Between stages a value is one tensor
// or several: a layer may return a std::vector<torch::Tensor> or a std::tuple
// of two or three tensors (hidden state with positions or a mask), which the
// next layer takes as its argument, on this rank or the next stage's
// (Note [Tuples between stages] in pipeline.cpp); floating parts carry
// gradients back, others (ids, positions, boolean masks) none. The model's
// input and its last stage's output are one tensor each. The
// first stage gets the microbatches of `inputs` (split along dimension 0),
// the last applies `loss_fn(output, targets)` (its loss a mean over the
// microbatch), weighted by the microbatch's share of the batch, so the step's
// loss and gradients are those of one process on the whole batch.
// A parameter that layers of several stages register (an output projection
// tied to the token embedding, registered in the head too) is tied: each of
// those stages trains a copy, their gradients summed after backward, so the
// copies stay equal (Note [Tied parameters across stages] in the engine). A
// layer that uses another stage's parameter without registering it is
// refused at its first step.
//
// Note [Pipeline links]
// Activations travel forward and gradients backward between neighbouring
// stages, each direction of each link on a two-rank communicator of its own
// (split from the pipeline group), so a send never waits behind a receive:
// sends are queued and the compute thread goes on; a receive is posted one
// item ahead of its use. Both ends of a link run its items in the same order
// (Note [Pipeline actions], checked by simulation before the first step), and
// each item's tag names its stage and microbatch, so a mismatch is a timeout
// error, never data from the wrong microbatch. An activation's shape and
// dtype go ahead of it once, and are cached: each step the ranks agree on
// the batch's shape (one small all-gather over the pipeline group, which also
// keeps the stages in step), and while it stays the same only the payloads
// travel; a sender whose output shape changes anyway is an error.

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/parallel/engine.h"
#include "strata/parallel/pipeline_schedule.h"

namespace strata::parallel {
class Communicator;
}

namespace strata::parallel::pipeline {

struct PipelineOptions {
  Schedule schedule = Schedule::k1F1B;
  int microbatches = 1;
  /// Model chunks per rank (interleaved-1f1b only).
  int virtual_stages = 1;
};

/// One cost per layer of `model`: its parameter count (balanced partitioning's default).
std::vector<double> parameter_costs(torch::nn::Sequential& model);

class Pipeline {
 public:
  /// Cuts `model` (built the same on every rank of `group`) into p * v stages
  /// at `boundaries` (p*v+1 layer indices from 0 to model->size(); empty:
  /// partition_balanced over parameter_costs) and keeps this rank's.
  Pipeline(torch::nn::Sequential model, std::shared_ptr<Communicator> group, PipelineOptions options,
           std::vector<int> boundaries = {});
  /// A manual split: this rank's stage modules, one per virtual stage, in order.
  Pipeline(std::vector<torch::nn::Sequential> stages, std::shared_ptr<Communicator> group, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// This rank's stages as one module ("stage<s>" submodules): what attach() attaches.
  torch::nn::Module& module();
  /// attach(module(), ...): this rank's parameters into its chunks, data
  /// parallel over `data_parallel` (the mesh's data axis) when given. The
  /// step's overflow and gradient norm are agreed over the pipeline group.
  Engine& attach(OptimizerConfig optimizer, EngineOptions options, std::shared_ptr<Communicator> data_parallel = nullptr);
  Engine& engine();

  using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
  /// One training step over the whole batch, on every rank of the group:
  /// `inputs` matter on the first stage, `targets` on the last (either may
  /// be undefined elsewhere). StepResult::loss is the batch's loss on every
  /// rank. Inputs that require grad make the first stage compute its input
  /// gradient, as every other stage does, but it is not kept.
  StepResult step(const torch::Tensor& inputs, const torch::Tensor& targets, const LossFn& loss);
  /// Forward only, every microbatch through the stages (evaluation, no
  /// gradients): the last stage's output, concatenated, on the last stage;
  /// undefined elsewhere. A batch of fewer samples than microbatches runs
  /// one microbatch per sample (a step refuses it).
  torch::Tensor forward(const torch::Tensor& inputs);

  /// Engine::save and Engine::load of every stage's engine (collective over
  /// the pipeline and its data-parallel groups): one checkpoint, its
  /// parameters under the model's own names, which loads under another cut
  /// into stages or none (Note [Checkpoints across layouts]).
  void save(const std::string& dir);
  void load(const std::string& dir);

  int rank() const;                 // this rank's place in the pipeline group
  int num_ranks() const;            // p
  int num_stages() const;           // p * v
  std::vector<int> stages() const;  // the virtual stages this rank runs
  /// Layer boundaries of the partitioned form (empty for a manual split).
  const std::vector<int>& boundaries() const;
  /// Bytes sent by this rank over the links in the last step (payloads and headers).
  int64_t bytes_sent() const;
  /// The actions this rank runs in a step (Note [Pipeline actions]).
  const std::vector<Action>& actions() const;
  /// Seconds this rank spent in each kind of action in the last step, and the step's wall time.
  struct Timing {
    double compute = 0.0;
    double step = 0.0;
  };
  Timing last_timing() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::parallel::pipeline
