#include "strata/kernels/isa.h"

#include <cstdlib>

#include "strata/core/enum_names.h"
#include "strata/core/error.h"

namespace strata::kernels {

CpuFeatures detect_cpu_features() {
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  // F16C has no __builtin_cpu_supports name in GCC 12; read CPUID.1:ECX[29].
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
  f.f16c = (ecx >> 29) & 1u;
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  return f;
}

Isa best_isa(const CpuFeatures& f) {
  if (f.avx512f && f.avx512bw && f.avx512vl && f.f16c) return Isa::kAvx512;
  if (f.avx2 && f.fma && f.f16c) return Isa::kAvx2;
  return Isa::kScalar;
}

namespace {
constexpr EnumName<Isa> kIsaNames[] = {{Isa::kAvx512, "avx512"}, {Isa::kAvx2, "avx2"}, {Isa::kScalar, "scalar"}};
}  // namespace

const char* isa_name(Isa isa) { return enum_name(kIsaNames, isa); }

Isa parse_isa(const std::string& name) { return parse_enum(kIsaNames, name, "ISA level"); }

Isa selected_isa() {
  static const Isa selected = [] {
    const Isa best = best_isa(detect_cpu_features());
    const char* env = std::getenv("STRATA_ISA");
    if (env == nullptr || *env == '\0') return best;
    const Isa wanted = parse_isa(env);
    STRATA_CHECK(static_cast<int>(wanted) <= static_cast<int>(best), "STRATA_ISA=", env,
                 " is not supported by this CPU (best available: ", isa_name(best),
                 "); unset it or choose a lower level");
    return wanted;
  }();
  return selected;
}

std::string describe_isa(Isa isa, const CpuFeatures& f) {
  switch (isa) {
    case Isa::kAvx512:
      return std::string("avx512 (avx512f avx512bw avx512vl f16c, ") +
             (f.avx512bf16 ? "native bf16 conversions)" : "bf16 by integer rounding)");
    case Isa::kAvx2:
      return "avx2 (avx2 fma f16c)";
    case Isa::kScalar:
      return "scalar";
  }
  return "unknown";
}

}  // namespace strata::kernels
