#include "strata/kernels/isa.h"

#include <gtest/gtest.h>

#include "strata/core/error.h"

namespace strata::kernels {
namespace {

TEST(Isa, BestLevelFollowsFeatures) {
  CpuFeatures f;
  EXPECT_EQ(best_isa(f), Isa::kScalar);
  f.avx2 = f.fma = true;
  EXPECT_EQ(best_isa(f), Isa::kScalar) << "AVX2 kernels need F16C for fp16/bf16 conversions";
  f.f16c = true;
  EXPECT_EQ(best_isa(f), Isa::kAvx2);
  f.avx512f = f.avx512bw = true;
  EXPECT_EQ(best_isa(f), Isa::kAvx2) << "AVX-512 path needs VL too";
  f.avx512vl = true;
  EXPECT_EQ(best_isa(f), Isa::kAvx512);
}

TEST(Isa, ParseRoundTripsAndRejectsUnknown) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) EXPECT_EQ(parse_isa(isa_name(isa)), isa);
  EXPECT_THROW(parse_isa("sse9"), Error);
}

TEST(Isa, SelectedNeverExceedsWhatTheCpuSupports) {
  const Isa best = best_isa(detect_cpu_features());
  EXPECT_LE(static_cast<int>(selected_isa()), static_cast<int>(best));
}

}  // namespace
}  // namespace strata::kernels
