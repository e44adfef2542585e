#pragma once
// The SIMD level CPU kernels dispatch on. It is chosen once per process, on
// first use: the best level the CPU and OS support, lowered (never raised) by
// STRATA_ISA=avx512|avx2|scalar so that every path can be tested on one machine.

#include <string>

namespace strata::kernels {

enum class Isa : int {
  kScalar = 0,  // portable C++ loops
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL (+ BF16 conversions when avx512_bf16 is present)
};

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
};

/// What the CPU reports (cpuid, via the compiler's builtins).
CpuFeatures detect_cpu_features();

/// The best level `features` supports.
Isa best_isa(const CpuFeatures& features);

/// The level kernels use in this process: best_isa(), lowered by STRATA_ISA.
/// Throws strata::Error when STRATA_ISA names an unknown level or one the CPU lacks.
Isa selected_isa();

/// Parses "avx512" / "avx2" / "scalar".
Isa parse_isa(const std::string& name);

const char* isa_name(Isa isa);

/// A one-line description, e.g. "avx512 (avx512f avx512bw avx512vl, native bf16)".
std::string describe_isa(Isa isa, const CpuFeatures& features);

}  // namespace strata::kernels
