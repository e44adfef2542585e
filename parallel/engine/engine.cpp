// The engine's orchestration: one training step through the components, in
// the order it runs (docs/architecture.md, "One step through the engine").

#include "strata/parallel/engine.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <exception>

#include "engine_impl.h"

namespace strata::parallel {

// --- one operator (forward, backward or Engine::run) -------------------------

void Engine::Impl::before_op(const OpCall& call) {
  if (!call.in_scope) return before_outside(call);
  const std::vector<int64_t>& ids = call.ids;
  if (tracing()) recorder->begin_op(call.op.schema().name(), ids);
  if (ids.empty()) {
    residency.relieve_capacity();
    return;
  }
  uint64_t needed = 0;
  const std::vector<ChunkId> chunks = residency.chunks_of(ids, needed);  // the operator's working set
  if (op_gathers) op_gathers->before_operator(chunks, residency.in_step());  // ZeRO-3: full chunks from shards
  residency.prepare(call.op.schema().name(), ctx.params[static_cast<size_t>(ids.front())].name, chunks, needed);
  residency.pin_operator(ids);
  try {
    residency.prefetch_next();
  } catch (...) {
    residency.unpin_operator(ids);
    throw;
  }
}

void Engine::Impl::after_op(const OpCall& call) {
  if (!call.in_scope) return after_outside(call);
  try {
    land_writes(call);
  } catch (...) {
    residency.unpin_operator(call.ids);
    throw;
  }
  residency.unpin_operator(call.ids);
  if (tracing()) recorder->end_op();
}

// Values an operator wrote into parameters (Note [Parameters between steps]).
void Engine::Impl::land_writes(const OpCall& call) {
  for (int64_t id : call.written) {
    const auto i = static_cast<size_t>(id);
    if (access->replaced(i)) {
      access->absorb(i, /*pinned=*/true);  // Tensor::set_ (torch::load) gave it another storage
    } else {
      access->land_written(i);
    }
  }
}

// --- operators on parameters between steps -----------------------------------

namespace {
thread_local bool t_holds_access = false;  // this thread holds access_mu for an operator
}  // namespace

void Engine::Impl::before_outside(const OpCall& call) {
  const std::string& name = ctx.params[static_cast<size_t>(call.ids.front())].name;
  const bool own_step = step_thread.load() == std::this_thread::get_id();  // a before_step callback
  if (!own_step) {
    STRATA_CHECK(!busy(), "parameter ", name, " was used by ", call.op.schema().name(),
                 " on another thread while train_step or run is running; use parameters between steps, or "
                 "inside the step from the thread that runs it");
    access_mu.lock();
    t_holds_access = true;
  }
  try {
    STRATA_CHECK(poisoned.empty(), "parameter ", name, " cannot be read: ", poisoned);
    residency.leave_plan();
    uint64_t needed = 0;
    const std::vector<ChunkId> chunks = residency.chunks_of(call.ids, needed);
    if (op_gathers) op_gathers->before_operator(chunks, /*in_step=*/false);
    residency.prepare(call.op.schema().name(), name, chunks, needed);
    residency.pin_operator(call.ids);
  } catch (...) {
    if (op_gathers) {
      try {
        op_gathers->release_all();
      } catch (...) {  // the first failure is the one reported
      }
    }
    if (t_holds_access) {
      t_holds_access = false;
      access_mu.unlock();
    }
    throw;
  }
}

void Engine::Impl::after_outside(const OpCall& call) {
  std::exception_ptr failure;
  try {
    land_writes(call);
  } catch (...) {
    failure = std::current_exception();
  }
  residency.unpin_operator(call.ids);
  try {
    if (op_gathers) {
      op_gathers->finish_rounds();
      op_gathers->release_all();
    }
  } catch (...) {
    if (!failure) failure = std::current_exception();
  }
  if (t_holds_access) {
    t_holds_access = false;
    access_mu.unlock();
  }
  if (failure) std::rethrow_exception(failure);
}

Engine::Impl::Busy::Busy(Impl& impl) : impl_(impl) {
  STRATA_CHECK(impl.step_thread.load() != std::this_thread::get_id(),
               "train_step, run, save, load and export_weights cannot be called from inside train_step or run "
               "(from the loss function or the before_step callback)");
  lock_ = std::unique_lock<std::mutex>(impl.access_mu);
  impl.step_thread = std::this_thread::get_id();
  try {
    impl.access->absorb_replaced();  // torch::load, set_data: Note [Parameters between steps]
  } catch (...) {
    impl.step_thread = std::thread::id{};
    throw;
  }
}

Engine::Impl::Busy::~Busy() {
  impl_.step_thread = std::thread::id{};
}

// --- one step ----------------------------------------------------------------

StepResult Engine::Impl::train_step(const std::function<torch::Tensor()>& loss_fn,
                                    const std::function<void()>& before_step) {
  return run_step(
      [&](double loss_scale) {
        torch::Tensor loss = loss_fn();  // forward: operators through before_op/after_op
        STRATA_CHECK(loss.defined() && loss.numel() == 1, "train_step's closure must return the loss as one number");
        const double value = loss.item<double>();
        final_backward();
        // Backward: operators as in forward, gradients into the sink, reductions as families complete.
        if (loss_scale != 1.0) {
          (loss.to(torch::kFloat32) * loss_scale).backward();
        } else {
          loss.backward();
        }
        return value;
      },
      before_step);
}

void Engine::Impl::final_backward() {
  STRATA_CHECK(step_thread.load() == std::this_thread::get_id() && in_passes_,
               "final_backward() belongs inside train_step_passes, on its thread");
  begin_final_backward();
}

// Passes that never called final_backward() begin it when they end: the
// reductions then cover every family at finish().
void Engine::Impl::begin_final_backward() {
  if (final_started_) return;
  final_started_ = true;
  if (tracing()) recorder->set_phase("backward");
  if (reducer && boundary_) reducer->begin();
  if (ctx.options.prefetch && boundary_) pipeline->read_state_early();
  // Note [Gradient statistics as families complete]: not when a reduction
  // changes the gradients after they arrive (data parallel, or the sum of
  // tied copies: Note [Tied parameters across stages]).
  const bool track = boundary_ && reducer == nullptr && tied->empty();
  pipeline->track_gradients(track);
  // Note [Updates in backward]: not when the user's hook before the step may change the gradients.
  if (track && ctx.options.update_in_backward) pipeline->begin_backward(!has_before_step_);
  sink->track(track);
}

StepResult Engine::Impl::run_step(const std::function<double(double)>& passes,
                                  const std::function<void()>& before_step) {
  Busy hold(*this);
  STRATA_CHECK(poisoned.empty(), poisoned);
  for (const ModuleState& m : module_state) {
    STRATA_CHECK(!m.frozen_parameter || !m.tensor.requires_grad(), "parameter ", m.name, " did not require grad "
                 "when the module was attached, and requires it now: the engine trains the parameters that required "
                 "grad at attach and would never update this one. Leave it requiring grad at attach (to start it "
                 "frozen, set requires_grad false after attach: a parameter without a gradient is not updated)");
  }
  StepResult r;
  r.loss_scale = pipeline->loss_scale();
  boundary_ = (micro_steps + 1) % ctx.options.grad_accumulation == 0;
  final_started_ = false;
  has_before_step_ = static_cast<bool>(before_step);
  try {
    if (recorder) recorder->begin_step();
    residency.begin_step();
    if (op_gathers) op_gathers->begin_step();
    {
      OpHook::Scope scope(*hook);
      in_passes_ = true;
      try {
        r.loss = passes(r.loss_scale);
      } catch (...) {
        in_passes_ = false;
        throw;
      }
      in_passes_ = false;
      begin_final_backward();
    }
    residency.end_step();
    if (op_gathers) {
      op_gathers->end_step();
      op_gathers->finish_rounds();  // Note [Gathers agreed in rounds]: serve the others until all are done
      op_gathers->release_all();
    }
    if (reducer && boundary_) reducer->finish();
    if (boundary_ && !tied->empty()) {  // Note [Tied parameters across stages]
      ParamAccess::OpenGrads open(*access, 1.0);
      tied->sum_gradients(*access);
    }
    if (boundary_ && before_step) {
      pipeline->track_gradients(false);  // the user's hook may change gradients: the step takes their statistics
      // The gradients the step applies, before clipping: Engine::grad().
      ParamAccess::OpenGrads open(*access, 1.0 / (ctx.options.grad_accumulation * ctx.world() * r.loss_scale));
      before_step();
    }
  } catch (...) {
    abandon_step();
    throw;
  }
  if (++micro_steps % ctx.options.grad_accumulation == 0) {
    if (tracing()) {
      recorder->set_phase("optimizer");
      recorder->begin_op("strata::optimizer_step", {});
    }
    r.stepped = pipeline->step(r.grad_norm);
    r.overflow = !r.stepped;
    r.updated_in_backward = pipeline->updated_in_backward();
    if (tracing()) recorder->end_op();
  }
  if (recorder) recorder->end_step();
  return r;
}

// Note [A train_step that throws]
// An operator that throws (a shape error in user code, a chunk that could not
// be read) has already been unpinned by the hook (OpObserver::after_op runs
// for failed operators too). What remains is the step's own state: the
// residency plan being followed or recorded, ZeRO-3's gathered chunks and
// gathers in flight, the gradient reductions in flight, and the gradients
// backward had added. All are dropped: the plan is recorded again, gathers
// and reductions are waited for and released, and the gradient chunks are
// released, including those of earlier micro-steps of the accumulation in
// progress (the throwing one's contribution cannot be told apart), so the
// next train_step starts a new accumulation from the same weights. One
// process then trains on as if the step had not happened. Data parallel, the
// other ranks are left in the middle of collectives that this rank will never
// join: they fail when their collective times out, and this rank refuses
// further steps (poisoned), since its collectives would pair with theirs out
// of order.
void Engine::Impl::abandon_step() noexcept {
  const auto attempt = [](const char* what, const auto& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      STRATA_LOG(kWarn, "after the failed train_step, {}: {}", what, e.what());
    }
  };
  attempt("ending the step", [&] { residency.abort_step(); });
  if (op_gathers) attempt("releasing gathered chunks", [&] {
      op_gathers->abort_step();
      op_gathers->release_all();
    });
  if (reducer) attempt("waiting for gradient reductions", [&] { reducer->abandon(); });
  pipeline->abandon_backward();
  attempt("dropping gradients", [&] { sink->zero(); });
  if (recorder) attempt("ending the trace step", [&] { recorder->end_step(); });
  micro_steps -= micro_steps % ctx.options.grad_accumulation;
  if (ctx.data_parallel()) {
    poisoned = "an earlier train_step failed on this rank part-way through its collectives, so its collectives "
               "no longer pair with the other ranks'; destroy the engine on every rank and resume from the last "
               "checkpoint";
  }
}

torch::Tensor Engine::Impl::run(const std::function<torch::Tensor()>& fn) {
  Busy hold(*this);
  residency.leave_plan();
  torch::Tensor out;
  try {
    OpHook::Scope scope(*hook);
    torch::NoGradGuard no_grad;
    out = fn().clone();  // owned: it must not alias a parameter chunk
  } catch (...) {
    if (op_gathers) {
      try {
        op_gathers->finish_rounds();  // the other ranks finish their evaluation
        op_gathers->release_all();
      } catch (...) {  // the function's error is the one reported
      }
    }
    throw;
  }
  if (op_gathers) {
    op_gathers->finish_rounds();
    op_gathers->release_all();
  }
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

StepResult Engine::train_step(const std::function<torch::Tensor()>& loss_fn) {
  return impl_->train_step(loss_fn, nullptr);
}
StepResult Engine::train_step(const std::function<torch::Tensor()>& loss_fn, const std::function<void()>& before_step) {
  return impl_->train_step(loss_fn, before_step);
}
StepResult Engine::train_step_passes(const std::function<double(double loss_scale)>& passes,
                                     const std::function<void()>& before_step) {
  return impl_->run_step(passes, before_step);
}
void Engine::final_backward() { impl_->final_backward(); }
torch::Tensor Engine::grad(const torch::Tensor& param) { return impl_->access->grad(impl_->access->find(param)); }
torch::Tensor Engine::grad(const std::string& name) { return impl_->access->grad(impl_->access->find(name)); }
void Engine::set_grad(const torch::Tensor& param, const torch::Tensor& value) {
  impl_->access->set_grad(impl_->access->find(param), value);
}
torch::Tensor Engine::run(const std::function<torch::Tensor()>& fn) { return impl_->run(fn); }

void Engine::zero_grad() {
  impl_->sink->zero();
  impl_->micro_steps = 0;
}

torch::ScalarType Engine::compute_dtype() const { return impl_->ctx.compute; }
torch::Device Engine::device() const { return impl_->ctx.device; }
torch::Tensor Engine::to_device(const torch::Tensor& tensor) const { return to_compute(impl_->ctx, tensor); }
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

memory::StepState Engine::step_state() const {
  const EngineContext& ctx = impl_->ctx;
  int64_t updated = 0;  // elements this rank updates (its shard under ZeRO)
  for (const ManagedParam& p : ctx.params) {
    const auto [begin, end] = ctx.owned(p);
    updated += std::max<int64_t>(0, end - begin);
  }
  const auto n = static_cast<uint64_t>(updated);
  memory::StepState s;
  s.persistent = n * (4 + 4 * static_cast<uint64_t>(ctx.optimizer.state_count()));
  s.gradients = n * dtype_size(ctx.options.precision);
  s.memory = ctx.mgr->tier_stats(Tier::kDevice).budget + ctx.mgr->tier_stats(Tier::kHost).budget;
  // The overflow check skips a step on every family (StepPipeline::step); with
  // update_in_backward no update waits for it (Note [Updates in backward]).
  s.global_barrier = !ctx.options.update_in_backward;
  // Note [What an update in backward cannot keep]
  const auto bytes = [&](ChunkId c) { return static_cast<uint64_t>(ctx.mgr->chunk(c).alloc_bytes()); };
  for (const memory::FamilyId id : ctx.families) {
    const ChunkId param = ctx.step_param(id), grad = ctx.step_grad(id);
    uint64_t kept = bytes(param);  // between steps: the parameters and the optimizer state
    s.parameters += kept;
    for (ChunkId c : ctx.optim_members(id)) kept += bytes(c);
    s.stored += kept;
    s.largest_update = std::max(s.largest_update, kept + (grad == param ? 0 : bytes(grad)));
  }
  s.host = ctx.mgr->tier_stats(Tier::kHost).budget;
  return s;
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
