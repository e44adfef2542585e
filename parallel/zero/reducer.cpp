#include "reducer.h"

#include <algorithm>

namespace strata::parallel {

GradientReducer::GradientReducer(EngineContext& ctx) : ctx_(ctx) {}

void GradientReducer::begin() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const size_t n = ctx_.families.size();
  reductions_.assign(n, nullptr);
  cursor_ = n;
  arrivals_.assign(ctx_.params.size(), 0);
  // Note [Data parallel gradients]: ready once each trainable parameter has
  // arrived as often as in the last backward; before one, at the end.
  const bool learnt = expected_.size() == ctx_.params.size();
  unsettled_.assign(n, learnt ? 0 : kNever);
  if (learnt) {
    for (size_t i = 0; i < ctx_.params.size(); ++i) {
      if (ctx_.params[i].accumulator == nullptr) continue;  // frozen: never arrives
      int& u = unsettled_[ctx_.family_pos.at(ctx_.params[i].family)];
      u = expected_[i] > 0 && u < kNever ? u + 1 : kNever;
    }
  }
  active_ = true;
  issue_ready();  // families with no trainable parameter
}

void GradientReducer::check_open(size_t index) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const ManagedParam& p = ctx_.params[index];
  STRATA_CHECK(ctx_.family_pos.at(p.family) < cursor_, "parameter ", p.name, "'s gradient arrived (",
               arrivals_[index] + 1, " times in this backward, ", index < expected_.size() ? expected_[index] : 0,
               " in the one before) after its chunk family's gradients were sent to be summed over the ",
               ctx_.world(), " data-parallel ranks: the model uses this parameter more often than in the step "
               "before, and a family's gradients are summed as soon as its parameters have arrived as often as "
               "then. Use each parameter the same number of times every step");
}

void GradientReducer::arrived(size_t index) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const int n = ++arrivals_[index];
  if (ctx_.params[index].accumulator != nullptr) {
    int& u = unsettled_[ctx_.family_pos.at(ctx_.params[index].family)];
    if (u < kNever && n > expected_[index]) {
      u = kNever;  // more often than before, before its family went: it waits for the end
    } else if (u < kNever && n == expected_[index]) {
      --u;
    }
  }
  issue_ready();
  if (ctx_.stage >= 2) settle_done();
}

void GradientReducer::issue_ready() {
  while (cursor_ > 0 && unsettled_[cursor_ - 1] == 0) issue(--cursor_);
}

void GradientReducer::issue(size_t pos) {
  const memory::ChunkFamily& fam = ctx_.mgr->family(ctx_.families[pos]);
  const ChunkId gc = fam.grad;
  // Pinned where the communicator reads them, unmoved while it does. A pin
  // that finds no room waits for the oldest reduction (EngineContext::make_room).
  ctx_.pin(gc, ctx_.comm_tier(), ctx_.all_slots(gc));
  if (fam.grad_shard) {
    try {
      ctx_.pin(*fam.grad_shard, ctx_.comm_tier(), {0});
    } catch (...) {
      ctx_.unpin(gc, ctx_.all_slots(gc));
      throw;
    }
    reductions_[pos] = ctx_.comm->reduce_scatter(
        ctx_.mgr->data(gc), ctx_.mgr->data(*fam.grad_shard),
        static_cast<size_t>(ctx_.mgr->chunk(*fam.grad_shard).capacity_elems()), ctx_.options.precision, ReduceOp::kSum);
  } else {
    reductions_[pos] = ctx_.comm->all_reduce(ctx_.mgr->data(gc), static_cast<size_t>(ctx_.mgr->chunk(gc).capacity_elems()),
                                             ctx_.options.precision, ReduceOp::kSum);
  }
  ctx_.collectives += 1;
}

// Waits for family position `pos`'s reduction and unpins its chunks; with a
// gradient shard the full gradient chunk is no longer needed.
void GradientReducer::settle(size_t pos) {
  if (!reductions_[pos]) return;
  const WorkHandle work = std::move(reductions_[pos]);
  reductions_[pos] = nullptr;
  const memory::ChunkFamily& fam = ctx_.mgr->family(ctx_.families[pos]);
  std::exception_ptr failure;
  try {
    work->wait();
  } catch (...) {
    failure = std::current_exception();
  }
  ctx_.unpin(fam.grad, ctx_.all_slots(fam.grad));
  if (fam.grad_shard) {
    ctx_.unpin(*fam.grad_shard, {0});
    if (!failure) ctx_.mgr->release(fam.grad);
  }
  if (failure) std::rethrow_exception(failure);
}

// Stages 2 and 3: full gradient chunks whose reduce-scatter has completed
// are released during backward, so few exist at once.
void GradientReducer::settle_done() {
  for (size_t pos = cursor_; pos < reductions_.size(); ++pos) {
    if (reductions_[pos] && reductions_[pos]->done()) settle(pos);
  }
}

bool GradientReducer::settle_oldest() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  for (size_t q = reductions_.size(); q-- > 0;) {  // issued in descending order: the highest is the oldest
    if (reductions_[q]) {
      settle(q);
      return true;
    }
  }
  return false;
}

void GradientReducer::abandon() noexcept {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  active_ = false;
  for (size_t pos = 0; pos < reductions_.size(); ++pos) {
    try {
      settle(pos);
    } catch (const std::exception& e) {
      STRATA_LOG(kDebug, "a gradient reduction of the failed step: {}", e.what());
    }
  }
}

void GradientReducer::finish() {
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    active_ = false;
    while (cursor_ > 0) issue(--cursor_);
  }
  std::vector<ManagedParam>& params = ctx_.params;
  std::vector<float> used(params.size());
  for (size_t i = 0; i < params.size(); ++i) used[i] = params[i].has_grad ? 1.0f : 0.0f;
  WorkHandle flags = ctx_.comm->all_reduce(used.data(), used.size(), DType::kFloat32, ReduceOp::kMax);
  ctx_.collectives += 1;
  std::exception_ptr failure;
  for (size_t pos = 0; pos < reductions_.size(); ++pos) {
    try {
      settle(pos);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  try {
    flags->wait();
  } catch (...) {
    if (!failure) failure = std::current_exception();
  }
  if (failure) std::rethrow_exception(failure);
  for (size_t i = 0; i < params.size(); ++i) params[i].has_grad = used[i] > 0.0f;
  expected_ = arrivals_;
}

}  // namespace strata::parallel
