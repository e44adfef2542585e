#pragma once
// Engine::Impl: the engine's components over one shared context, and the
// order they run in. attach.cpp builds it (attach and detach), engine.cpp
// runs a step through it, checkpoint_save.cpp and checkpoint_load.cpp save and load its state.
// Private to strata_parallel: not installed, not included by users.
//
// The components, each a file of its own (docs/architecture.md):
//   context.h          EngineContext: options, chunk manager, parameters, families, communicator
//   residency.h        chunks on the device for operators: pin, plan, prefetch, capacity
//   grad_sink.h        gradients into their chunks
//   zero/reducer.h     data-parallel gradient reduction (all-reduce, reduce-scatter)
//   zero/gathers.h     ZeRO parameter gathers: per operator (stage 3), after the update (stages 1-2)
//   step_pipeline.h    the optimizer step over families, NVMe-resident state, the loss scaler
//   trace_recorder.h   the memory trace
//   family_stream.h    checkpoint streaming, family by family
//   param_access.h     parameters between steps: writes, replaced data, gradients
//   tied_params.h      parameters whose copies several pipeline stages hold

#include <torch/nn/module.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../zero/gathers.h"
#include "../zero/reducer.h"
#include "../runtime/context.h"
#include "grad_sink.h"
#include "param_access.h"
#include "residency.h"
#include "step_pipeline.h"
#include "strata/parallel/op_hook.h"
#include "tied_params.h"
#include "trace_recorder.h"

namespace strata::parallel {

struct Engine::Impl final : OpObserver {
  // Note [Module state on the compute device]
  // Buffers (BatchNorm statistics, masks, position tables) and frozen
  // parameters are not chunked: they are small, and operators read them
  // beside the parameters, so attach moves them to the compute device (the
  // GPU under CUDA; nothing moves on the emulated device) and casts the
  // floating ones to the compute precision, as module->to(device, dtype)
  // would. Detach gives each back its device and dtype (both kept in
  // `module_state`). Inputs are the caller's: Engine::to_device places them
  // the same way.

  /// attach: packs the module's trainable parameters into chunk families and
  /// installs the hooks (attach.cpp).
  Impl(torch::nn::Module& module, OptimizerConfig optimizer, EngineOptions options,
       std::shared_ptr<Communicator> comm);
  /// Gives the parameters owned fp32 memory again (attach.cpp).
  ~Impl() override;

  /// Engine::save and Engine::load, one step per member function
  /// (checkpoint_save.cpp, checkpoint_load.cpp; the format is checkpoint_format.h).
  struct CheckpointSave;
  struct CheckpointLoad;

  StepResult train_step(const std::function<torch::Tensor()>& loss_fn, const std::function<void()>& before_step);
  torch::Tensor run(const std::function<torch::Tensor()>& fn);
  /// One step whose passes `passes` runs (Engine::train_step_passes);
  /// train_step is one forward and one backward through it.
  StepResult run_step(const std::function<double(double)>& passes, const std::function<void()>& before_step);
  /// Inside the passes: the backward passes from here on end the
  /// accumulation, so the data-parallel reductions start (Engine::final_backward).
  void final_backward();

  // OpObserver: the components in the order an operator needs them.
  void before_op(const OpCall& call) override;
  void after_op(const OpCall& call) override;
  bool observes_all_ops() const override { return tracing() || residency.capacity_enabled(); }
  bool tracing() const { return recorder && recorder->recording(); }

  EngineContext ctx;
  Residency residency{ctx};
  std::unique_ptr<GradientReducer> reducer;       // data parallel
  std::unique_ptr<GradSink> sink;
  std::unique_ptr<ParamAccess> access;
  std::unique_ptr<StepGathers> step_gathers;      // ZeRO stages 1-2
  std::unique_ptr<OperatorGathers> op_gathers;    // ZeRO stage 3
  std::unique_ptr<StepPipeline> pipeline;
  std::unique_ptr<TiedParameters> tied;           // copies on other pipeline stages
  std::unique_ptr<TraceRecorder> recorder;        // null: no trace
  std::unique_ptr<OpHook> hook;
  std::vector<std::pair<std::string, torch::Tensor>> frozen;  // frozen parameters, for export_weights
  // Buffers (BatchNorm statistics) and frozen parameters, each once, by their
  // module names, with the dtype and device they had before attach: the
  // module state a checkpoint keeps beside the chunks
  // (module_state.safetensors), and what detach gives back (Note [Module
  // state on the compute device]).
  struct ModuleState {
    std::string name;
    torch::Tensor tensor;
    torch::ScalarType original;
    torch::Device original_device{torch::kCPU};
    bool frozen_parameter = false;  // a parameter that did not require grad at attach (else a buffer)
  };
  std::vector<ModuleState> module_state;
  int micro_steps = 0;
  // The step run_step is in: whether it ends an accumulation, whether the
  // final backward began, whether its passes are running.
  bool boundary_ = false;
  bool final_started_ = false;
  bool has_before_step_ = false;  // this train_step has a hook before its optimizer step
  bool in_passes_ = false;
  // A load that failed after it began changing chunks left the state mixed:
  // training refuses until a load succeeds (Note [Loading a checkpoint]).
  std::string poisoned;

  // Note [Parameters between steps]: train_step and run hold `access_mu`
  // while they run, on `step_thread`; an operator on a parameter outside
  // them holds it for the operator.
  std::mutex access_mu;
  std::atomic<std::thread::id> step_thread{};  // std::thread::id{} while no step runs
  bool busy() const { return step_thread.load() != std::thread::id{}; }
  /// Holds the engine for a step, run, save or load on this thread, and
  /// takes in parameter data user code replaced since the last one.
  class Busy {
   public:
    explicit Busy(Impl& impl);
    ~Busy();
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    Impl& impl_;
    std::unique_lock<std::mutex> lock_;
  };

 private:
  void detach() noexcept;
  /// Operators on parameters outside train_step and run (Note [Parameters between steps]).
  void before_outside(const OpCall& call);
  void after_outside(const OpCall& call);
  void land_writes(const OpCall& call);
  /// A train_step that threw: nothing stays pinned, gathered or half-reduced.
  void abandon_step() noexcept;
  void begin_final_backward();
};

/// Copies the tensors of a safetensors file into `module`'s parameters,
/// matched by named_parameters() name (EngineOptions::init_weights).
void import_weights(torch::nn::Module& module, const EngineOptions& options);

}  // namespace strata::parallel
