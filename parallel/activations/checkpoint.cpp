// Note [Recomputing in backward]
// checkpoint() is a custom autograd Function. Its forward runs the user's
// function with grad mode off (as every Function's forward does), so nothing
// inside it is saved for backward; only the inputs are, along with the state
// of the CPU generator (and the CUDA generator of the inputs' device). Its
// backward detaches the saved inputs, sets the generators back to the saved
// states, runs the function again with grad mode on, restores the
// generators, and calls torch::autograd::backward on the recomputed outputs
// with the incoming gradients: a reentrant backward on the same thread,
// which LibTorch supports. Parameter gradients arrive through their
// AccumulateGrad nodes as in any backward, so an attached engine's gradient
// sink takes them (Note [Gradients go straight to their chunk]); the
// recomputation's operators run on the backward thread, which carries the
// operator hook's thread-local state, so the engine sees their parameter
// uses; recomputing() tells the trace recorder to file them under
// "recompute". The gradients of the detached inputs are the Function's.
#include "strata/parallel/activation_checkpoint.h"

#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <mutex>
#include <optional>

#include "strata/core/error.h"

namespace strata::parallel {

namespace {

thread_local int t_recompute_depth = 0;

struct Saved : torch::CustomClassHolder {
  CheckpointFn fn;
  at::Tensor cpu_state;
  std::optional<c10::Device> cuda;
  at::Tensor cuda_state;
};

at::Tensor state_of(at::Generator g) {  // a handle: copies share the generator
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

at::Generator generator(const c10::Device& d) {
  return d.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(d);
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // `anchor`: see checkpoint().
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<Saved> saved,
                                                at::TensorList inputs_list, const torch::Tensor& anchor) {
    const torch::autograd::variable_list inputs = inputs_list.vec();
    saved->cpu_state = state_of(generator(torch::kCPU));
    for (const torch::Tensor& t : inputs) {
      if (t.defined() && t.is_cuda()) {
        saved->cuda = t.device();
        saved->cuda_state = state_of(generator(t.device()));
        break;
      }
    }
    ctx->save_for_backward(inputs);
    torch::autograd::variable_list outputs = saved->fn(inputs);
    ctx->saved_data["fn"] = c10::IValue::make_capsule(std::move(saved));
    for (const torch::Tensor& o : outputs) {
      STRATA_CHECK(o.defined(), "checkpoint: the function returned an undefined tensor; return only defined tensors");
    }
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["fn"].toCapsule());
    const torch::autograd::variable_list inputs = ctx->get_saved_variables();
    torch::autograd::variable_list detached;
    for (const torch::Tensor& t : inputs) {
      if (!t.defined()) {
        detached.emplace_back();
        continue;
      }
      torch::Tensor d = t.detach();
      d.requires_grad_(t.requires_grad());
      detached.push_back(d);
    }
    // The generators as they were in forward, for the recomputation only.
    at::Generator cpu = generator(torch::kCPU);
    const at::Tensor cpu_now = state_of(cpu);
    set_state(cpu, saved->cpu_state);
    std::optional<at::Generator> cuda;
    at::Tensor cuda_now;
    if (saved->cuda) {
      cuda = generator(*saved->cuda);
      cuda_now = state_of(*cuda);
      set_state(*cuda, saved->cuda_state);
    }
    torch::autograd::variable_list outputs;
    try {
      torch::AutoGradMode grad_on(true);
      t_recompute_depth += 1;
      outputs = saved->fn(detached);
      t_recompute_depth -= 1;
    } catch (...) {
      t_recompute_depth -= 1;
      set_state(cpu, cpu_now);
      if (cuda) set_state(*cuda, cuda_now);
      throw;
    }
    set_state(cpu, cpu_now);
    if (cuda) set_state(*cuda, cuda_now);
    STRATA_CHECK(outputs.size() == grads.size(), "checkpoint: the function returned ", outputs.size(),
                 " tensors when recomputed but ", grads.size(), " in forward; it must compute the same thing again");
    torch::autograd::variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    // One gradient per argument of forward, non-tensors included: none for `saved`.
    torch::autograd::variable_list result{torch::Tensor()};
    for (const torch::Tensor& d : detached) result.push_back(d.defined() && d.requires_grad() ? d.grad() : torch::Tensor());
    result.emplace_back();  // the anchor's
    return result;
  }
};

}  // namespace

bool recomputing() { return t_recompute_depth > 0; }

std::vector<torch::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<torch::Tensor>& inputs) {
  STRATA_CHECK(fn != nullptr, "checkpoint: no function given");
  if (!torch::GradMode::is_enabled()) return fn(inputs);  // nothing would be saved anyway (evaluation)
  auto saved = c10::make_intrusive<Saved>();
  saved->fn = fn;
  // The block's parameters are not the Function's inputs, so when no input
  // requires grad (the first block's input is data) its outputs would not
  // either, and backward would never reach the block. An empty leaf that
  // requires grad anchors the Function in the graph; its gradient is none.
  const torch::Tensor anchor = torch::empty({0}).requires_grad_();
  // A TensorList (not a std::vector) makes each input a graph input of the Function.
  return CheckpointFunction::apply(std::move(saved), at::TensorList(inputs), anchor);
}

torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& input) {
  STRATA_CHECK(fn != nullptr, "checkpoint: no function given");
  // `fn` by value: backward calls it again after this returns.
  return checkpoint([fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; },
                    std::vector<torch::Tensor>{input})[0];
}

}  // namespace strata::parallel
