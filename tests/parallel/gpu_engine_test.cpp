// The engine on a CUDA device (tools/gpu_check.sh runs these; they skip
// without one): training at a quarter of model state on the device against
// plain LibTorch with everything on the GPU, the device budget held by the
// runtime's own accounting and by the device arena, buffers and inputs on
// the device, and the optimizer split between the GPU and the CPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strata/offload/cuda_runtime.h"
#include "strata/parallel/engine.h"
#include "test_util.h"

namespace strata::parallel {
namespace {

bool have_gpu() { return !offload::cuda::probe().devices.empty() && torch::cuda::is_available(); }

torch::nn::Sequential gpu_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(256, 512), torch::nn::ReLU(), torch::nn::Linear(512, 512),
                               torch::nn::ReLU(), torch::nn::BatchNorm1d(512), torch::nn::Linear(512, 64));
}

struct GpuRun {
  double worst_loss = 0;  // relative, against the reference, over the steps
  memory::TierStats device;
  offload::DeviceArenaStats arena;
  uint64_t evictions = 0;
};

// Trains `steps` steps with the engine at `fraction` of the model state on
// the device, and plain LibTorch AdamW on the GPU on the same data.
GpuRun train_against_torch(DType precision, double fraction, double device_optim, torch::nn::Module& reference,
                           torch::nn::Module& model, int steps) {
  int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  EngineOptions o;
  o.precision = precision;
  o.budgets = {static_cast<uint64_t>(params * model_state_bytes_per_param(precision) * fraction) / 4096 * 4096 + 4096,
               static_cast<uint64_t>(params) * 64, 0};
  o.chunk_elems = 1 << 16;
  o.device_optim_fraction = device_optim;
  AdamWConfig cfg;
  cfg.lr = 1e-3f;
  reference.to(torch::kCUDA);
  auto opt = reference_adamw(reference, cfg);
  GpuRun run;
  auto engine = attach(model, cfg, o);
  EXPECT_TRUE(engine->device().is_cuda());
  for (const auto& b : model.buffers()) EXPECT_TRUE(b.is_cuda()) << "buffers live where operators run";
  torch::manual_seed(5);
  for (int s = 0; s < steps; ++s) {
    const torch::Tensor x = torch::randn({64, 256}), y = torch::randn({64, 64});
    const torch::Tensor rx = x.cuda(), ry = y.cuda();
    opt.zero_grad();
    torch::Tensor ref = torch::mse_loss(reference.as<torch::nn::Sequential>()->forward(rx), ry);
    ref.backward();
    opt.step();
    const torch::Tensor ex = engine->to_device(x), ey = engine->to_device(y);
    EXPECT_TRUE(ex.is_cuda());
    const StepResult r = engine->train_step([&] {
      return torch::mse_loss(model.as<torch::nn::Sequential>()->forward(ex).to(torch::kFloat32), ey.to(torch::kFloat32));
    });
    run.worst_loss = std::max(run.worst_loss, rel(r.loss, ref.item<double>()));
  }
  run.device = engine->tier_stats(memory::Tier::kDevice);
  run.arena = engine->chunks().device().arena_stats();
  run.evictions = run.device.evictions;
  return run;
}

TEST(GpuEngine, Fp32AtAQuarterOfModelStateMatchesLibTorchOnTheGpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(1);
  auto reference = gpu_mlp();
  auto model = gpu_mlp();
  copy_params(*reference, *model);
  const GpuRun r = train_against_torch(DType::kFloat32, 0.25, 0.0, *reference, *model, 10);
  EXPECT_LT(r.worst_loss, 1e-5);
  EXPECT_LE(r.device.peak, r.device.budget) << "the device tier went over its budget";
  EXPECT_LE(r.arena.live, r.device.budget) << "the device arena held more payload than the budget";
  EXPECT_GT(r.evictions, 0u) << "a quarter of the model state must have made the engine evict";
  reference->to(torch::kCPU);
  expect_params_close(*reference, *model);
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_cpu()) << "detach gives parameters their device back";
}

TEST(GpuEngine, Bf16StaysCloseToFp32LibTorch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(2);
  auto reference = gpu_mlp();
  auto model = gpu_mlp();
  copy_params(*reference, *model);
  const GpuRun r = train_against_torch(DType::kBFloat16, 0.25, 0.0, *reference, *model, 10);
  EXPECT_LT(r.worst_loss, 3e-2);
  EXPECT_LE(r.device.peak, r.device.budget);
  reference->to(torch::kCPU);
  expect_params_close(*reference, *model, 3e-2);
}

TEST(GpuEngine, OptimizerSplitBetweenGpuAndCpuMatchesLibTorch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(3);
  auto reference = gpu_mlp();
  auto model = gpu_mlp();
  copy_params(*reference, *model);
  const GpuRun r = train_against_torch(DType::kFloat32, 0.5, 0.5, *reference, *model, 10);
  EXPECT_LT(r.worst_loss, 1e-5);
  EXPECT_LE(r.device.peak, r.device.budget);
  reference->to(torch::kCPU);
  expect_params_close(*reference, *model);
}

}  // namespace
}  // namespace strata::parallel
