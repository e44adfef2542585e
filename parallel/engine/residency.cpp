#include "residency.h"

#include <algorithm>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::parallel {

std::unique_ptr<memory::EvictionPolicy> Residency::make_policy() {
  std::unique_ptr<memory::EvictionPolicy> policy = memory::make_policy(memory::parse_policy(ctx_.options.policy));
  planner_ = dynamic_cast<memory::TracePolicy*>(policy.get());
  placement_ = dynamic_cast<memory::StaticPolicy*>(policy.get());
  return policy;
}

void Residency::hold_static_chunks() {
  if (placement_ == nullptr) return;
  std::vector<std::pair<ChunkId, uint64_t>> param_chunks;
  for (memory::FamilyId f : ctx_.families) {
    const ChunkId c = ctx_.mgr->family(f).param;
    param_chunks.emplace_back(c, ctx_.mgr->chunk(c).alloc_bytes());
  }
  placement_->set_held(
      memory::static_held_chunks(param_chunks, ctx_.options.static_param_fraction, ctx_.options.budgets.device));
}

void Residency::on_placed(const memory::Chunk& c, std::optional<Tier> tier, void* ptr) {
  const auto it = ctx_.params_of_chunk.find(c.id());
  if (it == ctx_.params_of_chunk.end()) return;
  for (size_t i : it->second) {
    ManagedParam& p = ctx_.params[i];
    if (!p.storage) continue;  // still being attached
    // On nvme, `ptr` is the store's read-only view where it has one, host
    // memory (Note [Parameters on NVMe stay readable]): a CPU storage can point there.
    const bool readable = ctx_.addressable(tier) || (tier == Tier::kNvme && ctx_.addressable(Tier::kHost));
    void* slot = readable && ptr != nullptr ? static_cast<char*>(ptr) + p.offset * ctx_.elem_size() : nullptr;
    p.storage->set_data_ptr_noswap(c10::DataPtr(slot, ctx_.device));
  }
}

void Residency::begin_step() {
  in_step_ = true;
  cursor_ = 0;
  diverged_ = false;
  nm_stale_ = false;
  if (planning_) {
    plan_rec_.clear();
    plan_nm_rec_.clear();
    plan_live_rec_.clear();
  }
}

void Residency::end_step() {
  in_step_ = false;
  EngineContext::settle(prefetches_);
  EngineContext::settle(staged_);
  if (planner_ == nullptr) return;
  if (planning_) {
    if (nm_counter_ != nullptr && !plan_nm_rec_.empty()) {
      plan_nm_rec_.back() = std::max(plan_nm_rec_.back(), nm_counter_->interval_peak());
    }
    plan_nm_ = std::move(plan_nm_rec_);
    plan_nm_rec_.clear();
    plan_live_ = std::move(plan_live_rec_);
    plan_live_rec_.clear();
    planner_->set_plan(std::move(plan_rec_));
    plan_rec_.clear();
    planning_ = false;
  } else if (diverged_ || nm_stale_ || cursor_ != static_cast<int64_t>(planner_->plan_size())) {
    planner_->clear_plan();
    planning_ = true;
    replans_ += 1;
  }
  planner_->set_cursor(static_cast<int64_t>(planner_->plan_size()));  // the optimizer step: next step's order
}

void Residency::abort_step() {
  in_step_ = false;
  EngineContext::settle(prefetches_);
  EngineContext::settle(staged_);
  planning_ = true;
  diverged_ = false;
  plan_rec_.clear();
  plan_nm_rec_.clear();
  plan_live_rec_.clear();
  if (planner_ != nullptr) planner_->clear_plan();
  leave_plan();
}

void Residency::leave_plan() {
  if (planner_ != nullptr) planner_->set_cursor(-1);
}

std::vector<ChunkId> Residency::chunks_of(const std::vector<int64_t>& ids, uint64_t& bytes) const {
  std::vector<ChunkId> chunks;
  bytes = 0;
  for (int64_t id : ids) {
    const ChunkId c = ctx_.param_chunk(ctx_.params[static_cast<size_t>(id)]);
    if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) continue;
    chunks.push_back(c);
    bytes += ctx_.mgr->chunk(c).alloc_bytes();
  }
  return chunks;
}

void Residency::prepare(const std::string& op, const std::string& first_param, const std::vector<ChunkId>& chunks,
                        uint64_t needed) {
  if (planner_ != nullptr && in_step_) follow_plan(op, chunks);
  if (placement_ != nullptr && ctx_.stage < 3) return_streamed(chunks);
  if (nm_counter_ != nullptr) apply_capacity(op, needed);
  const uint64_t budget = ctx_.mgr->tier_stats(Tier::kDevice).budget;
  STRATA_CHECK(needed <= budget, "operator ", op, " on parameter '", first_param, "' needs ", format_bytes(needed),
               " of parameter chunks on the device tier at once (", chunks.size(),
               " chunks), more than the device budget of ", format_bytes(budget),
               "; raise the device budget or lower the chunk size");
}

void Residency::pin_operator(const std::vector<int64_t>& ids) {
  std::vector<std::pair<ChunkId, size_t>> pinned;
  const auto waited_from = Clock::now();
  try {
    for (int64_t id : ids) {
      const ManagedParam& p = ctx_.params[static_cast<size_t>(id)];
      const ChunkId c = ctx_.param_chunk(p);
      ctx_.pin(c, Tier::kDevice, {p.slot});
      pinned.emplace_back(c, p.slot);
    }
  } catch (...) {
    for (const auto& [c, s] : pinned) ctx_.mgr->transition(c, s, TensorState::kHold);
    throw;
  }
  ctx_.wait.operators += seconds_since(waited_from);
}

void Residency::unpin_operator(const std::vector<int64_t>& ids) {
  for (int64_t id : ids) {
    const ManagedParam& p = ctx_.params[static_cast<size_t>(id)];
    ctx_.mgr->transition(ctx_.param_chunk(p), p.slot, TensorState::kHold);
  }
}

// Moves the plan's cursor to this operator, or records it while planning;
// an operator that is not the plan's next one ends the plan for this step.
void Residency::follow_plan(const std::string& op, const std::vector<ChunkId>& chunks) {
  if (planning_) {
    plan_rec_.push_back(chunks);
  } else if (!diverged_) {
    if (planner_->plan_op(cursor_) != chunks) {
      diverged_ = true;
      planner_->set_cursor(-1);
      STRATA_LOG(kInfo, "operator #{} ({}) is not the planned one: LRU for the rest of this step, re-planning "
                 "next step", cursor_, op);
    } else {
      planner_->set_cursor(cursor_);
    }
  }
  cursor_ += 1;
}

// Starts moves to the device of the chunks the next operators use, only
// when all of them fit in the device tier's free bytes and no earlier
// prefetch is still queued (its bytes are reserved only when it starts): a
// prefetch must never cause an eviction, or it could move more than LRU.
void Residency::prefetch_next() {
  if (planner_ == nullptr || !in_step_ || planning_ || diverged_ || !ctx_.options.prefetch) return;
  stage_next();
  if (!all_finished(prefetches_)) return;
  std::vector<ChunkId> wanted;
  uint64_t bytes = 0;
  for (int64_t k = cursor_; k < cursor_ + memory::kPrefetchLookaheadOps; ++k) {
    for (ChunkId c : planner_->plan_op(k)) {
      const memory::Chunk& chunk = ctx_.mgr->chunk(c);
      if (chunk.resident_on(Tier::kDevice) || !chunk.location()) continue;
      if (std::find(wanted.begin(), wanted.end(), c) != wanted.end()) continue;
      wanted.push_back(c);
      bytes += chunk.alloc_bytes();
    }
  }
  const memory::TierStats dev = ctx_.mgr->tier_stats(Tier::kDevice);
  if (wanted.empty() || dev.used + bytes > dev.budget) return;
  for (ChunkId c : wanted) prefetches_.push_back(ctx_.mgr->prefetch(c, Tier::kDevice));
}

bool Residency::all_finished(const std::vector<offload::CopyTicket>& tickets) {
  return std::all_of(tickets.begin(), tickets.end(), [](const auto& t) { return offload::CopyEngine::test(t); });
}

// See Note [Staging the next operators' chunks from NVMe].
void Residency::stage_next() {
  // Nothing on NVMe (the common case while the state fits): no scan of the plan per operator.
  if (ctx_.mgr->tier_stats(Tier::kNvme).chunks == 0) return;
  if (!all_finished(staged_)) return;
  EngineContext::settle(staged_);  // all finished: a failed one is retried by its operator's access
  const uint64_t window = ctx_.mgr->tier_stats(Tier::kHost).budget / kStageWindowFraction;
  const auto end = std::min(static_cast<int64_t>(planner_->plan_size()), cursor_ + kStageLookaheadOps);
  std::vector<ChunkId> wanted;
  uint64_t bytes = 0;
  for (int64_t k = cursor_; k < end; ++k) {
    for (ChunkId c : planner_->plan_op(k)) {
      const memory::Chunk& chunk = ctx_.mgr->chunk(c);
      if (chunk.location() != Tier::kNvme) continue;  // on the device or host, or not materialised (ZeRO-3)
      if (std::find(wanted.begin(), wanted.end(), c) != wanted.end()) continue;
      if (!wanted.empty() && bytes + chunk.alloc_bytes() > window) {
        k = end;
        break;
      }
      wanted.push_back(c);
      bytes += chunk.alloc_bytes();
    }
  }
  for (ChunkId c : wanted) staged_.push_back(ctx_.mgr->prefetch_up(c, Tier::kHost));
}

// See Note [Static placement]: the previous operator's streamed chunks that
// this one does not use go back to host; this one's become the next to go.
void Residency::return_streamed(const std::vector<ChunkId>& chunks) {
  for (ChunkId c : streamed_) {
    if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) continue;
    const memory::Chunk& chunk = ctx_.mgr->chunk(c);
    if (chunk.resident_on(Tier::kDevice) && chunk.movable()) ctx_.mgr->move(c, Tier::kHost);
  }
  streamed_.clear();
  for (ChunkId c : chunks) {
    if (!placement_->held(c)) streamed_.push_back(c);
  }
}

// See Note [Device capacity].
void Residency::apply_capacity(const std::string& op, uint64_t needed) {
  const uint64_t interval = nm_counter_->interval_peak();  // since the previous operator with parameters
  nm_counter_->reset_interval_peak();
  const uint64_t live = nm_counter_->current();
  uint64_t predicted = 0;
  if (planner_ != nullptr && in_step_) {
    const int64_t k = cursor_ - 1;  // follow_plan counted this operator
    if (planning_) {
      if (!plan_nm_rec_.empty()) plan_nm_rec_.back() = std::max(plan_nm_rec_.back(), interval);
      plan_nm_rec_.push_back(0);
      plan_live_rec_.push_back(live);
    } else if (!diverged_ && k >= 0 && k < static_cast<int64_t>(plan_nm_.size())) {
      // Activations unlike the planning step's (another sequence length or
      // batch): the peaks ahead are assumed to grow by as much, and the
      // next step records them again.
      const uint64_t planned = plan_live_[static_cast<size_t>(k)];
      predicted = plan_nm_[static_cast<size_t>(k)] + (live > planned ? live - planned : 0);
      const uint64_t gap = live > planned ? live - planned : planned - live;
      if (!nm_stale_ && gap > std::max<uint64_t>(64 << 10, planned / 4)) {
        nm_stale_ = true;
        STRATA_LOG(kInfo, "operator #{} ({}) starts with {} of activations where the plan had {}: re-planning "
                   "next step", k, op, format_bytes(live), format_bytes(planned));
      }
    }
  }
  const uint64_t non_model = std::max(live, predicted);
  const uint64_t usable = usable_capacity();
  STRATA_CHECK(usable >= live + needed, "operator ", op, " needs ", format_bytes(needed),
               " of parameter chunks on the device, but ", format_bytes(live),
               " of live activations and workspace leave ", format_bytes(usable > live ? usable - live : 0),
               " of the ", format_bytes(usable), " usable device capacity; raise device_capacity or lower the batch");
  // The operator's own chunks stay even when the peak expected after it
  // leaves less room: relieve_capacity() evicts them once they are unpinned.
  const uint64_t budget = std::max(needed, usable > non_model ? usable - non_model : 0);
  capacity_floor_ = std::min(capacity_floor_, ctx_.mgr->set_budget(Tier::kDevice, budget));
}

void Residency::relieve_capacity() {
  if (nm_counter_ == nullptr) return;
  const uint64_t live = nm_counter_->current();
  const uint64_t usable = usable_capacity();
  if (live + ctx_.mgr->tier_stats(Tier::kDevice).budget <= usable) return;
  capacity_floor_ = std::min(capacity_floor_, ctx_.mgr->set_budget(Tier::kDevice, usable > live ? usable - live : 0));
}

uint64_t Residency::usable_capacity() const {
  return static_cast<uint64_t>(static_cast<double>(ctx_.options.device_capacity) * ctx_.options.device_safety_ratio);
}

}  // namespace strata::parallel
