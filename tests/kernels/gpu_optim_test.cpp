// The CUDA kernels against the CPU kernels. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kernels/reference.h"
#include "strata/kernels/cuda_optim.h"
#include "strata/kernels/optim.h"

namespace strata::kernels {
namespace {

bool have_gpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T) + 1), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

struct HostChunk {
  std::vector<float> master, m, v;
  std::vector<uint16_t> grad, copy;
};

HostChunk make_chunk(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostChunk c;
  for (int64_t i = 0; i < n; ++i) {
    c.master.push_back(normal(rng));
    c.m.push_back(0.1f * normal(rng));
    c.v.push_back(0.01f * std::fabs(normal(rng)));
    c.grad.push_back(testing::ref_float_to_bf16(3.0f * normal(rng)));
  }
  c.copy.assign(n, 0);
  return c;
}

TEST(GpuKernels, MultiTensorAdamMatchesTheCpuKernel) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<int64_t> sizes = {1, 17, 4095, (1 << 20) + 3};
  AdamParams p;
  p.lr = 1e-2f;
  p.weight_decay = 0.05f;
  p.step = 3;
  p.grad_scale = 0.5f;
  std::vector<HostChunk> cpu;
  std::vector<cuda::DeviceSpans> spans;
  for (size_t k = 0; k < sizes.size(); ++k) {
    cpu.push_back(make_chunk(sizes[k], static_cast<uint32_t>(k + 1)));
    cuda::DeviceSpans d;
    d.n = sizes[k];
    d.master = to_device(cpu[k].master);
    d.exp_avg = to_device(cpu[k].m);
    d.exp_avg_sq = to_device(cpu[k].v);
    d.grad = to_device(cpu[k].grad);
    d.param_copy = to_device(cpu[k].copy);
    spans.push_back(d);
  }
  int* found_inf = nullptr;
  ASSERT_EQ(cudaMalloc(&found_inf, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(found_inf, 0, sizeof(int)), cudaSuccess);
  cuda::multi_tensor_adam(p, DType::kBFloat16, DType::kBFloat16, spans.data(), static_cast<int>(spans.size()),
                          found_inf, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t k = 0; k < sizes.size(); ++k) {
    OptimSpans s;
    s.n = sizes[k];
    s.master = cpu[k].master.data();
    s.grad = cpu[k].grad.data();
    s.grad_dtype = DType::kBFloat16;
    s.state0 = cpu[k].m.data();
    s.state1 = cpu[k].v.data();
    s.param_copy = cpu[k].copy.data();
    s.param_dtype = DType::kBFloat16;
    ASSERT_EQ(adam_step(p, s), StepStatus::kUpdated);
    const auto w = to_host(spans[k].master, sizes[k]);
    const auto v = to_host(spans[k].exp_avg_sq, sizes[k]);
    for (int64_t i = 0; i < sizes[k]; ++i) {
      ASSERT_NEAR(w[i], cpu[k].master[i], 1e-6 + 1e-5 * std::fabs(cpu[k].master[i])) << "chunk " << k << " at " << i;
      ASSERT_NEAR(v[i], cpu[k].v[i], 1e-6 + 1e-5 * std::fabs(cpu[k].v[i]));
    }
  }
  // With the overflow flag set, a second launch writes nothing.
  ASSERT_EQ(cudaMemset(found_inf, 1, 1), cudaSuccess);
  const auto before = to_host(spans[3].master, sizes[3]);
  cuda::multi_tensor_adam(p, DType::kBFloat16, DType::kBFloat16, spans.data(), static_cast<int>(spans.size()),
                          found_inf, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(to_host(spans[3].master, sizes[3]), before);
}

// Lion and SGD (with momentum, Nesterov, first step) on the GPU against the
// CPU kernels on the same values: the optimizer split (Note [The optimizer
// where its state lives]) must not change the arithmetic.
TEST(GpuKernels, LionAndSgdMatchTheCpuKernels) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (1 << 20) + 7;
  for (int which = 0; which < 3; ++which) {
    HostChunk c = make_chunk(n, 30 + which);
    cuda::DeviceSpans d;
    d.n = n;
    d.master = to_device(c.master);
    d.exp_avg = to_device(c.m);
    d.grad = to_device(c.grad);
    d.param_copy = to_device(c.copy);
    OptimSpans s;
    s.n = n;
    s.master = c.master.data();
    s.grad = c.grad.data();
    s.grad_dtype = DType::kBFloat16;
    s.state0 = c.m.data();
    s.param_copy = c.copy.data();
    s.param_dtype = DType::kBFloat16;
    if (which == 0) {
      LionParams p;
      p.lr = 1e-3f;
      p.weight_decay = 0.1f;
      p.grad_scale = 0.5f;
      p.grads_known_finite = true;
      cuda::lion_step(p, DType::kBFloat16, DType::kBFloat16, d, nullptr);
      ASSERT_EQ(lion_step(p, s), StepStatus::kUpdated);
    } else {
      SgdParams p;
      p.lr = 1e-2f;
      p.momentum = 0.9f;
      p.dampening = 0.1f;
      p.weight_decay = 0.01f;
      p.nesterov = which == 2;
      p.step = which == 1 ? 1 : 4;
      p.grads_known_finite = true;
      cuda::sgd_step(p, DType::kBFloat16, DType::kBFloat16, d, nullptr);
      ASSERT_EQ(sgd_step(p, s), StepStatus::kUpdated);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto w = to_host(d.master, n);
    const auto m = to_host(d.exp_avg, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(w[i], c.master[i], 1e-6 + 1e-5 * std::fabs(c.master[i])) << "optimizer " << which << " at " << i;
      ASSERT_NEAR(m[i], c.m[i], 1e-6 + 1e-5 * std::fabs(c.m[i])) << "optimizer " << which << " at " << i;
    }
    const auto copy = to_host(static_cast<uint16_t*>(d.param_copy), n);
    int64_t off_by_more_than_an_ulp = 0;  // rounding ties may fall either way after fma differences
    for (int64_t i = 0; i < n; ++i) off_by_more_than_an_ulp += std::abs(int(copy[i]) - int(c.copy[i])) > 1;
    EXPECT_EQ(off_by_more_than_an_ulp, 0) << "optimizer " << which;
  }
}

TEST(GpuKernels, GradStatsAndCastMatchTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  HostChunk c = make_chunk((1 << 20) + 5, 9);
  uint16_t* d_grad = to_device(c.grad);
  double* d_sum = nullptr;
  int* d_inf = nullptr;
  ASSERT_EQ(cudaMalloc(&d_sum, sizeof(double)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_inf, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_sum, 0, sizeof(double)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_inf, 0, sizeof(int)), cudaSuccess);
  cuda::grad_stats(d_grad, DType::kBFloat16, static_cast<int64_t>(c.grad.size()), d_sum, d_inf, nullptr);
  const GradStats cpu = grad_stats(c.grad.data(), DType::kBFloat16, static_cast<int64_t>(c.grad.size()));
  EXPECT_NEAR(to_host(d_sum, 1)[0], cpu.sum_sq, 1e-5 * cpu.sum_sq);
  EXPECT_EQ(to_host(d_inf, 1)[0], 0);
  c.grad[12345] = 0x7f80;  // +inf in bf16
  ASSERT_EQ(cudaMemcpy(d_grad, c.grad.data(), c.grad.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::grad_stats(d_grad, DType::kBFloat16, static_cast<int64_t>(c.grad.size()), d_sum, d_inf, nullptr);
  EXPECT_EQ(to_host(d_inf, 1)[0], 1);

  float* d_f = to_device(c.master);
  uint16_t* d_h = to_device(c.copy);
  cuda::cast(d_f, DType::kFloat32, d_h, DType::kFloat16, static_cast<int64_t>(c.master.size()), nullptr);
  std::vector<uint16_t> want(c.master.size());
  cast(c.master.data(), DType::kFloat32, want.data(), DType::kFloat16, static_cast<int64_t>(want.size()));
  EXPECT_EQ(to_host(d_h, want.size()), want);
}

}  // namespace
}  // namespace strata::kernels
