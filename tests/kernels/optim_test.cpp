// Every CPU optimizer kernel, on every ISA this CPU has, against the double
// references of reference.h: sizes 0, 1, 15, 16, 17, 4095 and 1M+3, unaligned
// start offsets, and every (gradient dtype, parameter dtype) combination.
#include "strata/kernels/optim.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/reference.h"
#include "strata/core/error.h"
#include "strata/kernels/thread_pool.h"

namespace strata::kernels {
namespace {

using namespace testing;  // NOLINT: the reference helpers

constexpr DType kDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const std::vector<int64_t> kSizes = {0, 1, 15, 16, 17, 4095, (1 << 20) + 3};

enum class Opt { kAdamW, kAdamL2, kLion, kSgd, kSgdNesterovFirstStep, kSgdNoMomentum };
const char* opt_name(Opt o) {
  switch (o) {
    case Opt::kAdamW: return "AdamW";
    case Opt::kAdamL2: return "AdamL2NoBiasCorrection";
    case Opt::kLion: return "Lion";
    case Opt::kSgd: return "SgdMomentum";
    case Opt::kSgdNesterovFirstStep: return "SgdNesterovFirstStep";
    case Opt::kSgdNoMomentum: return "SgdNoMomentum";
  }
  return "?";
}

// One chunk slice whose arrays start `offset` elements into their allocations.
struct Slice {
  int64_t n, off;
  DType grad_dtype, param_dtype;
  std::vector<float> master, m, v;
  std::vector<unsigned char> grad, copy;

  Slice(int64_t n_, int64_t off_, DType g, DType p, uint32_t seed)
      : n(n_), off(off_), grad_dtype(g), param_dtype(p), master(n + off), m(n + off), v(n + off),
        grad((n + off) * dtype_size(g)), copy((n + off) * 2, 0) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < n + off; ++i) {
      master[i] = uni(rng);
      m[i] = 0.1f * normal(rng);
      v[i] = 0.01f * std::fabs(uni(rng));
      set_grad(i, 4.0f * normal(rng));
    }
  }
  void set_grad(int64_t i, float x) {
    switch (grad_dtype) {
      case DType::kFloat32: reinterpret_cast<float*>(grad.data())[i] = x; break;
      case DType::kBFloat16: reinterpret_cast<uint16_t*>(grad.data())[i] = ref_float_to_bf16(x); break;
      case DType::kFloat16: reinterpret_cast<uint16_t*>(grad.data())[i] = ref_float_to_fp16(x); break;
    }
  }
  const void* grad_at() const { return grad.data() + off * dtype_size(grad_dtype); }
  OptimSpans spans() {
    OptimSpans s;
    s.n = n;
    s.master = master.data() + off;
    s.grad = grad_at();
    s.grad_dtype = grad_dtype;
    s.state0 = m.data() + off;
    s.state1 = v.data() + off;
    s.param_dtype = param_dtype;
    s.param_copy = param_dtype == DType::kFloat32 ? nullptr : copy.data() + off * 2;
    return s;
  }
  RefState ref_state() const {
    RefState r;
    for (int64_t i = 0; i < n; ++i) {
      r.w.push_back(master[off + i]);
      r.m.push_back(m[off + i]);
      r.v.push_back(v[off + i]);
    }
    return r;
  }
  std::vector<double> ref_grad() const {
    std::vector<double> g(n);
    for (int64_t i = 0; i < n; ++i) g[i] = ref_load(grad_at(), grad_dtype, i);
    return g;
  }
};

bool close(double got, double want) { return std::fabs(got - want) <= 2e-6 + 2e-5 * std::fabs(want); }

class OptimKernel : public ::testing::TestWithParam<std::tuple<Isa, Opt>> {};

TEST_P(OptimKernel, MatchesDoubleReference) {
  const auto [isa, opt] = GetParam();
  if (!isa_supported(isa)) GTEST_SKIP() << isa_name(isa) << " not supported by this CPU";
  uint32_t seed = 1;
  for (DType gd : kDTypes) {
    for (DType pd : kDTypes) {
      for (int64_t n : kSizes) {
        for (int64_t off : {int64_t{0}, int64_t{3}}) {
          if (n > 5000 && off == 0) continue;  // the large size once, unaligned
          SCOPED_TRACE(std::string("grad ") + dtype_name(gd) + " param " + dtype_name(pd) + " n " +
                       std::to_string(n) + " offset " + std::to_string(off));
          Slice s(n, off, gd, pd, seed++);
          RefState ref = s.ref_state();
          const std::vector<double> grad = s.ref_grad();
          std::vector<double> lion_c;
          bool uses_v = false, uses_m = true;
          StepStatus status{};
          switch (opt) {
            case Opt::kAdamW:
            case Opt::kAdamL2: {
              AdamParams p;
              p.lr = 1e-2f;
              p.weight_decay = 0.05f;
              p.decoupled_weight_decay = opt == Opt::kAdamW;
              p.bias_correction = opt == Opt::kAdamW;
              p.step = 7;
              p.grad_scale = 0.25f;
              ref_adam(p, grad, ref);
              status = adam_step(p, s.spans(), isa);
              uses_v = true;
              break;
            }
            case Opt::kLion: {
              LionParams p;
              p.lr = 1e-3f;
              p.weight_decay = 0.1f;
              p.grad_scale = 0.5f;
              lion_c = ref_lion(p, grad, ref);
              status = lion_step(p, s.spans(), isa);
              break;
            }
            case Opt::kSgd:
            case Opt::kSgdNesterovFirstStep:
            case Opt::kSgdNoMomentum: {
              SgdParams p;
              p.lr = 0.05f;
              p.weight_decay = 1e-3f;
              p.dampening = opt == Opt::kSgd ? 0.1f : 0.0f;
              p.nesterov = opt == Opt::kSgdNesterovFirstStep;
              p.step = opt == Opt::kSgdNesterovFirstStep ? 1 : 5;
              p.momentum = opt == Opt::kSgdNoMomentum ? 0.0f : 0.9f;
              p.grad_scale = 2.0f;
              uses_m = p.momentum != 0.0f;
              ref_sgd(p, grad, ref);
              status = sgd_step(p, s.spans(), isa);
              break;
            }
          }
          ASSERT_EQ(status, StepStatus::kUpdated);
          int bad = 0;
          for (int64_t i = 0; i < n && bad < 5; ++i) {
            const bool sign_ambiguous = !lion_c.empty() && lion_c[i] < 1e-5;
            if (!sign_ambiguous && !close(s.master[off + i], ref.w[i])) {
              ADD_FAILURE() << "master[" << i << "] = " << s.master[off + i] << ", reference " << ref.w[i];
              ++bad;
            }
            if (uses_m && !close(s.m[off + i], ref.m[i])) {
              ADD_FAILURE() << "state0[" << i << "] = " << s.m[off + i] << ", reference " << ref.m[i];
              ++bad;
            }
            if (uses_v && !close(s.v[off + i], ref.v[i])) {
              ADD_FAILURE() << "state1[" << i << "] = " << s.v[off + i] << ", reference " << ref.v[i];
              ++bad;
            }
            if (pd != DType::kFloat32) {
              const uint16_t got = reinterpret_cast<const uint16_t*>(s.copy.data() + off * 2)[i];
              if (got != ref_round(s.master[off + i], pd)) {
                ADD_FAILURE() << "param copy[" << i << "] = " << got << " is not the rounded master";
                ++bad;
              }
            }
          }
          // Elements before the slice are never touched.
          for (int64_t i = 0; i < off; ++i) {
            ASSERT_EQ(s.copy[2 * i], 0) << "wrote before the slice";
          }
          if (bad) return;
        }
      }
    }
  }
}

TEST_P(OptimKernel, OverflowChangesNothingAndIsReported) {
  const auto [isa, opt] = GetParam();
  if (!isa_supported(isa)) GTEST_SKIP();
  std::mt19937 rng(99);
  for (DType gd : kDTypes) {
    for (float poison : {INFINITY, -INFINITY, NAN}) {
      const int64_t n = 100003;
      Slice s(n, 1, gd, DType::kBFloat16, static_cast<uint32_t>(rng()));
      const int64_t at = 1 + static_cast<int64_t>(rng() % n);
      s.set_grad(at, poison);
      const Slice before = s;
      StepStatus status{};
      switch (opt) {
        case Opt::kAdamW:
        case Opt::kAdamL2: status = adam_step(AdamParams{}, s.spans(), isa); break;
        case Opt::kLion: status = lion_step(LionParams{}, s.spans(), isa); break;
        default: status = sgd_step(SgdParams{}, s.spans(), isa); break;
      }
      EXPECT_EQ(status, StepStatus::kOverflow) << dtype_name(gd) << " poison " << poison << " at " << at;
      EXPECT_EQ(s.master, before.master);
      EXPECT_EQ(s.m, before.m);
      EXPECT_EQ(s.v, before.v);
      EXPECT_EQ(s.copy, before.copy);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllIsas, OptimKernel,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                       ::testing::Values(Opt::kAdamW, Opt::kAdamL2, Opt::kLion, Opt::kSgd, Opt::kSgdNesterovFirstStep,
                                         Opt::kSgdNoMomentum)),
    [](const auto& info) {
      return std::string(isa_name(std::get<0>(info.param))) + "_" + opt_name(std::get<1>(info.param));
    });

class IsaKernel : public ::testing::TestWithParam<Isa> {};

TEST_P(IsaKernel, GradStatsMatchesDoubleAndFindsNonFinite) {
  const Isa isa = GetParam();
  if (!isa_supported(isa)) GTEST_SKIP();
  for (DType gd : kDTypes) {
    for (int64_t n : kSizes) {
      Slice s(n, 5, gd, DType::kFloat32, static_cast<uint32_t>(n) + 11);
      double want = 0;
      for (double g : s.ref_grad()) want += g * g;
      const GradStats got = grad_stats(s.grad_at(), gd, n, isa);
      EXPECT_TRUE(got.finite);
      EXPECT_NEAR(got.sum_sq, want, 1e-5 * want + 1e-12) << dtype_name(gd) << " n " << n;
      if (n > 0) {
        const int64_t at = (12345 + n / 3) % n;  // in the vector body for the larger sizes
        s.set_grad(5 + at, INFINITY);
        EXPECT_FALSE(grad_stats(s.grad_at(), gd, n, isa).finite) << dtype_name(gd) << " inf at " << at;
        s.set_grad(5 + at, 0.5);
        s.set_grad(5 + n - 1, NAN);  // the very last element: the scalar tail
        EXPECT_FALSE(grad_stats(s.grad_at(), gd, n, isa).finite) << dtype_name(gd) << " n " << n;
      }
    }
  }
}

TEST_P(IsaKernel, CastsRoundToNearestEvenWithSpecialValues) {
  const Isa isa = GetParam();
  if (!isa_supported(isa)) GTEST_SKIP();
  std::vector<float> src = {0.0f, -0.0f, 1.0f, -2.5f, INFINITY, -INFINITY, NAN, 65504.0f, 65520.0f, 1e-8f,
                            6e-5f, -3e-7f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 1.0f + 1.0f / 2048, 3.0e38f};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  while (src.size() < 4099) src.push_back(normal(rng));
  const int64_t n = static_cast<int64_t>(src.size());
  for (DType to : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> half(n);
    cast(src.data(), DType::kFloat32, half.data(), to, n, isa);
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(src[i])) {
        const float back = to == DType::kBFloat16 ? ref_bf16_to_float(half[i]) : ref_fp16_to_float(half[i]);
        EXPECT_TRUE(std::isnan(back)) << dtype_name(to) << " NaN at " << i;
        continue;
      }
      ASSERT_EQ(half[i], ref_round(src[i], to)) << dtype_name(to) << " of " << src[i] << " at " << i;
    }
    std::vector<float> back(n);
    cast(half.data(), to, back.data(), DType::kFloat32, n, isa);
    for (int64_t i = 0; i < n; ++i) {
      const float want = to == DType::kBFloat16 ? ref_bf16_to_float(half[i]) : ref_fp16_to_float(half[i]);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(back[i]));
      } else {
        ASSERT_EQ(back[i], want) << i;
      }
    }
    // Half to half goes through fp32 exactly.
    const DType other = to == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
    std::vector<uint16_t> other_bits(n);
    cast(half.data(), to, other_bits.data(), other, n, isa);
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(back[i])) continue;
      ASSERT_EQ(other_bits[i], ref_round(back[i], other)) << i;
    }
  }
}

TEST_P(IsaKernel, ThreadCountDoesNotChangeResults) {
  const Isa isa = GetParam();
  if (!isa_supported(isa)) GTEST_SKIP();
  Slice a((1 << 20) + 7, 1, DType::kBFloat16, DType::kBFloat16, 3);
  Slice b = a;
  set_kernel_threads(1);
  adam_step(AdamParams{}, a.spans(), isa);
  set_kernel_threads(3);
  adam_step(AdamParams{}, b.spans(), isa);
  set_kernel_threads(2);
  EXPECT_EQ(a.master, b.master);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.copy, b.copy);
}

TEST_P(IsaKernel, LargeFiniteGradientsAreNotOverflow) {
  const Isa isa = GetParam();
  if (!isa_supported(isa)) GTEST_SKIP();
  std::vector<float> g(1000, 3.0e38f);  // each finite; their squares are not, in fp32
  const GradStats big = grad_stats(g.data(), DType::kFloat32, 1000, isa);
  EXPECT_TRUE(big.finite);
  EXPECT_NEAR(big.sum_sq, 1000 * 9.0e76, 1e-6 * 1000 * 9.0e76) << "the overflowing block is summed in fp64";
  g[999] = -INFINITY;
  EXPECT_FALSE(grad_stats(g.data(), DType::kFloat32, 1000, isa).finite);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, IsaKernel, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

TEST(OptimKernel, BadSpansAreClearErrors) {
  OptimSpans s;
  s.n = 10;
  EXPECT_THROW(adam_step(AdamParams{}, s), Error);
  std::vector<float> w(10), m(10), v(10), g(10);
  s.master = w.data();
  s.grad = g.data();
  s.state0 = m.data();
  s.state1 = v.data();
  s.param_dtype = DType::kBFloat16;
  try {
    adam_step(AdamParams{}, s);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("param_copy"), std::string::npos) << e.message();
  }
  s.param_dtype = DType::kFloat32;
  AdamParams p;
  p.step = 0;
  EXPECT_THROW(adam_step(p, s), Error);
  EXPECT_THROW(clip_coefficient(1.0, 0.0), Error);
  EXPECT_FLOAT_EQ(clip_coefficient(4.0, 1.0), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0f);
}

}  // namespace
}  // namespace strata::kernels
