#pragma once
// SIMD vectors of fp32 for the CPU kernels: one struct per ISA with the same
// static interface, so each kernel is written once as a template and
// instantiated per ISA in its own translation unit (compiled with that ISA's
// flags). Elements are stored as float, BF16 or FP16 and always computed in
// fp32. Loads and stores are unaligned: chunks slice tensors at any offset.
//
// VecScalar is the same interface one lane wide; it handles tails and is the
// whole scalar ISA. Its fp16/bf16 conversions are software (round to nearest
// even, NaN kept quiet) and agree bit for bit with the hardware paths.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace strata::kernels::cpu {
// Internal linkage on purpose: each ISA translation unit compiles these with
// its own flags, and one shared (weak) copy could carry AVX-512 code into the
// scalar path.
namespace {

struct BF16 {
  uint16_t bits;
};
struct FP16 {
  uint16_t bits;
};
/// "No compute-precision copy": the fp32 master is the parameter.
struct NoCopy {};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  const float subnormal = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
  return sign ? -subnormal : subnormal;
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (>= 65520)
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: round abs / 2^-24 to an integer, ties to even.
    const float scaled = bits_float(abs) * 16777216.0f;  // exact: power-of-two scale
    const float r = std::nearbyint(scaled);               // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

// ----------------------------------------------------------------------------
struct VecScalar {
  static constexpr int kWidth = 1;
  float v;

  static VecScalar set1(float x) { return {x}; }
  static VecScalar zero() { return {0.0f}; }
  static VecScalar load(const float* p) { return {*p}; }
  static VecScalar load(const BF16* p) { return {bf16_to_float(p->bits)}; }
  static VecScalar load(const FP16* p) { return {fp16_to_float(p->bits)}; }
  static void store(float* p, VecScalar a) { *p = a.v; }
  static void store(BF16* p, VecScalar a) { p->bits = float_to_bf16(a.v); }
  static void store(FP16* p, VecScalar a) { p->bits = float_to_fp16(a.v); }
  static void store(NoCopy*, VecScalar) {}

  friend VecScalar operator+(VecScalar a, VecScalar b) { return {a.v + b.v}; }
  friend VecScalar operator-(VecScalar a, VecScalar b) { return {a.v - b.v}; }
  friend VecScalar operator*(VecScalar a, VecScalar b) { return {a.v * b.v}; }
  friend VecScalar operator/(VecScalar a, VecScalar b) { return {a.v / b.v}; }
  static VecScalar fmadd(VecScalar a, VecScalar b, VecScalar c) { return {a.v * b.v + c.v}; }
  static VecScalar sqrt(VecScalar a) { return {std::sqrt(a.v)}; }
  static VecScalar max(VecScalar a, VecScalar b) { return {a.v > b.v ? a.v : b.v}; }
  /// 1/sqrt(a) for normal positive a; the SIMD versions refine a hardware estimate.
  static VecScalar rsqrt(VecScalar a) { return {1.0f / std::sqrt(a.v)}; }
  static VecScalar rcp(VecScalar a) { return {1.0f / a.v}; }
  /// -1, 0 or +1 (0 for zero and NaN).
  static VecScalar sign(VecScalar a) { return {a.v > 0.0f ? 1.0f : (a.v < 0.0f ? -1.0f : 0.0f)}; }
  static float reduce_add(VecScalar a) { return a.v; }
  static void prefetch(const void*) {}
};

// ----------------------------------------------------------------------------
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct VecAvx2 {
  static constexpr int kWidth = 8;
  __m256 v;

  static VecAvx2 set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecAvx2 zero() { return {_mm256_setzero_ps()}; }
  static VecAvx2 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VecAvx2 load(const BF16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  static VecAvx2 load(const FP16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static void store(float* p, VecAvx2 a) { _mm256_storeu_ps(p, a.v); }
  static void store(BF16* p, VecAvx2 a) {
    const __m256i u = _mm256_castps_si256(a.v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, qnan, is_nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store(FP16* p, VecAvx2 a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store(NoCopy*, VecAvx2) {}

  friend VecAvx2 operator+(VecAvx2 a, VecAvx2 b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend VecAvx2 operator-(VecAvx2 a, VecAvx2 b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend VecAvx2 operator*(VecAvx2 a, VecAvx2 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend VecAvx2 operator/(VecAvx2 a, VecAvx2 b) { return {_mm256_div_ps(a.v, b.v)}; }
  static VecAvx2 fmadd(VecAvx2 a, VecAvx2 b, VecAvx2 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static VecAvx2 sqrt(VecAvx2 a) { return {_mm256_sqrt_ps(a.v)}; }
  static VecAvx2 max(VecAvx2 a, VecAvx2 b) { return {_mm256_max_ps(a.v, b.v)}; }
  // 12-bit estimates plus one Newton-Raphson step (about 22 bits): vdivps and
  // vsqrtps would make the Adam step compute-bound.
  static VecAvx2 rsqrt(VecAvx2 a) {
    const __m256 y = _mm256_rsqrt_ps(a.v);
    const __m256 ayy = _mm256_mul_ps(_mm256_mul_ps(a.v, y), y);
    return {_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), y), _mm256_sub_ps(_mm256_set1_ps(3.0f), ayy))};
  }
  static VecAvx2 rcp(VecAvx2 a) {
    const __m256 y = _mm256_rcp_ps(a.v);
    return {_mm256_mul_ps(y, _mm256_fnmadd_ps(a.v, y, _mm256_set1_ps(2.0f)))};
  }
  static VecAvx2 sign(VecAvx2 a) {
    const __m256 z = _mm256_setzero_ps();
    const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, z, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, z, _CMP_LT_OQ), _mm256_set1_ps(1.0f));
    return {_mm256_sub_ps(pos, neg)};
  }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static float reduce_add(VecAvx2 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif

// ----------------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
struct VecAvx512 {
  static constexpr int kWidth = 16;
  __m512 v;

  static VecAvx512 set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecAvx512 zero() { return {_mm512_setzero_ps()}; }
  static VecAvx512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecAvx512 load(const BF16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static VecAvx512 load(const FP16* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static void store(float* p, VecAvx512 a) { _mm512_storeu_ps(p, a.v); }
  static void store(BF16* p, VecAvx512 a) {
#if defined(__AVX512BF16__)
    // Native conversion: round to nearest even, NaN made quiet.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(a.v));
#else
    const __m512i u = _mm512_castps_si512(a.v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), r, qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  static void store(FP16* p, VecAvx512 a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store(NoCopy*, VecAvx512) {}

  friend VecAvx512 operator+(VecAvx512 a, VecAvx512 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VecAvx512 operator-(VecAvx512 a, VecAvx512 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend VecAvx512 operator*(VecAvx512 a, VecAvx512 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend VecAvx512 operator/(VecAvx512 a, VecAvx512 b) { return {_mm512_div_ps(a.v, b.v)}; }
  static VecAvx512 fmadd(VecAvx512 a, VecAvx512 b, VecAvx512 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static VecAvx512 sqrt(VecAvx512 a) { return {_mm512_sqrt_ps(a.v)}; }
  static VecAvx512 max(VecAvx512 a, VecAvx512 b) { return {_mm512_max_ps(a.v, b.v)}; }
  // 14-bit estimates plus one Newton-Raphson step (about 27 bits), see VecAvx2.
  static VecAvx512 rsqrt(VecAvx512 a) {
    const __m512 y = _mm512_rsqrt14_ps(a.v);
    const __m512 ayy = _mm512_mul_ps(_mm512_mul_ps(a.v, y), y);
    return {_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), y), _mm512_sub_ps(_mm512_set1_ps(3.0f), ayy))};
  }
  static VecAvx512 rcp(VecAvx512 a) {
    const __m512 y = _mm512_rcp14_ps(a.v);
    return {_mm512_mul_ps(y, _mm512_fnmadd_ps(a.v, y, _mm512_set1_ps(2.0f)))};
  }
  static VecAvx512 sign(VecAvx512 a) {
    const __m512 z = _mm512_setzero_ps();
    __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, z, _CMP_GT_OQ), z, _mm512_set1_ps(1.0f));
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, z, _CMP_LT_OQ), r, _mm512_set1_ps(-1.0f))};
  }
  static float reduce_add(VecAvx512 a) { return _mm512_reduce_add_ps(a.v); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
};
#endif

}  // namespace
}  // namespace strata::kernels::cpu
