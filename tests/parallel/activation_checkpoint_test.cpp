// Activation checkpointing (Note [Recomputing in backward]): the same
// gradients and training as without it, dropout included, with a lower
// activation peak, alone and under an attached engine (fp32 and bf16), whose
// trace files the recomputation under "recompute".
#include "strata/parallel/activation_checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <set>

#include "parallel/deep_blocks.h"
#include "parallel/test_util.h"
#include "strata/memory/trace.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/memory_counter.h"

namespace strata::parallel {
namespace {

using Deep = DeepBlocks;

TEST(ActivationCheckpoint, SameGradientsWithDropoutAndALowerActivationPeak) {
  NonModelCounter& counter = cpu_non_model_counter();
  const torch::Tensor x = torch::randn({512, 256}), y = torch::randn({512, 4});
  std::vector<std::vector<torch::Tensor>> grads;
  std::vector<uint64_t> peaks;
  for (bool ckpt : {false, true}) {
    Deep m(3);
    m.mode = ckpt ? BlockMode::kCheckpoint : BlockMode::kKeep;
    m.train();
    torch::manual_seed(77);  // the same dropout masks in both runs
    const uint64_t before = counter.current();
    counter.reset_peak();
    torch::mse_loss(m.forward(x), y).backward();
    peaks.push_back(counter.peak() - before);
    std::vector<torch::Tensor> g;
    for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
    grads.push_back(g);
    EXPECT_FALSE(recomputing());
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(torch::allclose(grads[1][i], grads[0][i], 1e-6, 1e-7)) << "parameter " << i;
  }
  EXPECT_LT(peaks[1], peaks[0] * 3 / 4) << "checkpointed peak " << peaks[1] << " vs " << peaks[0];
  // The random stream after backward is where forward left it: recomputation does not consume it.
  Deep m(3);
  m.mode = BlockMode::kCheckpoint;
  torch::manual_seed(5);
  torch::mse_loss(m.forward(x), y).backward();
  const torch::Tensor after_ckpt = torch::rand({4});
  m.mode = BlockMode::kKeep;
  torch::manual_seed(5);
  torch::mse_loss(m.forward(x), y).backward();
  EXPECT_TRUE(torch::equal(torch::rand({4}), after_ckpt));
}

// Under an attached engine: training with checkpointing equals training
// without it, in fp32 and bf16, and the trace shows the recomputation.
void checkpointed_engine_run(DType precision, double tol) {
  const std::string traces[2] = {temp_path("plain-trace", ".json"), temp_path("ckpt-trace", ".json")};
  std::vector<std::vector<double>> losses(2);
  std::vector<std::vector<torch::Tensor>> finals(2);
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    Deep m(4, 4, 128);
    m.mode = ckpt == 1 ? BlockMode::kCheckpoint : BlockMode::kKeep;
    EngineOptions o;
    o.budgets = {256 << 10, 8 << 20, 0};  // about a quarter of the model state on the device
    o.chunk_elems = 16384;
    o.precision = precision;
    o.trace_path = traces[ckpt];
    {
      auto engine = attach(m, AdamWConfig{}, o);
      torch::manual_seed(8);
      for (int s = 0; s < 4; ++s) {
        const torch::Tensor x = torch::randn({256, 128}).to(engine->compute_dtype());
        const torch::Tensor y = torch::randn({256, 4}).to(engine->compute_dtype());
        losses[static_cast<size_t>(ckpt)].push_back(
            engine->train_step([&] { return (m.forward(x) - y).pow(2).mean().to(torch::kFloat32); }).loss);
      }
      const memory::TierStats dev = engine->tier_stats(memory::Tier::kDevice);
      EXPECT_LE(dev.peak, dev.budget);
    }
    for (const auto& p : m.parameters()) finals[static_cast<size_t>(ckpt)].push_back(p.detach().clone());
  }
  for (size_t s = 0; s < losses[0].size(); ++s) EXPECT_LT(rel(losses[1][s], losses[0][s]), tol) << "step " << s;
  for (size_t i = 0; i < finals[0].size(); ++i) {
    EXPECT_LT(((finals[1][i] - finals[0][i]).norm() / finals[0][i].norm()).item<double>(), tol) << "parameter " << i;
  }
  uint64_t peaks[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    for (const memory::TraceOp& op : memory::read_trace(traces[k]).ops) {
      if (op.phase != "optimizer") peaks[k] = std::max(peaks[k], op.non_model_peak);
    }
  }
  EXPECT_LT(peaks[1], peaks[0]) << "the traced activation peak drops";
  const memory::Trace t = memory::read_trace(traces[1]);
  int recomputed_with_params = 0;
  for (const memory::TraceOp& op : t.ops) recomputed_with_params += op.phase == "recompute" && !op.chunks.empty();
  EXPECT_GE(recomputed_with_params, 8) << "each block's two Linear layers run again in backward, seen by the hook";
  for (const std::string& path : traces) std::filesystem::remove(path);
}

// A checkpointed block's parameter chunks, brought to the device for its
// recomputation, are still there for the block's backward: with the device
// holding about two blocks' parameters and gradients, every touch of a chunk
// after its recomputation in a step's backward finds it on the device, in
// the first traced step (LRU) and in the second (the traced plan).
TEST(ActivationCheckpoint, ParametersStayOnTheDeviceFromRecomputationThroughBackward) {
  const std::string trace = temp_path("recompute-residency", ".json");
  Deep m(6, 6, 128);
  m.mode = BlockMode::kCheckpoint;
  EngineOptions o;
  o.budgets = {640 << 10, 16 << 20, 0};
  o.chunk_elems = 16384;
  o.trace_path = trace;
  {
    auto engine = attach(m, AdamWConfig{}, o);
    torch::manual_seed(9);
    for (int s = 0; s < 2; ++s) {
      const torch::Tensor x = torch::randn({256, 128}), y = torch::randn({256, 4});
      engine->train_step([&] { return (m.forward(x) - y).pow(2).mean(); });
    }
  }
  const memory::Trace t = memory::read_trace(trace);
  ASSERT_EQ(t.steps.size(), 2u);
  for (const memory::TraceStep& step : t.steps) {
    std::set<int64_t> recomputed;  // chunks a recomputation used so far in this step
    int after_recompute = 0, off_device = 0, recompute_off_device = 0;
    for (int64_t i = step.first_op; i < step.end_op; ++i) {
      const memory::TraceOp& op = t.ops[static_cast<size_t>(i)];
      if (op.phase != "recompute" && op.phase != "backward") continue;
      for (const memory::TraceTouch& touch : op.chunks) {
        if (t.chunks[static_cast<size_t>(touch.chunk)].role != "param") continue;
        if (op.phase == "recompute" && !recomputed.count(touch.chunk)) {
          recomputed.insert(touch.chunk);
          recompute_off_device += touch.tier != "device";
          continue;
        }
        if (!recomputed.count(touch.chunk)) continue;
        ++after_recompute;
        off_device += touch.tier != "device";
      }
    }
    EXPECT_GE(recomputed.size(), 12u) << "step " << step.index << ": each block's two weights run again";
    EXPECT_GT(recompute_off_device, 0) << "step " << step.index << ": the device must be too small for the model";
    EXPECT_GT(after_recompute, 0) << "step " << step.index;
    EXPECT_EQ(off_device, 0) << "step " << step.index << ": of " << after_recompute
                             << " touches after the recomputation, these found their chunk off the device";
  }
  std::filesystem::remove(trace);
}

TEST(ActivationCheckpoint, EngineTrainsTheSameWithItInFp32) { checkpointed_engine_run(DType::kFloat32, 1e-6); }
TEST(ActivationCheckpoint, EngineTrainsTheSameWithItInBf16) { checkpointed_engine_run(DType::kBFloat16, 1e-6); }

}  // namespace
}  // namespace strata::parallel
