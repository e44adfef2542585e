#include "engine/residency.h"

#include <gtest/gtest.h>

#include "../../error_of.h"
#include "component_fixture.h"

namespace strata::parallel {
namespace {

// One operator as the engine runs it: working set, prepare, pin, prefetch, unpin.
void run_op(ComponentContext& t, const std::vector<int64_t>& ids, const std::string& name = "aten::test") {
  uint64_t needed = 0;
  const std::vector<ChunkId> chunks = t.residency.chunks_of(ids, needed);
  t.residency.prepare(name, t.ctx.params[static_cast<size_t>(ids.front())].name, chunks, needed);
  t.residency.pin_operator(ids);
  t.residency.prefetch_next();
  t.residency.unpin_operator(ids);
}

TEST(Residency, PinsAnOperatorsChunksOnTheDeviceAndStoragesFollowThem) {
  ComponentContext t(component_options(2), {kChunkElems, kChunkElems, kChunkElems});
  memory::ChunkManager& mgr = *t.ctx.mgr;
  const ChunkId c0 = t.chunk_of(0);
  ASSERT_NE(c0, t.chunk_of(1));
  // On host: on the emulated device the host tier is addressable too (Note [Parameters between steps]).
  ASSERT_TRUE(mgr.chunk(c0).resident_on(Tier::kHost));
  EXPECT_EQ(t.ctx.params[0].tensor.storage().data(), mgr.data(c0));

  t.residency.pin_operator({0});
  EXPECT_TRUE(mgr.chunk(c0).resident_on(Tier::kDevice));
  EXPECT_FALSE(mgr.chunk(c0).movable());  // COMPUTE
  EXPECT_EQ(t.ctx.params[0].tensor.data_ptr(), mgr.data(c0));
  EXPECT_TRUE(torch::equal(t.ctx.params[0].tensor.detach(), t.initial[0]));
  t.residency.unpin_operator({0});
  EXPECT_TRUE(mgr.chunk(c0).movable());

  // Two more operators on a two-chunk device: the least recent chunk leaves, its storage with it.
  run_op(t, {1});
  run_op(t, {2});
  EXPECT_FALSE(mgr.chunk(c0).resident_on(Tier::kDevice));
  ASSERT_TRUE(mgr.chunk(c0).resident_on(Tier::kHost));
  EXPECT_EQ(t.ctx.params[0].tensor.storage().data(), mgr.data(c0));  // followed it back to host
  EXPECT_LE(mgr.tier_stats(Tier::kDevice).used, mgr.tier_stats(Tier::kDevice).budget);
  EXPECT_GT(t.ctx.wait.operators, 0.0);
}

TEST(Residency, RefusesAnOperatorLargerThanTheDeviceBudget) {
  ComponentContext t(component_options(1), {kChunkElems, kChunkElems});
  uint64_t needed = 0;
  const std::vector<ChunkId> chunks = t.residency.chunks_of({0, 1, 0}, needed);
  EXPECT_EQ(chunks.size(), 2u);
  EXPECT_EQ(needed, 2 * kChunkBytes);
  const std::string e = error_of([&] { t.residency.prepare("aten::cat", "p0", chunks, needed); });
  EXPECT_NE(e.find("aten::cat on parameter 'p0' needs 8.00 KiB"), std::string::npos) << e;
  EXPECT_NE(e.find("raise the device budget or lower the chunk size"), std::string::npos) << e;
}

TEST(Residency, PlansTheFirstStepPrefetchesByItAndReplansWhenTheSequenceChanges) {
  ComponentContext t(component_options(3, "auto"), {kChunkElems, kChunkElems, kChunkElems});
  memory::ChunkManager& mgr = *t.ctx.mgr;
  const auto host_to_device = [&] { return mgr.move_stats().started_count[1][0]; };
  ASSERT_EQ(static_cast<int>(Tier::kDevice), 0);
  ASSERT_EQ(static_cast<int>(Tier::kHost), 1);

  t.residency.begin_step();  // the planning step: every chunk moves when its operator needs it
  const uint64_t before = host_to_device();
  run_op(t, {0});
  EXPECT_EQ(host_to_device() - before, 1u);
  run_op(t, {1});
  run_op(t, {2});
  t.residency.end_step();
  EXPECT_EQ(t.residency.replans(), 0);

  for (size_t i = 0; i < 3; ++i) mgr.move(t.chunk_of(i), Tier::kHost);
  t.residency.begin_step();  // follows the plan: after operator 0, operators 1 and 2's chunks are prefetched
  const uint64_t demand = mgr.move_stats().demand_bytes[1][0];
  run_op(t, {0});
  t.residency.end_step();  // waits for the prefetches; a step shorter than the plan re-plans
  EXPECT_EQ(mgr.move_stats().demand_bytes[1][0] - demand, kChunkBytes);  // operator 0's own chunk
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(mgr.chunk(t.chunk_of(i)).resident_on(Tier::kDevice)) << i;
  EXPECT_EQ(t.residency.replans(), 1);

  t.residency.begin_step();  // records the plan again
  for (int64_t i = 0; i < 3; ++i) run_op(t, {i});
  t.residency.end_step();
  EXPECT_EQ(t.residency.replans(), 1);

  t.residency.begin_step();  // another sequence: the plan is dropped and recorded again
  run_op(t, {2});
  run_op(t, {0});
  t.residency.end_step();
  EXPECT_EQ(t.residency.replans(), 2);
}

TEST(Residency, DeviceCapacityBudgetsChunksAroundLiveActivations) {
  EngineOptions o = component_options(10);
  o.device_capacity = 10 * kChunkBytes;
  o.device_safety_ratio = 1.0;
  ComponentContext t(o, {kChunkElems, kChunkElems, kChunkElems});
  FixedCounter counter;
  t.residency.enable_capacity(counter);
  EXPECT_TRUE(t.residency.capacity_enabled());

  counter.live = 6 * kChunkBytes;  // leaves four chunks' room
  run_op(t, {0});
  EXPECT_EQ(t.ctx.mgr->tier_stats(Tier::kDevice).budget, 4 * kChunkBytes);
  EXPECT_EQ(t.residency.capacity_floor(), 4 * kChunkBytes);

  run_op(t, {1});
  run_op(t, {2});
  EXPECT_EQ(t.ctx.mgr->tier_stats(Tier::kDevice).used, 3 * kChunkBytes);
  // Activations grow between operators: chunks make room before the next operator.
  counter.live = 8 * kChunkBytes + 1;
  t.residency.relieve_capacity();
  EXPECT_LE(t.ctx.mgr->tier_stats(Tier::kDevice).used, 2 * kChunkBytes - 1);
  EXPECT_LT(t.residency.capacity_floor(), 2 * kChunkBytes);

  counter.live = 9 * kChunkBytes + 1;  // not even one chunk fits beside them
  uint64_t needed = 0;
  const std::vector<ChunkId> chunks = t.residency.chunks_of({0}, needed);
  const std::string e = error_of([&] { t.residency.prepare("aten::mm", "p0", chunks, needed); });
  EXPECT_NE(e.find("raise device_capacity or lower the batch"), std::string::npos) << e;
}

TEST(Residency, StaticPlacementReturnsStreamedChunksBeforeTheNextOperator) {
  EngineOptions o = component_options(3, "static");
  o.static_param_fraction = 0.34;  // the first of three chunks is held
  ComponentContext t(o, {kChunkElems, kChunkElems, kChunkElems});
  memory::ChunkManager& mgr = *t.ctx.mgr;
  run_op(t, {0});
  run_op(t, {1});
  EXPECT_TRUE(mgr.chunk(t.chunk_of(1)).resident_on(Tier::kDevice));
  run_op(t, {0});  // p1's chunk is streamed: it goes back before this operator
  EXPECT_TRUE(mgr.chunk(t.chunk_of(1)).resident_on(Tier::kHost));
  EXPECT_TRUE(mgr.chunk(t.chunk_of(0)).resident_on(Tier::kDevice));
  run_op(t, {2});
  run_op(t, {1});  // the held chunk stays through other operators
  EXPECT_TRUE(mgr.chunk(t.chunk_of(0)).resident_on(Tier::kDevice));
  EXPECT_TRUE(mgr.chunk(t.chunk_of(2)).resident_on(Tier::kHost));
}

}  // namespace
}  // namespace strata::parallel
