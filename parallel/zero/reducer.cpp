#include "reducer.h"

#include <algorithm>

namespace strata::parallel {

GradientReducer::GradientReducer(EngineContext& ctx) : ctx_(ctx) {}

void GradientReducer::begin() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  arrived_.assign(ctx_.families.size(), 0);
  reductions_.assign(ctx_.families.size(), nullptr);
  cursor_ = ctx_.families.size();
  active_ = true;
}

void GradientReducer::arrived(memory::FamilyId f) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  arrived_[ctx_.family_pos.at(f)] += 1;
  issue_ready();
  if (ctx_.stage >= 2) settle_done();
}

void GradientReducer::issue_ready() {
  while (cursor_ > 0 &&
         arrived_[cursor_ - 1] == ctx_.params_of_chunk.at(ctx_.mgr->family(ctx_.families[cursor_ - 1]).param).size()) {
    issue(--cursor_);
  }
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
}

}  // namespace strata::parallel
