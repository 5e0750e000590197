// The compiled kernels' float vector, one width per build (models/cpu_kernel.py builds with -march=native):
// 16 lanes where the CPU has AVX-512F, 8 where it has AVX2, FMA and F16C (AMD Zen 2/3, Intel's client
// cores since Alder Lake). The kernels written on it (attention, the low-rank scores, bfloat16 products,
// activation rounding) are one source for both; the integer dot products (weight_kernel.cpp) are written
// per width. KERNEL_SIMD is 512, 256 or 0 (neither: the kernels refuse, the torch paths run).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#define KERNEL_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KERNEL_SIMD 256
#else
#define KERNEL_SIMD 0
#endif

#if KERNEL_SIMD
namespace vec {

#if KERNEL_SIMD == 512
constexpr int kLanes = 16;
using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {  // bfloat16 is float32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void store(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c
inline vf fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf abs(vf a) { return _mm512_abs_ps(a); }
inline vf round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
inline float sum(vf a) { return _mm512_reduce_add_ps(a); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a); }
inline vf pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral
inline vf zero_where_le(vf x, vf a, float at) {  // x, with its lanes where a <= at zero
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(at), _CMP_LE_OQ), x, _mm512_setzero_ps());
}
inline vf load_n(const float* p, int n) {  // lanes n.. zero, not read
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline vf widen_n(const uint16_t* p, int n) {  // n bfloat16 as float32, lanes n.. zero, not read
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p)), 16));
}
inline vf from_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline vf from_u8_hi(const uint8_t* p) {  // the high nibbles of kLanes bytes
  return _mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)), 4));
}
inline void round_i32(int32_t* out, vf x) { _mm512_storeu_si512(out, _mm512_cvtps_epi32(x)); }  // nearest, ties even
#else
constexpr int kLanes = 8;
using vf = __m256;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline vf round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float sum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf pow2(vf p, vf n) {  // n in [-126, 127] here: 2^n built in the exponent bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf zero_where_le(vf x, vf a, float at) {
  return _mm256_andnot_ps(_mm256_cmp_ps(a, _mm256_set1_ps(at), _CMP_LE_OQ), x);
}
inline __m256i first_n(int n) {  // lanes 0..n-1 all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load_n(const float* p, int n) { return _mm256_maskload_ps(p, first_n(n)); }
inline vf widen_n(const uint16_t* p, int n) {
  alignas(16) uint16_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(b, p, n * sizeof(uint16_t));
  return load(reinterpret_cast<const c10::BFloat16*>(b));
}
inline vf from_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline vf from_u8_hi(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)), 4));
}
inline void round_i32(int32_t* out, vf x) { _mm256_storeu_si256((__m256i*)out, _mm256_cvtps_epi32(x)); }
#endif

// e^x (x <= 0 here: a logit less its row's max): 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by
// its Taylor series to r^7 (relative error under 2e-7); below -87 it is 0 as float32's exp gives
inline vf exp(vf x) {
  x = max(x, set1(-87.f));
  const vf n = round(mul(x, set1(1.44269504f)));
  vf r = fnma(n, set1(0.693145752f), x);  // ln 2 in two parts: exact n ln2_hi
  r = fnma(n, set1(1.42860677e-6f), r);
  vf p = set1(1.f / 5040);
  p = fma(p, r, set1(1.f / 720));
  p = fma(p, r, set1(1.f / 120));
  p = fma(p, r, set1(1.f / 24));
  p = fma(p, r, set1(1.f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.f));
  p = fma(p, r, set1(1.f));
  return zero_where_le(pow2(p, n), x, -87.f);
}

}  // namespace vec
#endif
