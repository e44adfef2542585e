// Activation offload (Note [Offloading a block's activations]): exactly the
// gradients and training of the plain run, dropout included, with the
// device's activation peak lower by about the offloaded bytes; composed with
// checkpointing; alone and under an attached engine in fp32 and bf16; and
// nothing kept when no backward comes.
#include "strata/parallel/activation_offload.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "parallel/deep_blocks.h"
#include "parallel/test_util.h"
#include "strata/parallel/activation_checkpoint.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/memory_counter.h"

namespace strata::parallel {
namespace {

using Deep = DeepBlocks;
using Mode = BlockMode;

TEST(ActivationOffload, SameGradientsAndAPeakLowerByTheOffloadedBytes) {
  NonModelCounter& counter = cpu_non_model_counter();
  const torch::Tensor x = torch::randn({512, 256}), y = torch::randn({512, 4});
  std::vector<std::vector<torch::Tensor>> grads;
  std::vector<uint64_t> peaks;
  uint64_t offloaded = 0;
  for (Mode mode : {Mode::kKeep, Mode::kOffload, Mode::kMixed}) {
    Deep m(3);
    m.mode = mode;
    m.train();
    torch::manual_seed(77);  // the same dropout masks in every run
    const ActivationOffloadStats s0 = activation_offload_stats();
    const uint64_t before = counter.current();
    counter.reset_peak();
    torch::mse_loss(m.forward(x), y).backward();
    peaks.push_back(counter.peak() - before);
    const ActivationOffloadStats s1 = activation_offload_stats();
    if (mode == Mode::kOffload) {
      offloaded = s1.offloaded_bytes - s0.offloaded_bytes;
      EXPECT_EQ(s1.blocks - s0.blocks, 6u);
      EXPECT_EQ(s1.restored_bytes - s0.restored_bytes, offloaded) << "everything offloaded came back";
      EXPECT_GT(s1.prefetched_bytes - s0.prefetched_bytes, 0u) << "blocks before the last were prefetched";
    }
    std::vector<torch::Tensor> g;
    for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
    grads.push_back(g);
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(grads[1][i], grads[0][i])) << "offload changed gradient " << i;
    EXPECT_TRUE(torch::allclose(grads[2][i], grads[0][i], 1e-6, 1e-7)) << "offload + checkpoint, gradient " << i;
  }
  // Each block keeps GELU's input, dropout's mask and the second Linear's
  // input (its output is the block's, and Tanh's output too): 512 x 256 fp32
  // each, 1.5 MiB a block.
  EXPECT_GE(offloaded, 6u * 3 * 512 * 256 * 4);
  // All but the block in backward (and the one prefetched) wait on the host.
  EXPECT_LT(peaks[1] + offloaded / 2, peaks[0]) << "offloaded " << offloaded << ", peaks " << peaks[1] << " vs "
                                                << peaks[0];
  EXPECT_LT(peaks[2], peaks[0]);
}

TEST(ActivationOffload, NothingIsKeptWhenNoBackwardComes) {
  NonModelCounter& counter = cpu_non_model_counter();
  const ActivationOffloadStats s0 = activation_offload_stats();
  const uint64_t before = counter.current();
  {
    Deep m(5, 3, 128);
    m.mode = Mode::kOffload;
    const torch::Tensor loss = m.forward(torch::randn({64, 128})).sum();
    EXPECT_GT(activation_offload_stats().offloaded_bytes, s0.offloaded_bytes);
  }  // the graph goes with the loss: its saved tensors and their host copies too
  EXPECT_EQ(activation_offload_stats().restored_bytes, s0.restored_bytes);
  EXPECT_LE(counter.current(), before);
  // Evaluation (no grad mode) offloads nothing.
  Deep m(5, 3, 128);
  m.mode = Mode::kOffload;
  torch::NoGradGuard no_grad;
  const uint64_t blocks = activation_offload_stats().blocks;
  (void)m.forward(torch::randn({64, 128}));
  EXPECT_EQ(activation_offload_stats().blocks, blocks);
}

// Under an attached engine: training with offload equals training without it
// exactly, and what forward leaves on the device drops by the offloaded bytes.
void offloaded_engine_run(DType precision) {
  NonModelCounter& counter = cpu_non_model_counter();
  uint64_t forward_growth[2] = {0, 0};
  std::vector<std::vector<double>> losses(2);
  std::vector<std::vector<torch::Tensor>> finals(2);
  uint64_t offloaded_per_step = 0;
  for (int off = 0; off < 2; ++off) {
    const uint64_t offloaded_before = activation_offload_stats().offloaded_bytes;
    Deep m(4, 4, 128);
    m.mode = off == 1 ? Mode::kOffload : Mode::kKeep;
    EngineOptions o;
    o.budgets = {256 << 10, 8 << 20, 0};
    o.chunk_elems = 16384;
    o.precision = precision;
    {
      auto engine = attach(m, AdamWConfig{}, o);
      torch::manual_seed(8);
      for (int s = 0; s < 4; ++s) {
        const torch::Tensor x = torch::randn({256, 128}).to(engine->compute_dtype());
        const torch::Tensor y = torch::randn({256, 4}).to(engine->compute_dtype());
        losses[static_cast<size_t>(off)].push_back(
            engine->train_step([&] {
              const uint64_t before = counter.current();
              const torch::Tensor out = m.forward(x);
              forward_growth[off] = std::max(forward_growth[off], counter.current() - before);
              return (out - y).pow(2).mean().to(torch::kFloat32);
            }).loss);
      }
      const memory::TierStats dev = engine->tier_stats(memory::Tier::kDevice);
      EXPECT_LE(dev.peak, dev.budget);
    }
    if (off == 1) offloaded_per_step = (activation_offload_stats().offloaded_bytes - offloaded_before) / 4;
    for (const auto& p : m.parameters()) finals[static_cast<size_t>(off)].push_back(p.detach().clone());
  }
  for (size_t s = 0; s < losses[0].size(); ++s) EXPECT_EQ(losses[1][s], losses[0][s]) << "step " << s;
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TRUE(torch::equal(finals[1][i], finals[0][i])) << i;
  // What forward leaves on the device (the emulated device's allocator,
  // which the engine's capacity rule and tracer read) is less by exactly the
  // bytes offloaded.
  ASSERT_GT(offloaded_per_step, 0u);
  EXPECT_EQ(forward_growth[0], forward_growth[1] + offloaded_per_step);
}


TEST(ActivationOffload, EngineTrainsExactlyTheSameInFp32) { offloaded_engine_run(DType::kFloat32); }
TEST(ActivationOffload, EngineTrainsExactlyTheSameInBf16) { offloaded_engine_run(DType::kBFloat16); }

}  // namespace
}  // namespace strata::parallel
