// strata's fused AdamW against torch::optim::AdamW over 100 steps (fp32).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "strata/kernels/optim.h"

namespace strata::kernels {
namespace {

TEST(AdamWVsTorch, HundredStepsAgreeWithinOneInAMillion) {
  torch::manual_seed(1234);
  const int64_t n = 100003;
  torch::Tensor param = torch::randn({n});
  const torch::Tensor initial = param.clone().to(torch::kFloat64);
  std::vector<float> master(param.data_ptr<float>(), param.data_ptr<float>() + n);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);

  const double lr = 1e-3, wd = 1e-2;
  torch::optim::AdamW opt({param}, torch::optim::AdamWOptions(lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
  for (int step = 1; step <= 100; ++step) {
    const torch::Tensor grad = torch::randn({n}) * (1.0 + step % 7);
    param.mutable_grad() = grad.clone();
    opt.step();

    AdamParams p;
    p.lr = static_cast<float>(lr);
    p.weight_decay = static_cast<float>(wd);
    p.step = step;
    OptimSpans s;
    s.n = n;
    s.master = master.data();
    s.grad = grad.data_ptr<float>();
    s.state0 = m.data();
    s.state1 = v.data();
    ASSERT_EQ(adam_step(p, s), StepStatus::kUpdated);
  }
  const torch::Tensor ours = torch::from_blob(master.data(), {n}, torch::kFloat32).to(torch::kFloat64);
  const torch::Tensor theirs = param.detach().to(torch::kFloat64);
  const double rel = ((ours - theirs).norm() / theirs.norm()).item<double>();
  EXPECT_LT(rel, 1e-6) << "relative L2 error after 100 steps";
  const double max_rel = ((ours - theirs).abs() / theirs.abs().clamp_min(1e-3)).max().item<double>();
  EXPECT_LT(max_rel, 1e-4) << "worst element";
  // The comparison means something only if 100 steps moved the parameters
  // much further than the tolerance.
  EXPECT_GT(((theirs - initial).norm() / initial.norm()).item<double>(), 1e-3);
}

}  // namespace
}  // namespace strata::kernels
