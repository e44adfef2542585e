#include "engine/trace_recorder.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "../test_util.h"
#include "component_fixture.h"

namespace strata::parallel {
namespace {

TEST(TraceRecorder, RecordsOperatorsAndTheirMovesThenWritesAfterTheWantedSteps) {
  EngineOptions o = component_options(4);
  o.trace_path = temp_path("trace-recorder", ".json");
  o.trace_steps = 1;
  ComponentContext t(o, {kChunkElems, kChunkElems});
  FixedCounter counter;
  counter.live = 12345;
  TraceRecorder recorder(t.ctx, counter);
  EXPECT_EQ(recorder.path(), o.trace_path);
  EXPECT_EQ(recorder.trace().chunks.size(), t.ctx.mgr->num_chunks());
  EXPECT_FALSE(recorder.recording());

  recorder.begin_step();
  ASSERT_TRUE(recorder.recording());
  recorder.begin_op("aten::mm", {0, 1, 0});
  t.residency.pin_operator({0});
  t.residency.unpin_operator({0});
  recorder.end_op();
  recorder.set_phase("optimizer");
  recorder.begin_op("strata::optimizer_step", {});
  recorder.end_op();
  recorder.end_step();
  EXPECT_FALSE(recorder.recording());
  ASSERT_TRUE(recorder.done());

  const memory::Trace trace = memory::read_trace(o.trace_path);
  ASSERT_EQ(trace.steps.size(), 1u);
  EXPECT_EQ(trace.steps[0].end_op - trace.steps[0].first_op, 2);
  ASSERT_EQ(trace.ops.size(), 2u);
  const memory::TraceOp& mm = trace.ops[0];
  EXPECT_EQ(mm.name, "aten::mm");
  EXPECT_EQ(mm.phase, "forward");
  ASSERT_EQ(mm.chunks.size(), 2u);  // distinct chunks, where they were when it began
  EXPECT_EQ(mm.chunks[0].chunk, t.chunk_of(0));
  EXPECT_EQ(mm.chunks[0].tier, "host");
  ASSERT_EQ(mm.moves.size(), 1u);
  EXPECT_EQ(mm.moves[0].from, "host");
  EXPECT_EQ(mm.moves[0].to, "device");
  EXPECT_EQ(mm.moves[0].bytes, kChunkBytes);
  EXPECT_EQ(mm.moves[0].demand_bytes, kChunkBytes);
  EXPECT_EQ(mm.model_bytes[0], kChunkBytes);
  EXPECT_EQ(mm.non_model_bytes, 12345u);
  EXPECT_EQ(trace.ops[1].phase, "optimizer");
  EXPECT_TRUE(trace.ops[1].moves.empty());
  EXPECT_EQ(trace.budgets[0], 4 * kChunkBytes);

  recorder.begin_step();  // done: nothing more is recorded
  EXPECT_FALSE(recorder.recording());
  std::filesystem::remove(o.trace_path);
}

TEST(TraceRecorder, EachRankWritesAFileOfItsOwn) {
  EngineOptions o = component_options(4);
  o.trace_path = "/some/dir/run.json";
  ComponentContext t(o, {kChunkElems});
  FixedCounter counter;
  t.ctx.rank = 3;
  EXPECT_EQ(TraceRecorder(t.ctx, counter).path(), "/some/dir/run.rank3.json");
  t.ctx.rank = 0;
  EXPECT_EQ(TraceRecorder(t.ctx, counter).path(), "/some/dir/run.json");
}

}  // namespace
}  // namespace strata::parallel
