// Decode-sized products with group-quantized weights kept packed (models/packed.py int4): x [M, K] float32
// times W^T, W [N, K] held as codes in groups of 32 inputs, read once per call and widened in registers.
// A decode step reads every weight once, so it streams the codes (0.5 or 1 byte a weight, plus a half-
// precision scale per group) rather than float32 values; the products accumulate in float32, with the
// activations as they are (no rounding to bfloat16).
//   q4: codes [N, K/2] uint8, a group's 16 bytes holding its inputs j (low nibble) and j + 16 (high);
//       dm [N, K/32, 2] float16 (scale, low): w = low + code * scale (GGUF's Q4_1 group).
//   q8: codes [N, K] int8; d [N, K/32] float16: w = code * d (GGUF's Q8_0 group).
// Rows of W are split over the threads; each thread widens a group once for all M rows of x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kMaxRows = 8;  // rows of x a call takes (decode batches); more: the caller dequantizes

// one group of 32 weights as two 16-lane float vectors; scale and low from a float buffer (a load each)
inline void widen_q4(const uint8_t* q, const float* sl, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));  // 16 bytes
  const __m512 s = _mm512_set1_ps(sl[0]), m = _mm512_set1_ps(sl[1]);
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), s, m);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, m);
}

inline void widen_q8(const int8_t* q, const float* sl, __m512& lo, __m512& hi) {
  const __m512 s = _mm512_set1_ps(sl[0]);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), s);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), s);
}

constexpr int64_t kChunk = 16;  // groups whose float16 scales are widened together (one vector op per 16 values)

// float16 h[0, n) -> float f[0, n), n <= 2 * kChunk
inline void widen_scales(const c10::Half* h, int64_t n, float* f) {
  for (int64_t i = 0; i < n; i += 16) {
    if (n - i >= 16) {
      _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
    } else {
      for (int64_t j = i; j < n; ++j) f[j] = _cvtsh_ss(h[j].x);
    }
  }
}

// y[m, n .. n + R) for R rows of W: each group of each row widened once and multiplied into all M rows
// of x, with a low and a high accumulator per (row, m) so that no one chain of FMAs bounds the loop
template <int M, int R, bool Q8>
inline void block(const float* x, int64_t K, const void* codes, const c10::Half* scales, float* y, int64_t N,
                  int64_t n) {
  constexpr int S = Q8 ? 1 : 2;  // float16 values a group: scale (and low)
  const int64_t G = K / 32;
  __m512 lo_acc[R][M], hi_acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) lo_acc[r][m] = hi_acc[r][m] = _mm512_setzero_ps();
  alignas(64) float sl[R][S * kChunk];
  for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
    const int64_t g1 = std::min(G, g0 + kChunk);
    for (int r = 0; r < R; ++r) widen_scales(scales + ((n + r) * G + g0) * S, (g1 - g0) * S, sl[r]);
    for (int64_t g = g0; g < g1; ++g) {
      for (int r = 0; r < R; ++r) {
        __m512 lo, hi;
        if (Q8) {
          widen_q8(static_cast<const int8_t*>(codes) + (n + r) * K + g * 32, sl[r] + (g - g0) * S, lo, hi);
        } else {
          widen_q4(static_cast<const uint8_t*>(codes) + (n + r) * (K / 2) + g * 16, sl[r] + (g - g0) * S, lo, hi);
        }
        for (int m = 0; m < M; ++m) {
          const float* xm = x + m * K + g * 32;
          lo_acc[r][m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xm), lo_acc[r][m]);
          hi_acc[r][m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xm + 16), hi_acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[r][m], hi_acc[r][m]));
}

template <int M, bool Q8>
void rows_of(const float* x, int64_t K, const void* codes, const c10::Half* scales, float* y, int64_t N, int64_t n0,
             int64_t n1) {
  constexpr int R = M == 1 ? 4 : M <= 4 ? 2 : 1;  // rows of W at once: independent chains, registers to spare
  int64_t n = n0;
  for (; n + R <= n1; n += R) block<M, R, Q8>(x, K, codes, scales, y, N, n);
  for (; n < n1; ++n) block<M, 1, Q8>(x, K, codes, scales, y, N, n);
}

template <bool Q8>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows && K % 32 == 0, "x: 1..8 rows of whole groups of 32");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kFloat16,
              "codes and float16 scales, contiguous");
  TORCH_CHECK(codes.size(1) == (Q8 ? K : K / 2) && scales.numel() == N * (K / 32) * (Q8 ? 1 : 2), "shapes agree");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const void* cp = codes.data_ptr();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  // about 16k weights a task: a few microseconds of work, enough to pay for a thread's start
  const int64_t grain = std::max<int64_t>(1, 16384 / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows_of<1, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
      case 2: rows_of<2, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
      case 3: rows_of<3, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
      case 4: rows_of<4, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
      case 5: rows_of<5, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
      case 6: rows_of<6, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
      case 7: rows_of<7, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
      default: rows_of<8, Q8>(xp, K, cp, sp, yp, N, n0, n1); break;
    }
  });
  return y;
}

}  // namespace

// x: [M, K] float32 (M <= 8); codes: [N, K/2] uint8; dm: [N, K/32, 2] float16 -> [M, N] float32
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor dm) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "q4 codes: uint8");
  return product<false>(x, codes, dm);
}

// x: [M, K] float32 (M <= 8); codes: [N, K] int8; d: [N, K/32] float16 -> [M, N] float32
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d) {
  TORCH_CHECK(codes.scalar_type() == torch::kInt8, "q8 codes: int8");
  return product<true>(x, codes, d);
}
