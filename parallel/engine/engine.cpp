// The engine's orchestration: one training step through the components, in
// the order it runs (docs/architecture.md, "One step through the engine").

#include "strata/parallel/engine.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "engine_impl.h"

namespace strata::parallel {

// --- one operator (forward, backward or Engine::run) -------------------------

void Engine::Impl::before_op(const c10::OperatorHandle& op, const std::vector<int64_t>& ids) {
  if (tracing()) recorder->begin_op(op.schema().name(), ids);
  if (ids.empty()) {
    residency.relieve_capacity();
    return;
  }
  uint64_t needed = 0;
  const std::vector<ChunkId> chunks = residency.chunks_of(ids, needed);  // the operator's working set
  if (op_gathers) op_gathers->before_operator(chunks, residency.in_step());  // ZeRO-3: full chunks from shards
  residency.prepare(op.schema().name(), ctx.params[static_cast<size_t>(ids.front())].name, chunks, needed);
  residency.pin_operator(ids);
  residency.prefetch_next();
}

void Engine::Impl::after_op(const c10::OperatorHandle&, const std::vector<int64_t>& ids) {
  residency.unpin_operator(ids);
  if (tracing()) recorder->end_op();
}

// --- one step ----------------------------------------------------------------

StepResult Engine::Impl::train_step(const std::function<torch::Tensor()>& loss_fn) {
  STRATA_CHECK(poisoned.empty(), poisoned);
  StepResult r;
  r.loss_scale = pipeline->loss_scale();
  const bool boundary = (micro_steps + 1) % ctx.options.grad_accumulation == 0;
  if (recorder) recorder->begin_step();
  residency.begin_step();
  if (op_gathers) op_gathers->begin_step();
  {
    OpHook::Scope scope(*hook);
    torch::Tensor loss = loss_fn();  // forward: operators through before_op/after_op
    STRATA_CHECK(loss.defined() && loss.numel() == 1, "train_step's closure must return the loss as one number");
    r.loss = loss.item<double>();
    if (tracing()) recorder->set_phase("backward");
    if (reducer && boundary) reducer->begin();
    if (ctx.options.prefetch && boundary) pipeline->read_state_early();
    // Backward: operators as in forward, gradients into the sink, reductions as families complete.
    if (r.loss_scale != 1.0) {
      (loss.to(torch::kFloat32) * r.loss_scale).backward();
    } else {
      loss.backward();
    }
  }
  residency.end_step();
  if (op_gathers) {
    op_gathers->end_step();
    op_gathers->release_all();
  }
  if (reducer && boundary) reducer->finish();
  if (++micro_steps % ctx.options.grad_accumulation == 0) {
    if (tracing()) {
      recorder->set_phase("optimizer");
      recorder->begin_op("strata::optimizer_step", {});
    }
    r.stepped = pipeline->step(r.grad_norm);
    r.overflow = !r.stepped;
    if (tracing()) recorder->end_op();
  }
  if (recorder) recorder->end_step();
  return r;
}

torch::Tensor Engine::Impl::run(const std::function<torch::Tensor()>& fn) {
  residency.leave_plan();
  OpHook::Scope scope(*hook);
  torch::NoGradGuard no_grad;
  torch::Tensor out = fn().clone();  // owned: it must not alias a parameter chunk
  if (op_gathers) op_gathers->release_all();
  return out;
}

// --- the public surface ------------------------------------------------------

Engine::Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options)
    : Engine(module, OptimizerConfig::from(optimizer), std::move(options), nullptr) {}

Engine::Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options,
               std::shared_ptr<Communicator> comm)
    : Engine(module, OptimizerConfig::from(optimizer), std::move(options), std::move(comm)) {}

Engine::Engine(torch::nn::Module& module, OptimizerConfig optimizer, EngineOptions options,
               std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>(module, std::move(optimizer), std::move(options), std::move(comm))) {}

Engine::~Engine() = default;

StepResult Engine::train_step(const std::function<torch::Tensor()>& loss_fn) { return impl_->train_step(loss_fn); }
torch::Tensor Engine::run(const std::function<torch::Tensor()>& fn) { return impl_->run(fn); }

void Engine::zero_grad() {
  impl_->sink->zero();
  impl_->micro_steps = 0;
}

torch::ScalarType Engine::compute_dtype() const { return impl_->ctx.compute; }
double Engine::loss_scale() const { return impl_->pipeline->loss_scale(); }
int64_t Engine::skipped_steps() const { return impl_->pipeline->skipped(); }
int64_t Engine::micro_steps() const { return impl_->micro_steps; }
int64_t Engine::replans() const { return impl_->residency.replans(); }
int64_t Engine::collectives() const { return impl_->ctx.collectives; }
int64_t Engine::parameter_gathers() const { return impl_->op_gathers ? impl_->op_gathers->gathers() : 0; }
int64_t Engine::parameter_gathers_ahead() const {
  return impl_->op_gathers ? impl_->op_gathers->gathers_ahead() : 0;
}
int Engine::zero_stage() const { return impl_->ctx.stage; }
Engine::DataWait Engine::data_wait() const { return impl_->ctx.wait; }
uint64_t Engine::lowest_device_budget() const {
  const uint64_t floor = impl_->residency.capacity_floor();
  return floor == UINT64_MAX ? impl_->ctx.options.budgets.device : floor;
}
// --- optimizer, groups and schedule ------------------------------------------

namespace {
size_t group_index(const EngineContext& ctx, const std::string& group) {
  for (size_t g = 0; g < ctx.groups.size(); ++g) {
    if (ctx.groups[g].name == group) return g;
  }
  std::string names;
  for (const GroupSettings& g : ctx.groups) names += (names.empty() ? "" : ", ") + g.name;
  STRATA_FAIL("no parameter group named \"", group, "\"; the groups are ", names);
}
}  // namespace

OptimizerKind Engine::optimizer() const { return impl_->ctx.optimizer.kind; }

std::vector<std::string> Engine::param_groups() const {
  std::vector<std::string> names;
  for (const GroupSettings& g : impl_->ctx.groups) names.push_back(g.name);
  return names;
}

std::vector<std::string> Engine::group_parameters(const std::string& group) const {
  const size_t g = group_index(impl_->ctx, group);
  std::vector<std::string> names;
  for (const ManagedParam& p : impl_->ctx.params) {
    if (p.group == g) names.push_back(p.name);
  }
  return names;
}

void Engine::set_lr(double lr) {
  STRATA_CHECK(std::isfinite(lr) && lr >= 0, "set_lr: lr must be a finite number >= 0, got ", lr);
  for (GroupSettings& g : impl_->ctx.groups) g.lr = lr;
}

void Engine::set_lr(const std::string& group, double lr) {
  STRATA_CHECK(std::isfinite(lr) && lr >= 0, "set_lr: lr must be a finite number >= 0, got ", lr);
  impl_->ctx.groups[group_index(impl_->ctx, group)].lr = lr;
}

double Engine::lr(const std::string& group) const {
  return impl_->pipeline->current_lr(group_index(impl_->ctx, group));
}

double Engine::base_lr(const std::string& group) const { return impl_->ctx.groups[group_index(impl_->ctx, group)].lr; }

void Engine::set_schedule(const LrSchedule& schedule) {
  schedule.validate();
  impl_->ctx.optimizer.schedule = schedule;
}

const LrSchedule& Engine::schedule() const { return impl_->ctx.optimizer.schedule; }

int64_t Engine::optimizer_steps() const { return impl_->pipeline->optimizer_steps(); }

memory::ChunkManager& Engine::chunks() { return *impl_->ctx.mgr; }
memory::TierStats Engine::tier_stats(memory::Tier tier) const { return impl_->ctx.mgr->tier_stats(tier); }
memory::MoveStats Engine::move_stats() const { return impl_->ctx.mgr->move_stats(); }
size_t Engine::num_families() const { return impl_->ctx.families.size(); }
size_t Engine::nvme_optim_families() const {
  const std::vector<bool>& on_nvme = impl_->pipeline->optim_on_nvme();
  return static_cast<size_t>(std::count(on_nvme.begin(), on_nvme.end(), true));
}

int64_t Engine::managed_parameters() const {
  int64_t n = 0;
  for (const auto& p : impl_->ctx.params) n += p.numel;
  return n;
}

int64_t Engine::model_state_bytes() const {
  return managed_parameters() *
         model_state_bytes_per_param(impl_->ctx.options.precision, impl_->ctx.optimizer.state_count());
}

std::unique_ptr<Engine> attach(torch::nn::Module& module, OptimizerConfig optimizer, EngineOptions options,
                               std::shared_ptr<Communicator> comm) {
  return std::make_unique<Engine>(module, std::move(optimizer), std::move(options), std::move(comm));
}

std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options) {
  return std::make_unique<Engine>(module, optimizer, std::move(options));
}

std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options,
                               std::shared_ptr<Communicator> comm) {
  return std::make_unique<Engine>(module, optimizer, std::move(options), std::move(comm));
}

}  // namespace strata::parallel
