#include "engine/step_pipeline.h"

#include <gtest/gtest.h>

#include "../test_util.h"
#include "component_fixture.h"
#include "engine/grad_sink.h"

namespace strata::parallel {
namespace {

// The same parameters as `t`'s initial values, trained by torch::optim::AdamW.
struct Reference {
  explicit Reference(const ComponentContext& t, const OptimizerConfig& cfg) {
    for (const torch::Tensor& v : t.initial) params.push_back(v.clone().requires_grad_());
    opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(cfg.lr)
                                                            .betas({cfg.beta1, cfg.beta2})
                                                            .eps(cfg.eps)
                                                            .weight_decay(cfg.weight_decay));
  }
  std::vector<torch::Tensor> params;
  std::unique_ptr<torch::optim::AdamW> opt;
};

double rel_l2(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).norm() / b.norm()).item<double>();
}

TEST(StepPipeline, MatchesTorchAdamWWithAccumulationAndClipping) {
  EngineOptions o = component_options(2);
  o.grad_accumulation = 2;
  o.clip_norm = 0.05;
  ComponentContext t(o, {kChunkElems, 700, 300, 24});
  t.ctx.optimizer = OptimizerConfig::adamw(1e-2, 0.1, 0.9, 0.99, 1e-8);
  assign_groups(t.ctx);
  GradSink sink(t.ctx, nullptr);
  StepPipeline pipeline(t.ctx, sink, nullptr);
  pipeline.place_optimizer_state();
  Reference ref(t, t.ctx.optimizer);
  for (int step = 0; step < 4; ++step) {
    std::vector<torch::Tensor> sum(t.initial.size());
    for (int micro = 0; micro < 2; ++micro) {
      for (size_t i = 0; i < t.initial.size(); ++i) {
        if (i == 3 && step == 1) continue;  // unused in this step: no update, as torch.optim
        const torch::Tensor g = torch::randn_like(t.initial[i]);
        sink.accumulate(i, g);
        sum[i] = sum[i].defined() ? sum[i] + g : g;
      }
    }
    for (torch::Tensor& p : ref.params) p.mutable_grad() = torch::Tensor();  // undefined: torch skips it too
    double norm_sq = 0;
    for (size_t i = 0; i < sum.size(); ++i) {
      if (!sum[i].defined()) continue;
      ref.params[i].mutable_grad() = sum[i] / 2;
      norm_sq += ref.params[i].grad().pow(2).sum().item<double>();
    }
    const double norm = torch::nn::utils::clip_grad_norm_(ref.params, o.clip_norm);
    ref.opt->step();
    double grad_norm = 0;
    ASSERT_TRUE(pipeline.step(grad_norm));
    EXPECT_NEAR(grad_norm, std::sqrt(norm_sq), 1e-4 * grad_norm);
    EXPECT_NEAR(grad_norm, norm, 1e-4 * grad_norm);
    for (size_t i = 0; i < t.initial.size(); ++i) {
      EXPECT_LT(rel_l2(t.values(i), ref.params[i].detach()), 1e-6) << "step " << step << ", parameter " << i;
    }
  }
  EXPECT_EQ(t.ctx.params[3].steps, 3);  // skipped in the step it had no gradient
  EXPECT_EQ(t.ctx.params[0].steps, 4);
  EXPECT_GT(t.ctx.wait.optimizer, 0.0);
}

TEST(StepPipeline, StreamsOptimizerStateThroughNvmeAndBack) {
  EngineOptions o = component_options(2);
  o.budgets.nvme = 4 << 20;
  o.nvme_dir = temp_path("step-pipeline-nvme");
  o.nvme_optim_fraction = 1.0;
  std::filesystem::create_directories(o.nvme_dir);
  {
    ComponentContext t(o, {kChunkElems, kChunkElems, kChunkElems});
    GradSink sink(t.ctx, nullptr);
    StepPipeline pipeline(t.ctx, sink, nullptr);
    pipeline.place_optimizer_state();
    EXPECT_EQ(pipeline.optim_on_nvme(), std::vector<bool>(3, true));
    Reference ref(t, t.ctx.optimizer);
    for (int step = 0; step < 3; ++step) {
      pipeline.read_state_early();
      ref.opt->zero_grad();
      for (size_t i = 0; i < 3; ++i) {
        const torch::Tensor g = torch::randn({kChunkElems});
        sink.accumulate(i, g);
        ref.params[i].mutable_grad() = g.clone();
      }
      ref.opt->step();
      double norm = 0;
      ASSERT_TRUE(pipeline.step(norm));
      for (memory::FamilyId f : t.ctx.families) {
        for (ChunkId c : t.ctx.optim_members(f)) {
          EXPECT_TRUE(t.ctx.mgr->chunk(c).resident_on(Tier::kNvme)) << "chunk " << c << " after step " << step;
        }
      }
    }
    for (size_t i = 0; i < 3; ++i) EXPECT_LT(rel_l2(t.values(i), ref.params[i].detach()), 1e-6) << "parameter " << i;
    EXPECT_GT(t.ctx.mgr->move_stats().bytes[2][1], 0u);  // state read back from NVMe
  }
  std::filesystem::remove_all(o.nvme_dir);
}

TEST(StepPipeline, Fp16OverflowSkipsTheStepAndBacksOffTheScale) {
  EngineOptions o = component_options(2);
  o.precision = DType::kFloat16;
  o.loss_scale.initial = 1024;
  o.loss_scale.growth_interval = 2;
  ComponentContext t(o, {kChunkElems, 100});
  GradSink sink(t.ctx, nullptr);
  StepPipeline pipeline(t.ctx, sink, nullptr);
  pipeline.place_optimizer_state();
  EXPECT_EQ(pipeline.loss_scale(), 1024.0);

  torch::Tensor g = torch::ones({100});
  g[7] = std::numeric_limits<float>::infinity();
  sink.accumulate(0, torch::ones({kChunkElems}));
  sink.accumulate(1, g);
  double norm = 0;
  EXPECT_FALSE(pipeline.step(norm));
  EXPECT_EQ(pipeline.skipped(), 1);
  EXPECT_EQ(pipeline.loss_scale(), 512.0);
  EXPECT_FALSE(t.ctx.params[0].has_grad);  // gradients dropped
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(t.values(i), t.initial[i])) << "parameter " << i;

  // Two clean steps grow the scale again; the update divides it out.
  for (int step = 0; step < 2; ++step) {
    sink.accumulate(0, torch::full({kChunkElems}, 512.0f));
    EXPECT_TRUE(pipeline.step(norm));
    EXPECT_NEAR(norm, std::sqrt(static_cast<double>(kChunkElems)), 1e-3);
  }
  EXPECT_EQ(pipeline.loss_scale(), 1024.0);
  EXPECT_EQ(pipeline.clean_steps(), 0);
}

}  // namespace
}  // namespace strata::parallel
