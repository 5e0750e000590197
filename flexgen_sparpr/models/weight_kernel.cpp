// Decode-sized products with group-quantized weights kept packed (models/packed.py int4): x [M, K] float32
// times W^T, W [N, K] held as codes in groups of 32 inputs, read once per call. Each group of 32 activations
// is rounded to integer codes with a float scale (x ~ s * xq), so a group's product is an integer dot scaled
// once. The 4-bit projections take 8-bit activation codes, as llama.cpp does (AVX512-VNNI `vpdpbusd`: 64 code
// pairs an instruction); the 8-bit LM head takes 16-bit ones (`vpmaddwd`): its logits' near ties decide the
// token, and 8-bit activations there flip greedy answers that float32 gives (measured on SmolLM2).
//   q4 (GGUF's Q4_1, w = low + code * scale): sum_j w_j x_j = scale * s * sum_j code_j xq_j + low * s * sum_j xq_j
//   q8 (GGUF's Q8_0, w = code * scale):       sum_j w_j x_j = scale * s * sum_j code_j xq_j
// The codes are laid out for it (packed.py `chunked`): a row's groups in chunks of 16, one int32 lane a
// group, each instruction adding four codes of every group of the chunk.
//   q4: codes [N, K/2] uint8; in chunk c (its gc groups), sub-block L (4 gc bytes), byte 4 i + b holds
//       group 16 c + i's codes 8 L + b (low nibble) and 8 L + 4 + b (high); dm [N, 2, K/32] float16: the
//       groups' scales, then their lows.
//   q8: codes [N, K] uint8, code + 128; in chunk c, step t (4 gc bytes), byte 4 i + b is group 16 c + i's
//       code 4 t + b; d [N, K/32] float16. Its activations' codes are 16-bit, laid out alike.
// Rows of W are split over the threads; each thread unpacks a chunk once for all M rows of x. This file holds
// the AVX-512 inner loops; weight_avx2.h the AVX2 ones (simd.h picks the width).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

#if KERNEL_SIMD
namespace {

constexpr int64_t kMaxRows = 8;  // rows of x a call takes (decode batches); more: the caller dequantizes
constexpr int64_t kAhead = 2;  // blocks of rows prefetched ahead (measured: 2 and 4 alike, 8 and 16 worse)

// x [M, K] as the products read it: per row and chunk, 8 steps of 64 code bytes (zero past the chunk's
// groups), and per group its scale s, the sum of its codes and s times it (16 lanes, zero past)
struct Acts {
  int64_t chunks;
  char* q;  // 8-bit codes, or 16-bit (wide)
  float* s;
  float* sum;
  int32_t* qsum;
  int width;  // bytes a code
  const void* codes(int m, int64_t c, int t) const { return q + ((m * chunks + c) * 8 + t) * 64 * width; }
  const float* scale(int m, int64_t c) const { return s + (m * chunks + c) * 16; }
  const float* xsum(int m, int64_t c) const { return sum + (m * chunks + c) * 16; }
  const int32_t* csum(int m, int64_t c) const { return qsum + (m * chunks + c) * 16; }
};

// Acts for M rows of `chunks` chunks, codes W bytes each, in buf (zeroed, 64-byte aligned)
inline Acts acts(int64_t M, int64_t chunks, int W, std::vector<char>& buf) {
  const int64_t lanes = M * chunks * 16, qbytes = M * chunks * 512 * W;
  buf.assign(qbytes + lanes * 12 + 64, 0);
  char* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  Acts a{chunks, base, reinterpret_cast<float*>(base + qbytes), nullptr, nullptr, W};
  a.sum = a.s + lanes;
  a.qsum = reinterpret_cast<int32_t*>(a.sum + lanes);
  return a;
}

#if KERNEL_SIMD == 512
// lo, hi: 16 int32 pair sums each, of 64 bytes' products 0..31 and 32..63 -> per lane i the sum of bytes 4 i .. 4 i + 3
inline __m512i pairs(__m512i lo, __m512i hi) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_permutex2var_epi32(lo, even, hi), _mm512_permutex2var_epi32(lo, odd, hi));
}

// acc + per int32 lane the sum of four products of unsigned bytes u by signed bytes s
inline __m512i dot4(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // no VNNI: widen to 16 bits (maddubs would saturate), pair sums, then pairs of pairs
  const __m512i plo = _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(u)),
                                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(s)));
  const __m512i phi = _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(u, 1)),
                                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(s, 1)));
  return _mm512_add_epi32(acc, pairs(plo, phi));
#endif
}

// 16 activations from p: float32, or bfloat16 widened (a float32's top half)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// one group of 32 activations xg -> its codes in order (W bytes each) in words; returns its scale, and
// the codes' sum in qsum
template <bool Wide, typename T>
inline float round_group(const T* xg, char* words, int32_t& qsum) {
  constexpr float top = Wide ? 32767.0f : 127.0f;
  const __m512 lo = load16(xg), hi = load16(xg + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 inv = _mm512_set1_ps(amax > 0 ? top / amax : 0.0f);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  if (Wide) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(words), _mm512_cvtsepi32_epi16(qlo));
    _mm256_store_si256(reinterpret_cast<__m256i*>(words + 32), _mm512_cvtsepi32_epi16(qhi));
  } else {
    _mm_store_si128(reinterpret_cast<__m128i*>(words), _mm512_cvtsepi32_epi8(qlo));
    _mm_store_si128(reinterpret_cast<__m128i*>(words + 16), _mm512_cvtsepi32_epi8(qhi));
  }
  qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  return amax / top;
}

// y[m, n .. n + R) for R rows of W over every chunk: the integer dots of a chunk in one int32 vector a
// (row, m), scaled into a float accumulator per (row, m)
template <int M, int R, bool Q8>
inline void block(const Acts& a, int64_t K, const uint8_t* codes, const c10::Half* scales, float* y, int64_t N,
                  int64_t n) {
  const int64_t G = K / 32, row = Q8 ? K : K / 2;  // code bytes a row
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 yacc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) yacc[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < a.chunks; ++c) {
    const int64_t gc = std::min<int64_t>(16, G - 16 * c);
    const __mmask64 bytes = gc == 16 ? ~__mmask64(0) : (__mmask64(1) << (4 * gc)) - 1;
    const __mmask16 lanes = static_cast<__mmask16>((1u << gc) - 1);
    __m512i acc[R][M], acc2[R][M];  // acc2: q8's second half (unused by q4)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_si512();
    if (Q8)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc2[r][m] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += Q8 ? 1 : 2) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = codes + (n + r) * row + c * (Q8 ? 512 : 256) + 4 * gc * (Q8 ? t : t / 2);
        const __m512i v = _mm512_maskz_loadu_epi8(bytes, p);
        if (Q8) {  // 16-bit activations: pair sums of bytes 0..31 in acc, of 32..63 in acc2
          const __m512i u0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v));
          const __m512i u1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1));
          for (int m = 0; m < M; ++m) {
            const __m512i* xs = static_cast<const __m512i*>(a.codes(m, c, t));
            acc[r][m] = _mm512_add_epi32(acc[r][m], _mm512_madd_epi16(u0, _mm512_load_si512(xs)));
            acc2[r][m] = _mm512_add_epi32(acc2[r][m], _mm512_madd_epi16(u1, _mm512_load_si512(xs + 1)));
          }
        } else {
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int m = 0; m < M; ++m) {
            acc[r][m] = dot4(acc[r][m], lo, _mm512_load_si512(static_cast<const __m512i*>(a.codes(m, c, t))));
            acc[r][m] = dot4(acc[r][m], hi, _mm512_load_si512(static_cast<const __m512i*>(a.codes(m, c, t + 1))));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const c10::Half* d = scales + (n + r) * G * (Q8 ? 1 : 2) + 16 * c;
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, d));
      const __m512 lv = Q8 ? dv : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, d + G));
      for (int m = 0; m < M; ++m) {
        __m512i dot = Q8 ? pairs(acc[r][m], acc2[r][m]) : acc[r][m];
        if (Q8) dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(_mm512_load_si512(a.csum(m, c)), 7));  // codes + 128
        const __m512 f = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(dot));
        yacc[r][m] = _mm512_fmadd_ps(f, _mm512_load_ps(a.scale(m, c)), yacc[r][m]);
        if (!Q8) yacc[r][m] = _mm512_fmadd_ps(lv, _mm512_load_ps(a.xsum(m, c)), yacc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n + r] = _mm512_reduce_add_ps(yacc[r][m]);
}

#else
#include "weight_avx2.h"
#endif

// x [M, K] rounded a group at a time (round_group) into the Acts layout
template <bool Wide, typename T>
Acts quantize(const T* x, int64_t M, int64_t K, std::vector<char>& buf) {
  constexpr int W = Wide ? 2 : 1;
  const int64_t G = K / 32, chunks = (G + 15) / 16;
  Acts a = acts(M, chunks, W, buf);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      alignas(64) char words[32 * W];  // the group's codes 4 t .. 4 t + 3 at 4 t W
      int32_t qsum;
      const float scale = round_group<Wide>(x + m * K + g * 32, words, qsum);
      const int64_t c = g / 16, i = g % 16, lane = (m * chunks + c) * 16 + i;
      for (int t = 0; t < 8; ++t)
        std::memcpy(a.q + (((m * chunks + c) * 8 + t) * 64 + 4 * i) * W, words + 4 * t * W, 4 * W);
      a.s[lane] = scale;
      a.qsum[lane] = qsum;
      a.sum[lane] = scale * static_cast<float>(qsum);  // the rounded x's sum: errors stay w's size
    }
  }
  return a;
}

template <int M, bool Q8>
void rows_of(const Acts& a, int64_t K, const uint8_t* codes, const c10::Half* scales, float* y, int64_t N, int64_t n0,
             int64_t n1) {
  // rows of W at once: independent chains, registers to spare (AVX2 has half AVX-512's registers)
#if KERNEL_SIMD == 512
  constexpr int R = M == 1 ? 4 : M <= 4 ? 2 : 1;
#else
  constexpr int R = M == 1 ? (Q8 ? kRowsQ8 : 4) : M <= 2 ? 2 : 1;
#endif
  int64_t n = n0;
  const int64_t row = Q8 ? K : K / 2, srow = (K / 32) * (Q8 ? 2 : 4);  // code and scale bytes a row
  for (; n + R <= n1; n += R) {
    // the rows kAhead blocks on, asked of memory now: the hardware's prefetcher alone leaves the
    // kernel at about half of what one core streams from memory
    const int64_t ahead = std::min(n + kAhead * R, n1 - R);
    const char* pc = reinterpret_cast<const char*>(codes + ahead * row);
    const char* ps = reinterpret_cast<const char*>(scales) + ahead * srow;
    for (int64_t off = 0; off < R * row; off += 64) _mm_prefetch(pc + off, _MM_HINT_T0);
    for (int64_t off = 0; off < R * srow; off += 64) _mm_prefetch(ps + off, _MM_HINT_T0);
    block<M, R, Q8>(a, K, codes, scales, y, N, n);
  }
  for (; n < n1; ++n) block<M, 1, Q8>(a, K, codes, scales, y, N, n);
}

template <bool Q8>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x: contiguous float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows && K % 32 == 0, "x: 1..8 rows of whole groups of 32");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && scales.is_contiguous() &&
              scales.scalar_type() == torch::kFloat16, "uint8 codes and float16 scales, contiguous");
  TORCH_CHECK(codes.size(1) == (Q8 ? K : K / 2) && scales.numel() == N * (K / 32) * (Q8 ? 1 : 2), "shapes agree");
  thread_local std::vector<char> buf;
  const bool bf = x.scalar_type() == torch::kBFloat16;  // a bfloat16 run's rows: widened as they are rounded
  const Acts a = bf ? quantize<Q8>(x.data_ptr<c10::BFloat16>(), M, K, buf) : quantize<Q8>(x.data_ptr<float>(), M, K, buf);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  // about 16k weights a task: a few microseconds of work, enough to pay for a thread's start
  const int64_t grain = std::max<int64_t>(4, 16384 / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows_of<1, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
      case 2: rows_of<2, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
      case 3: rows_of<3, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
      case 4: rows_of<4, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
      case 5: rows_of<5, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
      case 6: rows_of<6, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
      case 7: rows_of<7, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
      default: rows_of<8, Q8>(a, K, cp, sp, yp, N, n0, n1); break;
    }
  });
  if (!bf) return y;
  auto yb = torch::empty({M, N}, x.options());  // one rounding of the float32 sums
  c10::BFloat16* bp = yb.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < M * N; ++i) bp[i] = static_cast<c10::BFloat16>(yp[i]);
  return yb;
}

}  // namespace
#endif

// x: [M, K] float32 or bfloat16 (M <= 8); codes: [N, K/2] uint8 (chunked); dm: [N, 2, K/32] float16 -> [M, N] x's dtype
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor dm) {
#if KERNEL_SIMD
  return product<false>(x, codes, dm);
#else
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
#endif
}

// x: [M, K] float32 or bfloat16 (M <= 8); codes: [N, K] uint8 (chunked, code + 128); d: [N, K/32] float16 -> [M, N] x's dtype
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d) {
#if KERNEL_SIMD
  return product<true>(x, codes, d);
#else
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
#endif
}

// x: [M, K] float32 -> its codes per group of 32 as the products round them: (codes [M, K] int16, scales
// [M, K/32] float32), 8-bit (the 4-bit projections') or 16-bit (wide: the 8-bit head's), for tests
std::vector<torch::Tensor> quantize_rows(torch::Tensor x, bool wide) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) % 32 == 0,
              "x: contiguous float32 [M, K], K a multiple of 32");
#if !KERNEL_SIMD
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
#else
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  std::vector<char> buf;
  const float* xp = x.data_ptr<float>();
  const Acts a = wide ? quantize<true>(xp, M, K, buf) : quantize<false>(xp, M, K, buf);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt16));
  auto s = torch::empty({M, G}, x.options());
  auto qa = q.accessor<int16_t, 2>();
  auto sa = s.accessor<float, 2>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      sa[m][g] = a.scale(m, g / 16)[g % 16];
      for (int j = 0; j < 32; ++j) {
        const int64_t at = 4 * (g % 16) + j % 4;
        const void* p = a.codes(m, g / 16, j / 4);
        qa[m][g * 32 + j] = wide ? static_cast<const int16_t*>(p)[at] : static_cast<const int8_t*>(p)[at];
      }
    }
  return {q, s};
#endif
}
