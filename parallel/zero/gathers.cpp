#include "gathers.h"

#include <algorithm>
#include <string>

namespace strata::parallel {

OperatorGathers::OperatorGathers(EngineContext& ctx) : ctx_(ctx) {
  std::vector<int> all(static_cast<size_t>(ctx.world()));
  for (int r = 0; r < ctx.world(); ++r) all[static_cast<size_t>(r)] = r;
  comm_ = ctx.comm->split(all, "zero3-parameters");
}

void OperatorGathers::begin_step() {
  cursor_ = 0;
  diverged_ = false;
  if (recording_) rec_.clear();
}

void OperatorGathers::end_step() {
  if (recording_) {
    plan_ = std::move(rec_);
    rec_.clear();
    recording_ = false;
  } else if (diverged_ || cursor_ != static_cast<int64_t>(plan_.size())) {
    recording_ = true;
  }
}

void OperatorGathers::before_operator(const std::vector<ChunkId>& chunks, bool in_step) {
  memory::ChunkManager& mgr = *ctx_.mgr;
  std::vector<ChunkId> window = chunks;
  if (in_step) {
    if (recording_) {
      rec_.push_back(chunks);
    } else if (!diverged_ && (cursor_ >= static_cast<int64_t>(plan_.size()) || plan_[static_cast<size_t>(cursor_)] != chunks)) {
      diverged_ = true;
    }
    cursor_ += 1;
    if (!recording_ && !diverged_ && ctx_.options.prefetch) {
      // At stage 3 gathered chunks are all the device tier holds; with
      // device_capacity the budget moves with activations, so prefetch
      // keeps to half of it.
      const uint64_t room =
          ctx_.options.device_capacity > 0 ? ctx_.options.budgets.device / 2 : ctx_.options.budgets.device;
      uint64_t bytes = 0;
      for (ChunkId c : window) bytes += mgr.chunk(c).alloc_bytes();
      const int64_t end =
          std::min<int64_t>(cursor_ + memory::kPrefetchLookaheadOps - 1, static_cast<int64_t>(plan_.size()));
      for (int64_t k = cursor_; k < end; ++k) {
        for (ChunkId c : plan_[static_cast<size_t>(k)]) {
          if (std::find(window.begin(), window.end(), c) != window.end()) continue;
          bytes += mgr.chunk(c).alloc_bytes();
          if (bytes > room) break;
          window.push_back(c);
        }
      }
    }
  }
  for (size_t i = 0; i < gathered_.size();) {
    const ChunkId c = gathered_[i].first;
    if (std::find(window.begin(), window.end(), c) != window.end()) {
      ++i;
      continue;
    }
    finish(gathered_[i].second, c);
    if (!mgr.chunk(c).movable()) {  // an enclosing operator still computes on it
      ++i;
      continue;
    }
    mgr.release(c);
    gathered_.erase(gathered_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  for (ChunkId c : window) {
    const bool held = std::any_of(gathered_.begin(), gathered_.end(), [&](const auto& g) { return g.first == c; });
    if (held) continue;
    start(c);
    if (std::find(chunks.begin(), chunks.end(), c) == chunks.end()) gathers_ahead_ += 1;
  }
  for (auto& [c, g] : gathered_) {
    if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) finish(g, c);
  }
}

// Materialises the full chunk where operators read it (the device; on CUDA,
// host first, since Gloo moves host memory) and all-gathers every rank's
// shard into it.
void OperatorGathers::start(ChunkId c) {
  memory::ChunkManager& mgr = *ctx_.mgr;
  const ChunkId shard = *mgr.family(mgr.chunk(c).family()).param_shard;
  const Tier where = mgr.device().kind() == offload::DeviceKind::kCuda ? Tier::kHost : Tier::kDevice;
  ctx_.pin(shard, Tier::kHost, {0});
  try {
    ctx_.pin(c, where, ctx_.all_slots(c));
  } catch (...) {
    ctx_.unpin(shard, {0});
    throw;
  }
  Gather g;
  g.shard = shard;
  try {
    g.ids = std::make_shared<std::vector<float>>(static_cast<size_t>(ctx_.world()) + 1);
    (*g.ids)[0] = static_cast<float>(c);
    g.ids_work = comm_->all_gather(g.ids->data(), g.ids->data() + 1, 1, DType::kFloat32);
    g.work = comm_->all_gather(mgr.data(shard), mgr.data(c), static_cast<size_t>(mgr.chunk(shard).capacity_elems()),
                               ctx_.options.precision);
  } catch (...) {
    if (g.ids_work) g.ids_work->wait();
    ctx_.unpin(c, ctx_.all_slots(c));
    ctx_.unpin(shard, {0});
    throw;
  }
  gathered_.emplace_back(c, std::move(g));
  gathers_ += 1;
}

void OperatorGathers::finish(Gather& g, ChunkId c) {
  if (!g.work) return;
  WorkHandle work = std::move(g.work);
  g.work = nullptr;
  std::exception_ptr failure;
  try {
    g.ids_work->wait();
    work->wait();
    check_paired(g);
  } catch (...) {
    failure = std::current_exception();
  }
  ctx_.unpin(c, ctx_.all_slots(c));
  ctx_.unpin(g.shard, {0});
  if (failure) std::rethrow_exception(failure);
}

// See Note [Gathers checked by chunk].
void OperatorGathers::check_paired(const Gather& g) const {
  const std::vector<float>& ids = *g.ids;
  int other = -1;  // the first rank that gathered another chunk than rank 0: the same on every rank
  for (int r = 1; r < ctx_.world() && other < 0; ++r) {
    if (ids[static_cast<size_t>(r) + 1] != ids[1]) other = r;
  }
  if (other < 0) return;
  const auto describe = [&](int r) {
    const auto chunk = static_cast<ChunkId>(ids[static_cast<size_t>(r) + 1]);
    std::string names;
    const auto it = ctx_.params_of_chunk.find(chunk);
    if (it != ctx_.params_of_chunk.end()) {
      for (size_t i = 0; i < it->second.size() && i < 4; ++i) {
        names += (i ? ", " : "") + ctx_.params[it->second[i]].name;
      }
      if (it->second.size() > 4) names += ", ...";
    }
    return "rank " + std::to_string(r) + " gathered parameter chunk " + std::to_string(chunk) + " (" + names + ")";
  };
  STRATA_FAIL("ZeRO stage 3: the ranks' parameter gathers no longer pair: ", describe(0), " while ", describe(other),
              ". The ranks ran different operators on parameters (a data-dependent branch such as MoE routing, or "
              "a layer some ranks skip); stage 3 needs every rank to run the same operators on parameters in the "
              "same order. Train this model at zero_stage 2 (optimizer state and gradients sharded), or run every "
              "branch on every rank.");
}

void OperatorGathers::release_all() {
  std::exception_ptr failure;
  for (auto& [c, g] : gathered_) {
    try {
      finish(g, c);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    if (ctx_.mgr->chunk(c).movable()) ctx_.mgr->release(c);
  }
  gathered_.clear();
  if (failure) std::rethrow_exception(failure);
}

void StepGathers::start(memory::FamilyId f) {
  const memory::ChunkFamily& fam = ctx_.mgr->family(f);
  ctx_.pin(fam.param, Tier::kHost, ctx_.all_slots(fam.param));
  const int64_t shard = fam.layout->shards.shard_elems;
  ParamGather g;
  g.chunk = fam.param;
  try {
    g.work = ctx_.comm->all_gather(ctx_.at(fam.param, ctx_.rank * shard), ctx_.mgr->data(fam.param),
                                   static_cast<size_t>(shard), ctx_.options.precision);
  } catch (...) {
    ctx_.unpin(fam.param, ctx_.all_slots(fam.param));
    throw;
  }
  in_flight_.push_back(std::move(g));
  ctx_.collectives += 1;
}

void StepGathers::finish(size_t keep) {
  std::exception_ptr failure;
  while (in_flight_.size() > keep) {
    ParamGather g = std::move(in_flight_.front());
    in_flight_.pop_front();
    try {
      g.work->wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    ctx_.unpin(g.chunk, ctx_.all_slots(g.chunk));
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace strata::parallel
