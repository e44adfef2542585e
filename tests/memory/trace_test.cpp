// The trace format (JSON round trip, the errors a reader gives, atomic
// writes) and the simulator: its figures for known sequences, and its
// victims against a real chunk manager's.
#include "strata/memory/trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "error_of.h"
#include "memory/sample_trace.h"
#include "strata/core/error.h"
#include "strata/memory/chunk_manager.h"
#include "strata/memory/eviction_policy.h"
#include "strata/offload/device_memory.h"

namespace strata::memory {
namespace {

Trace sample() { return testing::sample_trace(); }

TEST(Trace, JsonRoundTrip) {
  const Trace t = sample();
  const Trace r = trace_from_json(trace_to_json(t));
  EXPECT_EQ(trace_to_json(r), trace_to_json(t));
  ASSERT_EQ(r.ops.size(), 2u);
  EXPECT_EQ(r.ops[1].moves[1].bytes, 8192u);
  EXPECT_EQ(r.ops[1].moves[1].demand_bytes, 4096u);
  EXPECT_EQ(r.ops[0].started[0].count, 1u);
  EXPECT_EQ(r.chunks[1].dtype, "bf16");
  EXPECT_EQ(r.budgets[0], 4096u);
}

TEST(Trace, ReaderErrorsSayWhatIsWrong) {
  const std::string text = trace_to_json(sample());
  auto message = [](const std::string& s) {
    try {
      trace_from_json(s);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(text.substr(0, text.size() / 2)).find("cut short"), std::string::npos);
  EXPECT_NE(message("{\"format\": \"other\"}").find("not a strata trace"), std::string::npos);
  std::string v2 = text;
  v2.replace(v2.find("\"version\": 2"), 12, "\"version\": 3");
  EXPECT_NE(message(v2).find("trace version 3"), std::string::npos);
  std::string missing = text;
  missing.replace(missing.find("\"stall_seconds\""), 15, "\"stall_secs\"");
  EXPECT_NE(message(missing).find("malformed"), std::string::npos);
}

TEST(Trace, WriteIsAtomicAndReadBack) {
  const auto dir = std::filesystem::temp_directory_path() / ("strata-trace-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "t.json").string();
  write_trace(sample(), path);
  EXPECT_EQ(trace_to_json(read_trace(path)), trace_to_json(sample()));
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u) << "no temporary file left behind";
  EXPECT_THROW(write_trace(sample(), (dir / "missing" / "t.json").string()), Error);
  EXPECT_THROW(read_trace((dir / "none.json").string()), Error);
  std::filesystem::remove_all(dir);
}


// Three 4 KiB parameter chunks in three families, used forward 0 1 2 and
// backward 2 1 0, each operator taking 2 s of compute, then the optimizer.
Trace three_chunks() {
  Trace t;
  t.device = "test";
  t.non_model_source = "test";
  t.policy = "lru";
  t.budgets = {8192, 1 << 20, 0};
  for (int f = 0; f < 3; ++f) {
    const int64_t base = 4 * f;
    t.chunks.push_back({base, f, "param", "fp32", 4096, 1024, 1024});
    t.chunks.push_back({base + 1, f, "grad", "fp32", 4096, 1024, 1024});
    t.chunks.push_back({base + 2, f, "optim", "fp32", 4096, 1024, 1024});
    t.chunks.push_back({base + 3, f, "optim", "fp32", 4096, 1024, 1024});
  }
  const int64_t order[] = {0, 4, 8, 8, 4, 0};
  for (int i = 0; i < 6; ++i) {
    TraceOp op;
    op.index = i;
    op.name = "aten::mm";
    op.phase = i < 3 ? "forward" : "backward";
    op.seconds = 2.0;
    op.chunks = {{order[i], "host"}};
    t.ops.push_back(op);
  }
  TraceOp step;
  step.index = 6;
  step.name = "strata::optimizer_step";
  step.phase = "optimizer";
  step.seconds = 3.0;
  t.ops.push_back(step);
  t.steps.push_back({0, 0, 7, 15.0});
  return t;
}

TEST(Simulate, PoliciesCountTheMovesOfAKnownSequence) {
  const Trace t = three_chunks();
  SimulateOptions so;
  so.device_budget = 8192;
  for (const char* policy : {"lru", "auto"}) {
    so.policy = policy;
    const SimulateResult r = simulate_trace(t, so);
    ASSERT_TRUE(r.fits);
    // 0 1 | 2 evicts 0 | 2 1 hit | 0 evicts 2 | the step takes 1 and 0 home.
    EXPECT_EQ(r.h2d_bytes, 4u * 4096) << policy;
    EXPECT_EQ(r.d2h_bytes, 4u * 4096) << policy;
  }
  // Static with no room to hold anything streams every chunk: each goes home
  // before the next operator that does not use it.
  so.policy = "static";
  SimulateResult r = simulate_trace(t, so);
  EXPECT_EQ(r.h2d_bytes, 5u * 4096);
  EXPECT_EQ(r.d2h_bytes, 5u * 4096);
  // With 12 KiB it holds chunk 0 (room after two streamed chunks), so 0 stays.
  so.device_budget = 12288;
  r = simulate_trace(t, so);
  EXPECT_EQ(r.h2d_bytes, 4u * 4096);
  // A budget below an operator's chunks does not fit.
  so.device_budget = 2048;
  r = simulate_trace(t, so);
  EXPECT_FALSE(r.fits);
  EXPECT_NE(r.why.find("needs 4.00 KiB"), std::string::npos) << r.why;
}

TEST(Simulate, PrefetchHidesCopiesBehindCompute) {
  const Trace t = three_chunks();
  SimulateOptions so;
  so.device_budget = 12288;
  so.policy = "auto";
  so.h2d_bytes_per_s = 4096;  // a second per chunk
  so.prefetch = false;
  const SimulateResult off = simulate_trace(t, so);
  EXPECT_DOUBLE_EQ(off.device_stall_seconds, 3.0) << "three loads, each waited for";
  EXPECT_EQ(off.prefetched_bytes, 0u);
  so.prefetch = true;
  const SimulateResult on = simulate_trace(t, so);
  // Chunk 0 on demand (1 s); 1 and 2 are loaded behind operator 0's 2 s:
  // 1 is ready at 4 s, a second after operator 1 could start; 2 is ready in time.
  EXPECT_DOUBLE_EQ(on.device_stall_seconds, 2.0);
  EXPECT_EQ(on.prefetched_bytes, 8192u);
  EXPECT_EQ(on.h2d_bytes, off.h2d_bytes);
  EXPECT_DOUBLE_EQ(on.compute_seconds, 15.0);
  EXPECT_DOUBLE_EQ(on.step_seconds, 17.0);
}

TEST(Simulate, NvmeHomedStateAndHostSpillPerStep) {
  Trace t = three_chunks();
  t.budgets[2] = 1 << 20;
  t.nvme_optim_fraction = 1.0 / 3;  // the last family
  SimulateOptions so;
  so.device_budget = 12288;
  so.host_budget = 1 << 20;
  SimulateResult r = simulate_trace(t, so);
  EXPECT_EQ(r.nvme_optim_families, 1u);
  EXPECT_EQ(r.nvme_read_bytes, 8192u);
  EXPECT_EQ(r.nvme_write_bytes, 8192u);
  EXPECT_EQ(r.host_spill_bytes, 0u);
  // Host holds 3 parameter, 3 gradient and 2 families' optimizer chunks (40
  // KiB) and the NVMe family in flight (8 KiB): at 44 KiB, 4 KiB spills.
  so.host_budget = 45056;
  r = simulate_trace(t, so);
  EXPECT_EQ(r.host_spill_bytes, 4096u);
  EXPECT_EQ(r.nvme_read_bytes, 8192u + 4096u);
  // Auto placement (-1) keeps state on host while it fits in half the host budget.
  t.nvme_optim_fraction = -1;
  so.host_budget = 32768;  // half is 16 KiB: two families' state
  r = simulate_trace(t, so);
  EXPECT_EQ(r.nvme_optim_families, 1u);
  // Without prefetch every read is a stall: 8 KiB + spill at 1 KiB/s.
  so.nvme_read_bytes_per_s = 1024;
  so.nvme_write_bytes_per_s = 1e12;
  so.prefetch = false;
  r = simulate_trace(t, so);
  const double reads = static_cast<double>(r.nvme_read_bytes) / 1024;
  EXPECT_DOUBLE_EQ(r.nvme_stall_seconds, reads);
  so.prefetch = true;
  EXPECT_LT(simulate_trace(t, so).nvme_stall_seconds, reads) << "reads overlap backward and the updates";
}

// Note [Replaying a trace]: the simulator chooses its victims with the policy
// object the engine uses, among the chunks the chunk manager would offer. Two
// steps of a model with six parameter chunks of three sizes (forward, an
// output operator on the first two layers' chunks, backward in reverse, then
// the optimizer taking every chunk home) replay through a real ChunkManager,
// the operator's chunks pinned in COMPUTE one after another as the engine
// pins them (static placement returning the streamed ones first, as the
// engine's residency does), and through simulate_trace: the same chunks
// leave the device in the same order, for every policy and for budgets from
// tight to roomy. (A simulator that offered the operator's pinned chunks as
// victims, or did not count a hit as a use, fails it.)
TEST(Simulate, EvictsWhatTheChunkManagerEvicts) {
  for (const PolicyKind kind : {PolicyKind::kLru, PolicyKind::kAuto, PolicyKind::kStatic}) {
    for (const uint64_t budget : {uint64_t{16384}, uint64_t{24576}, uint64_t{36864}}) {
      SCOPED_TRACE(std::string(policy_name(kind)) + " at " + std::to_string(budget) + " bytes");
      ChunkManagerOptions mo;
      mo.budgets = {budget, 1 << 20, 0};
      mo.device = offload::make_emulated_device_memory();
      mo.policy = make_policy(kind);
      auto* const planner = dynamic_cast<TracePolicy*>(mo.policy.get());
      auto* const placement = dynamic_cast<StaticPolicy*>(mo.policy.get());
      ChunkManager mgr(std::move(mo));
      std::vector<ChunkId> chunks;  // the parameter chunks, in registration (forward) order
      for (const int64_t elems : {1024, 2048, 3072, 1024, 2048, 3072}) {
        const Registration reg = mgr.register_tensors({{"t" + std::to_string(chunks.size()), elems}}, FamilySpec{},
                                                      elems);
        chunks.push_back(mgr.family(reg.families.at(0)).param);
        mgr.access(chunks.back(), Tier::kHost);  // a trained model's chunks start on host
        mgr.transition(chunks.back(), 0, TensorState::kHold);
      }
      Trace t;
      t.policy = policy_name(kind);
      t.budgets = {budget, 1 << 20, 0};
      std::vector<std::pair<ChunkId, uint64_t>> params;
      for (size_t i = 0; i < chunks.size(); ++i) {
        const uint64_t bytes = mgr.chunk(chunks[i]).alloc_bytes();
        t.chunks.push_back({chunks[i], static_cast<int32_t>(i), "param", "fp32", bytes, 0, 0});
        params.emplace_back(chunks[i], bytes);
      }
      if (placement != nullptr) placement->set_held(static_held_chunks(params, -1.0, budget));
      std::vector<std::vector<ChunkId>> step;
      for (size_t i = 0; i < chunks.size(); ++i) step.push_back({chunks[i]});
      step.push_back({chunks[0], chunks[1]});  // an output layer on the first two layers' parameters (tied)
      for (size_t i = chunks.size(); i-- > 0;) step.push_back({chunks[i]});
      for (int s = 0; s < 2; ++s) {
        const int64_t first = static_cast<int64_t>(t.ops.size());
        for (size_t k = 0; k < step.size(); ++k) {
          TraceOp op;
          op.index = static_cast<int64_t>(t.ops.size());
          op.step = s;
          op.name = "aten::mm";
          op.phase = k < chunks.size() + 1 ? "forward" : "backward";
          op.seconds = 1.0;
          for (ChunkId c : step[k]) op.chunks.push_back({c, "host"});
          t.ops.push_back(op);
        }
        TraceOp opt;
        opt.index = static_cast<int64_t>(t.ops.size());
        opt.step = s;
        opt.name = "strata::optimizer_step";
        opt.phase = "optimizer";
        t.ops.push_back(opt);
        t.steps.push_back({s, first, static_cast<int64_t>(t.ops.size()), 0.0});
      }
      if (planner != nullptr) {
        std::vector<std::vector<ChunkId>> plan;
        for (int s = 0; s < 2; ++s) plan.insert(plan.end(), step.begin(), step.end());
        planner->set_plan(plan);
      }

      // The chunk manager: each eviction is a device -> host placement not asked for.
      std::vector<std::pair<int64_t, int64_t>> evicted;
      int64_t current = -1;
      bool homing = false;
      mgr.set_placement_listener([&](const Chunk& c, std::optional<Tier> tier, void*) {
        if (!homing && tier == Tier::kHost) evicted.emplace_back(current, c.id());
      });
      int64_t k = 0;
      std::vector<ChunkId> streamed;  // static: the last operator's chunks that are not held
      for (const TraceOp& op : t.ops) {
        current = op.index;
        if (op.phase == "optimizer") {
          homing = true;
          for (ChunkId c : chunks) {
            if (mgr.chunk(c).resident_on(Tier::kDevice)) mgr.move(c, Tier::kHost);
          }
          homing = false;
          streamed.clear();
          continue;
        }
        if (planner != nullptr) planner->set_cursor(k++);
        if (placement != nullptr) {  // Residency::return_streamed: the last operator's streamed chunks go home
          homing = true;
          for (ChunkId c : streamed) {
            const bool used = std::any_of(op.chunks.begin(), op.chunks.end(), [&](const TraceTouch& t) {
              return t.chunk == c;
            });
            if (!used && mgr.chunk(c).resident_on(Tier::kDevice)) mgr.move(c, Tier::kHost);
          }
          homing = false;
          streamed.clear();
          for (const TraceTouch& t : op.chunks) {
            if (!placement->held(static_cast<ChunkId>(t.chunk))) streamed.push_back(static_cast<ChunkId>(t.chunk));
          }
        }
        for (const TraceTouch& touch : op.chunks) {
          const ChunkId c = static_cast<ChunkId>(touch.chunk);
          mgr.access(c, Tier::kDevice);
          mgr.transition(c, 0, TensorState::kCompute);
        }
        for (const TraceTouch& touch : op.chunks) mgr.transition(static_cast<ChunkId>(touch.chunk), 0,
                                                                 TensorState::kHold);
      }

      SimulateOptions so;
      so.device_budget = budget;
      so.policy = policy_name(kind);
      so.static_param_fraction = -1.0;
      so.prefetch = false;  // the replay above moves nothing ahead
      so.record_evictions = true;
      const SimulateResult r = simulate_trace(t, so);
      ASSERT_TRUE(r.fits) << r.why;
      EXPECT_EQ(r.evicted, evicted);
      EXPECT_EQ(r.evictions, mgr.tier_stats(Tier::kDevice).evictions);
      EXPECT_EQ(r.h2d_bytes, mgr.move_stats().bytes[1][0] + mgr.move_stats().bytes[2][0]);
      if (budget == 16384 && kind != PolicyKind::kStatic) {  // static streams instead: it returns chunks itself
        EXPECT_GT(r.evictions, 0u) << "the tight budget must evict";
      }
    }
  }
}

}  // namespace
}  // namespace strata::memory
