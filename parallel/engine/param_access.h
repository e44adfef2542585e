#pragma once
// ParamAccess: the module's parameters as user code sees them outside
// train_step (Note [Parameters between steps]): in-place writes that land in
// the master weights, tensors whose data user code replaced (torch::load,
// set_data), and the gradients between backward and the optimizer step.

#include <string>
#include <unordered_map>

#include "../runtime/context.h"

namespace strata::parallel {

class GradSink;

// Note [Parameters between steps]
// A managed parameter keeps the OpHook's dispatch key on its TensorImpl, so
// every operator on it or on a view of it passes through the hook, from any
// thread, in a step or not (Note [Intercepting operators at the dispatcher]).
// Outside train_step and run, such an operator is served like one inside:
// its chunks are made resident on the device (gathered at ZeRO stage 3) and
// pinned while it runs, then released. The engine serves one such operator at
// a time and none while a step runs: an operator on a parameter from another
// thread during train_step or run is an error naming the parameter, never a
// read of memory that is moving.
//
// Writes. The hook knows from the operator's schema which arguments it
// writes (clamp_, copy_, mul_, torch::nn::init::*, out= variants). After
// one, the parameter's new values land where the optimizer reads them: in
// fp32 the parameter chunk is the master, so nothing more is needed; in
// bf16/fp16 every element of the fp32 master whose compute-precision copy the
// write changed takes the written value, and the others keep their fp32
// precision; at ZeRO stage 3 this rank's shard takes its part. Data parallel,
// each rank lands its own part of the master, so every rank must make the
// same write (as with any replicated module).
//
// Replaced data. torch::load (Tensor::set_) and Tensor::set_data give the
// parameter tensor another storage. The engine notices (after the operator,
// or at the next step, save or export), takes the new values into the chunks
// (fp32 values go to the master exactly), and gives the tensor its own
// storage back, so the module stays attached.
//
// Storages. A parameter's storage points at its slot while its chunk is on
// the device tier and, on the emulated device, also on the host tier (both
// are host memory there), so code that reads memory without an operator
// (torch::save's pickler) finds the values. A chunk on NVMe, or a ZeRO-3
// parameter between steps, has no memory to point at: raw data_ptr() there is
// null, and torch::save fails (LibTorch says "invalid parameter").
class ParamAccess {
 public:
  /// After the parameters are collected (ctx.params fixed for the engine's life).
  ParamAccess(EngineContext& ctx, GradSink& sink);

  /// The managed parameter `t` is (the same tensor object), or an error naming what to pass.
  size_t find(const torch::Tensor& t) const;
  size_t find(const std::string& name) const;

  /// After an operator wrote parameter `i` (its chunk pinned on the device):
  /// the values land in the master and this rank's parameter shard.
  void land_written(size_t i);
  /// Whether user code gave parameter `i` other data (storage, dtype or device).
  bool replaced(size_t i) const;
  /// Takes parameter `i`'s new data into its chunks and gives it its own
  /// storage back. `pinned`: its chunk is pinned on the device (after an operator).
  void absorb(size_t i, bool pinned);
  /// absorb() for every replaced parameter.
  void absorb_replaced();

  /// Gradients readable: between the reductions and the optimizer step, with
  /// `factor` turning the gradient chunk's values into the gradient the step
  /// applies (loss scale, accumulation and ranks divided out).
  void open_grads(double factor) { grad_factor_ = factor; grads_open_ = true; }
  void close_grads() { grads_open_ = false; }
  /// open_grads(factor) for its scope.
  class OpenGrads {
   public:
    OpenGrads(ParamAccess& access, double factor) : access_(access) { access_.open_grads(factor); }
    ~OpenGrads() { access_.close_grads(); }
    OpenGrads(const OpenGrads&) = delete;
    OpenGrads& operator=(const OpenGrads&) = delete;

   private:
    ParamAccess& access_;
  };
  /// Parameter `i`'s gradient in fp32 (undefined when no rank used it this step).
  torch::Tensor grad(size_t i);
  void set_grad(size_t i, const torch::Tensor& g);

 private:
  /// Writes `values` (any floating dtype, the parameter's shape) into
  /// parameter `i`'s slot (unless `in_chunk`: it holds them already), its
  /// shard and its master.
  void store(size_t i, const torch::Tensor& values, bool in_chunk, bool pinned);
  void check_grads(size_t i, const char* what) const;

  EngineContext& ctx_;
  GradSink& sink_;
  std::unordered_map<const c10::TensorImpl*, size_t> by_tensor_;
  std::unordered_map<std::string, size_t> by_name_;
  bool grads_open_ = false;
  double grad_factor_ = 1.0;
};

}  // namespace strata::parallel
