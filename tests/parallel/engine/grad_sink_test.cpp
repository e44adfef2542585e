#include "engine/grad_sink.h"

#include <gtest/gtest.h>

#include "component_fixture.h"

namespace strata::parallel {
namespace {

TEST(GradSink, AddsGradientsIntoTheirSlotsAndZeroDropsTheChunks) {
  ComponentContext t(component_options(4), {kChunkElems, 300, 200});
  GradSink sink(t.ctx, nullptr);
  const torch::Tensor g1 = torch::randn({300}), g2 = torch::randn({300});
  sink.accumulate(1, g1);
  sink.accumulate(1, g2.reshape({3, 100}));  // any shape of the same numel
  EXPECT_TRUE(torch::equal(t.grad(1), g1 + g2));
  EXPECT_TRUE(t.ctx.params[1].has_grad);
  EXPECT_FALSE(t.ctx.params[2].has_grad);
  EXPECT_TRUE(torch::equal(t.grad(2), torch::zeros({200})));  // its neighbour in the chunk is untouched

  sink.zero();
  const ChunkId gc = t.ctx.mgr->family(t.ctx.params[1].family).grad;
  EXPECT_FALSE(t.ctx.mgr->chunk(gc).location().has_value());
  EXPECT_FALSE(t.ctx.params[1].has_grad);
  EXPECT_TRUE(torch::equal(t.grad(1), torch::zeros({300})));  // materialised again, zero-filled
}

TEST(GradSink, AccumulatesInTheComputePrecision) {
  EngineOptions o = component_options(4);
  o.precision = DType::kBFloat16;
  ComponentContext t(o, {kChunkElems});
  GradSink sink(t.ctx, nullptr);
  const torch::Tensor g1 = torch::randn({kChunkElems}), g2 = torch::randn({kChunkElems}) * 1e-3;
  sink.accumulate(0, g1);
  sink.accumulate(0, g2);
  const torch::Tensor expected =
      torch::zeros({kChunkElems}, torch::kBFloat16).add_(g1.to(torch::kBFloat16)).add_(g2.to(torch::kBFloat16));
  EXPECT_TRUE(torch::equal(t.grad(0), expected.to(torch::kFloat32)));
  EXPECT_FALSE(torch::equal(t.grad(0), g1 + g2));  // really rounded to bf16
}

TEST(GradSink, InstalledHooksTakeAutogradsGradientsUntilUninstalled) {
  ComponentContext t(component_options(4), {kChunkElems});
  GradSink sink(t.ctx, nullptr);
  sink.install();
  const torch::Tensor& w = t.ctx.params[0].tensor;
  t.residency.pin_operator({0});  // the storage points into the chunk while it computes
  (w * 3.0f).sum().backward();
  t.residency.unpin_operator({0});
  EXPECT_FALSE(w.grad().defined());  // never stored twice
  EXPECT_TRUE(torch::equal(t.grad(0), torch::full({kChunkElems}, 3.0f)));

  sink.uninstall();
  EXPECT_EQ(t.ctx.params[0].accumulator, nullptr);
  t.residency.pin_operator({0});
  (w * 2.0f).sum().backward();
  t.residency.unpin_operator({0});
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(torch::equal(w.grad(), torch::full({kChunkElems}, 2.0f)));
  EXPECT_TRUE(torch::equal(t.grad(0), torch::full({kChunkElems}, 3.0f)));
}

}  // namespace
}  // namespace strata::parallel
