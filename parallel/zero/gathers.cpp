#include "gathers.h"

#include <algorithm>
#include <string>

namespace strata::parallel {

OperatorGathers::OperatorGathers(EngineContext& ctx) : ctx_(ctx) {
  std::vector<int> all(static_cast<size_t>(ctx.world()));
  for (int r = 0; r < ctx.world(); ++r) all[static_cast<size_t>(r)] = r;
  comm_ = ctx.comm->split(all, "zero3-parameters");
  STRATA_CHECK(ctx.mgr->num_chunks() < (size_t{1} << 24), "ZeRO stage 3 names chunks as fp32 values in its "
               "gather rounds, exactly below 2^24 chunks; this model has ", ctx.mgr->num_chunks(),
               ": raise chunk_elems");
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
  std::vector<ChunkId> missing;
  for (ChunkId c : window) {
    const bool held = std::any_of(gathered_.begin(), gathered_.end(), [&](const auto& g) { return g.first == c; });
    if (!held) missing.push_back(c);
  }
  for (size_t from = 0; from < missing.size(); from += kRoundChunks) {
    const size_t to = std::min(missing.size(), from + kRoundChunks);
    round(std::vector<ChunkId>(missing.begin() + static_cast<std::ptrdiff_t>(from),
                               missing.begin() + static_cast<std::ptrdiff_t>(to)),
          /*done=*/false);
  }
  for (ChunkId c : missing) {
    if (std::find(chunks.begin(), chunks.end(), c) == chunks.end()) gathers_ahead_ += 1;
  }
  for (auto& [c, g] : gathered_) {
    if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) finish(g, c);
  }
}

// See Note [Gathers agreed in rounds].
bool OperatorGathers::round(const std::vector<ChunkId>& want, bool done) {
  const size_t per = kRoundChunks + 1;
  std::vector<float> mine(per, -1.0f), all(per * static_cast<size_t>(ctx_.world()));
  mine[0] = done ? 1.0f : 0.0f;
  for (size_t k = 0; k < want.size() && k < static_cast<size_t>(kRoundChunks); ++k) {
    mine[k + 1] = static_cast<float>(want[k]);  // chunk ids are far below 2^24: exact in fp32
  }
  comm_->all_gather(mine.data(), all.data(), per, DType::kFloat32)->wait();
  rounds_ += 1;
  bool all_done = true;
  std::vector<ChunkId> agreed;  // the union, by rank then as listed: the same on every rank
  for (int r = 0; r < ctx_.world(); ++r) {
    const float* msg = all.data() + static_cast<size_t>(r) * per;
    all_done = all_done && msg[0] == 1.0f;
    for (size_t k = 1; k < per && msg[k] >= 0.0f; ++k) {
      const auto c = static_cast<ChunkId>(msg[k]);
      STRATA_CHECK(msg[k] < static_cast<float>(ctx_.mgr->num_chunks()) &&
                       ctx_.mgr->chunk(c).role() == memory::ChunkRole::kParam,
                   "ZeRO stage 3: rank ", r, " asked for chunk ", c,
                   ", which is no parameter chunk here: the ranks do not hold the same model");
      if (std::find(agreed.begin(), agreed.end(), c) == agreed.end()) agreed.push_back(c);
    }
  }
  for (ChunkId c : agreed) {
    if (std::find(want.begin(), want.end(), c) != want.end()) {
      start(c);
    } else {
      serve(c);
    }
  }
  return all_done;
}

void OperatorGathers::finish_rounds() {
  while (!round({}, /*done=*/true)) {
  }
}

// Materialises the full chunk where operators read it (the device; on CUDA
// with Gloo, host first, since Gloo moves host memory) and all-gathers every
// rank's shard into it.
void OperatorGathers::start(ChunkId c) {
  memory::ChunkManager& mgr = *ctx_.mgr;
  const ChunkId shard = *mgr.family(mgr.chunk(c).family()).param_shard;
  // Gloo on a GPU machine reads host memory only: the chunk is gathered there first.
  const bool host_only = mgr.device().kind() == offload::DeviceKind::kCuda && ctx_.comm_tier() == Tier::kHost;
  const Tier where = host_only ? Tier::kHost : Tier::kDevice;
  ctx_.pin(shard, ctx_.comm_tier(), {0});
  try {
    ctx_.pin(c, where, ctx_.all_slots(c));
  } catch (...) {
    ctx_.unpin(shard, {0});
    throw;
  }
  Gather g;
  g.shard = shard;
  try {
    g.work = comm_->all_gather(mgr.data(shard), mgr.data(c), static_cast<size_t>(mgr.chunk(shard).capacity_elems()),
                               ctx_.options.precision);
  } catch (...) {
    ctx_.unpin(c, ctx_.all_slots(c));
    ctx_.unpin(shard, {0});
    throw;
  }
  gathered_.emplace_back(c, std::move(g));
  gathers_ += 1;
}

// Another rank wants chunk `c`, this one does not (now): it sends its shard
// and takes the others' into a transient host buffer, outside the budgets
// (it lives for one collective).
void OperatorGathers::serve(ChunkId c) {
  memory::ChunkManager& mgr = *ctx_.mgr;
  const ChunkId shard = *mgr.family(mgr.chunk(c).family()).param_shard;
  ctx_.with_on(ctx_.comm_tier(), {shard}, [&] {
    const size_t elems = static_cast<size_t>(mgr.chunk(shard).capacity_elems());
    std::vector<char> scratch(elems * static_cast<size_t>(ctx_.world()) * dtype_size(ctx_.options.precision));
    comm_->all_gather(mgr.data(shard), scratch.data(), elems, ctx_.options.precision)->wait();
  });
  served_ += 1;
}

void OperatorGathers::finish(Gather& g, ChunkId c) {
  if (!g.work) return;
  WorkHandle work = std::move(g.work);
  g.work = nullptr;
  std::exception_ptr failure;
  try {
    work->wait();
  } catch (...) {
    failure = std::current_exception();
  }
  ctx_.unpin(c, ctx_.all_slots(c));
  ctx_.unpin(g.shard, {0});
  if (failure) std::rethrow_exception(failure);
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
  ctx_.pin(fam.param, ctx_.comm_tier(), ctx_.all_slots(fam.param));
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

bool StepGathers::settle_oldest() {
  if (in_flight_.empty()) return false;
  finish(in_flight_.size() - 1);
  return true;
}

}  // namespace strata::parallel
