#pragma once
// Engine: strata attached to an unmodified torch::nn::Module (world size 1).
//
// attach() moves every trainable parameter into chunk families (parameter in
// the compute precision, fp32 master weights when that is bf16 or fp16,
// gradient, AdamW exp_avg and exp_avg_sq) owned by a ChunkManager. The
// module's torch::Tensor objects stay the same objects: each gets a storage of
// its own whose data pointer strata sets to the parameter's slot in its chunk
// while that chunk is on the compute (device) tier, and to null otherwise
// (Note [Parameter storages follow their chunk]). An OpHook makes the chunks
// of every operator's parameters resident and pins them (COMPUTE) for the
// operator, in forward and backward. A pre-hook on each parameter's gradient
// accumulator adds the gradient into its slot of the gradient chunk and drops
// it, so autograd never keeps a second copy (Note [Gradients go straight to
// their chunk]). step() runs the fused AdamW kernel chunk by chunk on the host
// tier with global grad-norm clipping, streaming optimizer state that lives on
// NVMe through a double-buffered pipeline (Note [The step pipeline]).
//
// Between steps the module stays a LibTorch module (Note [Parameters between
// steps] in parallel/engine/param_access.h): operators on its parameters, on
// any thread, are served from the chunks, in-place writes under NoGradGuard
// land in the master weights, and torch::load(module) is taken in. An
// operator on a parameter from another thread while train_step or run runs
// is an error naming the parameter.
//
// Mixed precision (precision = bf16 or fp16): parameters, gradients, floating
// buffers and frozen parameters are held in the compute precision, as
// module->to(dtype) would; the fp32 master weights live in the master chunk
// and the kernel writes the new compute copy in the same pass. fp16 uses
// dynamic loss scaling. Inputs must be given on device() in compute_dtype()
// (token ids need only the device), as with DeepSpeed's fp16 engine:
// Engine::to_device does both.

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/memory/chunk_manager.h"
#include "strata/memory/traffic_bound.h"
#include "strata/parallel/engine_options.h"
#include "strata/parallel/optimizer.h"

namespace strata::parallel {

struct StepResult {
  double loss = 0.0;        // the unscaled loss of this micro-step
  bool stepped = false;     // false on accumulation micro-steps and skipped steps
  bool overflow = false;    // gradients held inf/nan: the step was skipped
  double grad_norm = 0.0;   // unscaled, before clipping, on accumulation boundaries
  double loss_scale = 1.0;  // the scale used for this micro-step's backward
  /// Chunk families the backward updated (EngineOptions::update_in_backward;
  /// Note [Updates in backward]); the step updated the others.
  int updated_in_backward = 0;
};

class Communicator;

class Engine {
 public:
  Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options);
  /// Data parallel over `comm`'s ranks when it has more than one (Note [Data
  /// parallel gradients]): rank 0's parameters are broadcast at attach, and
  /// gradients are averaged over ranks before every step.
  Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options, std::shared_ptr<Communicator> comm);
  /// Any optimizer, with parameter groups and a learning-rate schedule
  /// (optimizer.h); `comm` may be null (one process).
  Engine(torch::nn::Module& module, OptimizerConfig optimizer, EngineOptions options,
         std::shared_ptr<Communicator> comm = nullptr);
  /// Gives the parameters owned fp32 memory again (the master values). At
  /// ZeRO stage 1-3 this gathers shards: every rank destroys its engine.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Runs `loss_fn` (forward) and backward (of the scaled loss) under the
  /// operator hook, then the optimizer step on accumulation boundaries.
  StepResult train_step(const std::function<torch::Tensor()>& loss_fn);
  /// The same, calling `before_step` on accumulation boundaries between the
  /// gradient reductions and the optimizer step: there grad() and set_grad()
  /// see the gradients the step will apply (logging, custom clipping).
  StepResult train_step(const std::function<torch::Tensor()>& loss_fn, const std::function<void()>& before_step);
  /// A step whose forward and backward passes `passes` runs itself, under
  /// the operator hook: a pipeline schedule's microbatches, a backward from
  /// gradients another process sent (torch::autograd::backward(outputs,
  /// grads)). `passes` gets the loss scale its backward passes multiply the
  /// loss by (1 unless fp16) and returns the loss to report. Gradients of all
  /// its backward passes add up; the optimizer step follows on accumulation
  /// boundaries, as with train_step (which is one forward and one backward
  /// through this).
  StepResult train_step_passes(const std::function<double(double loss_scale)>& passes,
                               const std::function<void()>& before_step = nullptr);
  /// Inside train_step_passes, before its last backward pass: the
  /// data-parallel gradient reductions then overlap that pass. Without the
  /// call they start after `passes` returns.
  void final_backward();
  /// In train_step's before_step callback: the fp32 gradient of trainable
  /// parameter `param` (the tensor itself, or its name) that the optimizer
  /// step will apply, unscaled and averaged over micro-steps and ranks,
  /// before clipping; undefined when no rank used the parameter this step.
  /// At ZeRO stages 2-3 it is collective: every rank asks for the same
  /// parameters in the same order.
  torch::Tensor grad(const torch::Tensor& param);
  torch::Tensor grad(const std::string& name);
  /// In before_step: replaces the gradient the step applies to `param`
  /// (same shape; each rank writes the part it updates).
  void set_grad(const torch::Tensor& param, const torch::Tensor& value);
  /// Runs `fn` (e.g. evaluation) under the operator hook, without gradients.
  torch::Tensor run(const std::function<torch::Tensor()>& fn);
  void zero_grad();

  /// The dtype the module computes in (its parameters' dtype while attached).
  torch::ScalarType compute_dtype() const;
  /// Where operators run: the GPU of the device tier under CUDA, the CPU on
  /// the emulated device. Buffers and frozen parameters live there while
  /// attached (Note [Module state on the compute device]).
  torch::Device device() const;
  /// `tensor` placed for the module: on device(), floating tensors in
  /// compute_dtype(), others (token ids, masks) in their own dtype. The
  /// documented way to place inputs and targets: the same code then runs on a
  /// GPU and on the emulated device. Returns `tensor` itself when it is
  /// already there.
  torch::Tensor to_device(const torch::Tensor& tensor) const;
  double loss_scale() const;
  int64_t skipped_steps() const;
  /// train_step calls since attach (restored by load()).
  int64_t micro_steps() const;
  /// Seconds operators (forward and backward) and the optimizer step spent
  /// waiting for their chunks: moves on demand and waits for moves in flight.
  struct DataWait {
    double operators = 0.0;
    double optimizer = 0.0;
  };
  DataWait data_wait() const;
  /// The lowest chunk budget the device-capacity rule set (budgets.device without it).
  uint64_t lowest_device_budget() const;
  /// Collectives issued for data parallelism on the main communicator: the
  /// parameter broadcast at attach, gradient reductions and flags, and at
  /// ZeRO stages 1-2 the parameter all-gathers of the step.
  int64_t collectives() const;
  /// ZeRO stage 3: all-gathers of parameter chunks for operators, and how
  /// many of them were prefetches (issued before the operator that needs them).
  int64_t parameter_gathers() const;
  int64_t parameter_gathers_ahead() const;
  /// The ZeRO stage in effect (0 with one rank; EngineOptions::zero_stage).
  int zero_stage() const;
  /// Times the operator sequence diverged from the "auto" policy's plan and was planned again.
  int64_t replans() const;

  OptimizerKind optimizer() const;
  /// The parameter groups, in the order parameters were matched, "default" last.
  std::vector<std::string> param_groups() const;
  /// The names of the parameters in group `group`.
  std::vector<std::string> group_parameters(const std::string& group) const;
  /// Sets the base learning rate of every group, or of one; the schedule
  /// scales it from the next step on. Any time between steps.
  void set_lr(double lr);
  void set_lr(const std::string& group, double lr);
  /// The learning rate group `group` uses in the next optimizer step (base x schedule).
  double lr(const std::string& group = "default") const;
  double base_lr(const std::string& group = "default") const;
  /// Replaces the schedule; its position (optimizer_steps()) stays.
  void set_schedule(const LrSchedule& schedule);
  const LrSchedule& schedule() const;
  /// Optimizer steps applied (not counting steps skipped for overflow): the schedule's position.
  int64_t optimizer_steps() const;

  /// Saves the full training state to directory `dir`, atomically: master
  /// weights, optimizer state (wherever it lives, NVMe included), gradients
  /// mid-accumulation, step counts, the loss scaler and the RNG state,
  /// streamed chunk family by chunk family (docs/checkpoint.md). Placement
  /// and budgets are not part of it. Data parallel (any ZeRO stage) it is
  /// collective: every rank calls it, sharded state is gathered family by
  /// family, and rank 0 writes (Note [Checkpoints across ranks]). Under
  /// tensor and pipeline parallelism every rank calls it too: the data
  /// group's rank 0 of each tensor rank of each stage writes its parts, with
  /// where they lie in the whole parameters, into the one directory, which
  /// is committed once (Note [Checkpoints across layouts]).
  void save(const std::string& dir);
  /// Loads a checkpoint saved by save(), under any budgets and placement,
  /// and under any layout: another ZeRO stage, data-parallel world, tensor
  /// mode or size, or cut into pipeline stages. Every rank calls it and
  /// reads its own elements. The files it reads are verified against the
  /// manifest, and the parameter names, whole shapes and dtypes against this
  /// engine's, before anything changes.
  void load(const std::string& dir);
  /// Writes the fp32 weights of every parameter (trainable or frozen) as a
  /// safetensors file named as module.named_parameters() names them.
  /// Collective when data parallel: every rank calls it, rank 0 writes.
  /// Under tensor parallelism each tensor rank writes its parts to
  /// <stem>.tensor-<r>-of-<P><ext> beside `path`.
  void export_weights(const std::string& path);
  /// One process's weights, from any layout (tensor, pipeline and data
  /// parallel alike), in Hugging Face's layout at directory `dir`: shards of
  /// at most `shard_bytes` and model.safetensors.index.json, the parameters
  /// in `dtype`, buffers and frozen parameters as they are. Collective:
  /// every rank calls it; each writer saves its parts, and one rank
  /// assembles them, streamed, and puts `dir` in place atomically
  /// (docs/checkpoint.md). EngineOptions::init_weights reads it back.
  void export_hf(const std::string& dir, uint64_t shard_bytes = 5000000000ull, DType dtype = DType::kFloat32);

  /// Throws a strata::Error saying what to change unless save(dir) may write
  /// there: `dir` absent, or a checkpoint an earlier save() wrote (a user's
  /// file or directory is never replaced). Call it before training to fail
  /// early; save() checks again.
  static void check_save_target(const std::string& dir);
  /// The same for export_weights(path): a file that can be written.
  static void check_export_target(const std::string& path);

  memory::ChunkManager& chunks();
  memory::TierStats tier_stats(memory::Tier tier) const;
  memory::MoveStats move_stats() const;
  int64_t managed_parameters() const;
  /// Bytes of parameters, gradients, master weights and optimizer state.
  int64_t model_state_bytes() const;
  /// This rank's optimizer step in the terms of Note [The least traffic of a
  /// step] (strata/memory/traffic_bound.h): the fp32 parameters (or masters)
  /// and optimizer state of the elements it updates, their gradients, and the
  /// device and host tier budgets. memory::least_step_traffic() of it is the
  /// NVMe traffic no schedule of the step can go below.
  memory::StepState step_state() const;
  /// Families whose optimizer state lives on NVMe between steps, of num_families().
  size_t nvme_optim_families() const;
  size_t num_families() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// attach(module, optimizer, options): the entry point a LibTorch user calls.
std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options);
/// The same, data parallel over `comm` (communicator.h).
std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options,
                               std::shared_ptr<Communicator> comm);
/// Any optimizer, groups and schedule (optimizer.h); `comm` may be null.
std::unique_ptr<Engine> attach(torch::nn::Module& module, OptimizerConfig optimizer, EngineOptions options,
                               std::shared_ptr<Communicator> comm = nullptr);

/// Which parameters the standard "no weight decay" split takes (no_decay_group).
struct NoDecayOptions {
  bool biases = true;      // parameters named *bias
  bool norms = true;       // weights of LayerNorm, GroupNorm, BatchNorm*, InstanceNorm*, LocalResponseNorm
  bool embeddings = true;  // weights of Embedding and EmbeddingBag
  bool one_dimensional = true;  // any other 1-D parameter (scales and gains of custom norms)
  std::vector<std::string> extra_patterns;  // more names (glob_match)
};
/// The group "no_decay" with weight_decay 0 for the parameters of `module`
/// that `which` names, found by module type and name; put it first in
/// OptimizerConfig::groups, and every other parameter decays in "default".
ParamGroup no_decay_group(torch::nn::Module& module, const NoDecayOptions& which = {});

}  // namespace strata::parallel
