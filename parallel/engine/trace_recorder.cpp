#include "trace_recorder.h"

#include <algorithm>
#include <filesystem>

#include "strata/core/log.h"
#include "strata/parallel/activation_checkpoint.h"

namespace strata::parallel {

TraceRecorder::TraceRecorder(const EngineContext& ctx, NonModelCounter& counter) : ctx_(ctx), counter_(counter) {
  const EngineOptions& options = ctx.options;
  // One file per pipeline stage and per data-parallel rank: <stem>[.stage<S>][.rank<R>]<extension>.
  std::string suffix;
  if (options.pipeline_group != nullptr && options.pipeline_group->world_size() > 1) {
    suffix += ".stage" + std::to_string(options.pipeline_group->rank());
  }
  if (ctx.rank > 0) suffix += ".rank" + std::to_string(ctx.rank);
  const std::filesystem::path given(options.trace_path);
  path_ = suffix.empty() ? options.trace_path
                         : (given.parent_path() / (given.stem().string() + suffix + given.extension().string())).string();
  trace_.device = ctx.mgr->device().name();
  trace_.non_model_source = counter.source();
  trace_.policy = options.policy;
  trace_.prefetch = options.prefetch;
  trace_.nvme_optim_fraction = options.nvme_optim_fraction;
  for (int t = 0; t < memory::kNumTiers; ++t) trace_.budgets[t] = options.budgets.of(static_cast<Tier>(t));
  for (size_t id = 0; id < ctx.mgr->num_chunks(); ++id) {
    const memory::Chunk& c = ctx.mgr->chunk(static_cast<ChunkId>(id));
    trace_.chunks.push_back({c.id(), c.family(), memory::chunk_role_name(c.role()), dtype_name(c.dtype()),
                             c.alloc_bytes(), c.capacity_elems(), c.layout().used_elems});
  }
  for (const ManagedParam& p : ctx.params) trace_.params.push_back(p.name);
  t0_ = Clock::now();
}

void TraceRecorder::begin_step() {
  if (done_) return;
  recording_ = true;
  phase_ = "forward";
  step_first_op_ = static_cast<int64_t>(trace_.ops.size());
  step_t0_ = Clock::now();
  last_ = ctx_.mgr->move_stats();
}

void TraceRecorder::end_step() {
  if (!recording_) return;
  recording_ = false;
  memory::TraceStep st;
  st.index = static_cast<int>(trace_.steps.size());
  st.first_op = step_first_op_;
  st.end_op = static_cast<int64_t>(trace_.ops.size());
  st.seconds = since(step_t0_);
  trace_.steps.push_back(st);
  if (static_cast<int>(trace_.steps.size()) >= ctx_.options.trace_steps) {
    done_ = true;
    memory::write_trace(trace_, path_);
    STRATA_LOG(kInfo, "wrote the memory trace of {} steps ({} operators) to {}", trace_.steps.size(),
               trace_.ops.size(), path_);
  }
}

void TraceRecorder::begin_op(const std::string& name, const std::vector<int64_t>& ids) {
  std::vector<memory::TraceTouch> touches;
  for (int64_t id : ids) {
    const ChunkId c = ctx_.param_chunk(ctx_.params[static_cast<size_t>(id)]);
    if (std::any_of(touches.begin(), touches.end(), [&](const auto& t) { return t.chunk == c; })) continue;
    const auto where = ctx_.mgr->chunk(c).location();
    touches.push_back({c, where ? memory::tier_name(*where) : "none"});
  }
  std::lock_guard<std::mutex> lock(mu_);
  current_ = memory::TraceOp{};
  current_.index = static_cast<int64_t>(trace_.ops.size());
  current_.step = static_cast<int>(trace_.steps.size());
  current_.name = name;
  current_.phase = recomputing() ? "recompute" : phase_;  // Note [Recomputing in backward]
  current_.start = since(t0_);
  current_.chunks = std::move(touches);
  current_.params = ids;
  counter_.reset_peak();
  op_t0_ = Clock::now();
}

void TraceRecorder::end_op() {
  std::lock_guard<std::mutex> lock(mu_);
  const memory::ChunkManager& mgr = *ctx_.mgr;
  current_.seconds = since(op_t0_);
  for (int t = 0; t < memory::kNumTiers; ++t) current_.model_bytes[t] = mgr.tier_stats(static_cast<Tier>(t)).used;
  current_.non_model_bytes = counter_.current();
  current_.non_model_peak = std::max(counter_.peak(), current_.non_model_bytes);
  const memory::MoveStats now = mgr.move_stats();
  for (int a = 0; a < memory::kNumTiers; ++a) {
    for (int b = 0; b < memory::kNumTiers; ++b) {
      const uint64_t bytes = now.bytes[a][b] - last_.bytes[a][b];
      const uint64_t count = now.count[a][b] - last_.count[a][b];
      const char* from = memory::tier_name(static_cast<Tier>(a));
      const char* to = memory::tier_name(static_cast<Tier>(b));
      if (count > 0) current_.moves.push_back({from, to, bytes, count, now.demand_bytes[a][b] - last_.demand_bytes[a][b]});
      const uint64_t started = now.started_count[a][b] - last_.started_count[a][b];
      if (started > 0) {
        current_.started.push_back({from, to, now.started_bytes[a][b] - last_.started_bytes[a][b], started, 0});
      }
    }
  }
  current_.stall_seconds = now.stall_seconds - last_.stall_seconds;
  current_.stall_bytes = now.stall_bytes - last_.stall_bytes;
  last_ = now;
  trace_.ops.push_back(std::move(current_));
}

}  // namespace strata::parallel
