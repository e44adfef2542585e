#include "grad_sink.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>

#include "../zero/reducer.h"
#include "strata/core/error.h"

namespace strata::parallel {

namespace {

class GradToChunk final : public torch::autograd::FunctionPreHook {
 public:
  explicit GradToChunk(std::function<void(const torch::Tensor&)> sink) : sink_(std::move(sink)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!grads.empty() && grads[0].defined()) sink_(grads[0]);
    return {torch::Tensor()};
  }

 private:
  std::function<void(const torch::Tensor&)> sink_;
};

}  // namespace

namespace {
void remove_hook(ManagedParam& p) noexcept {
  if (!p.accumulator) return;
  auto& hooks = p.accumulator->pre_hooks();
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                             [](const auto& h) { return dynamic_cast<GradToChunk*>(h.get()) != nullptr; }),
              hooks.end());
  p.accumulator.reset();
}
}  // namespace

void GradSink::install() {
  for (size_t i = 0; i < ctx_.params.size(); ++i) {
    ctx_.params[i].accumulator.reset();
    reinstall(i);
  }
}

void GradSink::reinstall(size_t i) {
  ManagedParam& p = ctx_.params[i];
  std::shared_ptr<torch::autograd::Node> now = torch::autograd::impl::grad_accumulator(p.tensor);
  STRATA_CHECK(now != nullptr, "parameter ", p.name, " has no gradient accumulator");
  if (now == p.accumulator) return;
  remove_hook(p);
  p.accumulator = std::move(now);
  p.accumulator->add_pre_hook(
      std::make_unique<GradToChunk>([this, i](const torch::Tensor& grad) { accumulate(i, grad); }));
}

void GradSink::uninstall() noexcept {
  for (ManagedParam& p : ctx_.params) remove_hook(p);
}

void GradSink::accumulate(size_t index, const torch::Tensor& grad) {
  bool tracked = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    add(index, grad);
    tracked = tracking_;
  }
  if (tracked && settled_) settled_(index);
}

// accumulate() under the sink's lock.
void GradSink::add(size_t index, const torch::Tensor& grad) {
  ManagedParam& p = ctx_.params[index];
  if (reducer_ != nullptr && reducer_->active()) reducer_->check_open(index);
  const ChunkId gc = ctx_.mgr->family(p.family).grad;
  const Tier tier = ctx_.comm_tier();  // Note [Chunks where the communicator reads them]
  ctx_.pin(gc, tier, {p.slot});
  try {
    torch::NoGradGuard no_grad;
    const torch::Device where = tier == Tier::kDevice ? ctx_.device : torch::Device(torch::kCPU);
    torch::Tensor dst = torch::from_blob(static_cast<char*>(ctx_.mgr->data(gc)) + p.offset * ctx_.elem_size(),
                                         {p.numel}, torch::TensorOptions().dtype(ctx_.compute).device(where));
    const torch::Tensor g = grad.detach().to(where, ctx_.compute);
    if (g.is_sparse()) {  // an Embedding(sparse=true): its rows added where they go, nothing densified
      dst.view(g.sizes()).add_(g);
    } else {
      dst.add_(g.reshape({p.numel}));
    }
  } catch (...) {
    ctx_.unpin(gc, {p.slot});
    throw;
  }
  p.has_grad = true;  // before the hook: the statistics it may take count this gradient
  if (tracking_ && hook_) {
    bool complete = false;
    if (!arrived_[index]) {
      arrived_[index] = true;
      complete = --missing_[ctx_.family_pos.at(p.family)] == 0;
    }
    try {
      hook_(p.family, complete);
    } catch (...) {
      ctx_.unpin(gc, {p.slot});
      throw;
    }
  }
  ctx_.unpin(gc, {p.slot});
  if (reducer_ != nullptr && reducer_->active()) reducer_->arrived(index);
}

void GradSink::track(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  tracking_ = on;
  if (!on) return;
  arrived_.assign(ctx_.params.size(), false);
  missing_.assign(ctx_.families.size(), 0);
  for (const ManagedParam& p : ctx_.params) {
    if (p.accumulator != nullptr) missing_[ctx_.family_pos.at(p.family)] += 1;
  }
}

void GradSink::zero() {
  for (memory::FamilyId f : ctx_.families) {
    const memory::ChunkFamily& fam = ctx_.mgr->family(f);
    ctx_.mgr->release(fam.grad);
    if (fam.grad_shard) ctx_.mgr->release(*fam.grad_shard);
  }
  for (ManagedParam& p : ctx_.params) p.has_grad = false;
  std::lock_guard<std::mutex> lock(mu_);
  tracking_ = false;
}

}  // namespace strata::parallel
