// The 4- and 8-bit products' activation rounding and inner block at AVX2's width (weight_kernel.cpp includes
// this where the CPU has AVX2 but not AVX-512, and has the codes' layout). A chunk's 64 code bytes a step are
// read as two 32-byte halves, groups 0..7 and 8..15 of the chunk, one int32 lane a group; a chunk with fewer
// than 16 groups (the last of a row whose groups are not a multiple of 16) is read with masked loads, nothing
// past it, and one of at most 8 groups as one half. The same arithmetic as the AVX-512 build: the integer dots are exact, and the float
// sums differ only in their order.
#pragma once

constexpr int kRowsQ8 = 2;  // q8's rows of W at once at batch 1: four accumulators a (row, x row), 16 registers

// acc + per int32 lane the sum of four products of bytes u (4-bit codes, 0..15) by signed bytes s:
// maddubs' pair sums (at most 2 x 15 x 127) cannot saturate
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

inline __m256i first8(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }

// a chunk's code bytes at p for its groups 8 h .. 8 h + 7 (32 bytes, 4 n of them valid: lanes n.. zero, not read)
inline __m256i load_codes(const uint8_t* p, int n) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return n >= 8 ? _mm256_loadu_si256(q) : _mm256_maskload_epi32(reinterpret_cast<const int*>(p), first8(n));
}

// n (0..8) float16 scales at d as float32, lanes n.. zero; nothing past them read
inline __m256 load_scales(const c10::Half* d, int n) {
  if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
  if (n % 2 == 0)  // pairs of float16 as int32 words (SmolLM2's rows end in two groups)
    return _mm256_cvtph_ps(_mm_maskload_epi32(reinterpret_cast<const int*>(d),
                                              _mm_cmpgt_epi32(_mm_set1_epi32(n / 2), _mm_setr_epi32(0, 1, 2, 3))));
  alignas(16) uint16_t b[8] = {};
  std::memcpy(b, d, n * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
}

// eight pair sums of bytes 0..15 (a) and of 16..31 (b) -> the eight groups' sums of four bytes, in order
inline __m256i groups8(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8);  // hadd gives groups 0 1 4 5 2 3 6 7
}

// one group of 32 activations xg -> its codes in order (W bytes each) in words; returns its scale, and
// the codes' sum in qsum (weight_kernel.cpp's round_group, 8 lanes)
template <bool Wide, typename T>
inline float round_group(const T* xg, char* words, int32_t& qsum) {
  constexpr int top = Wide ? 32767 : 127;
  vec::vf v[4];
  for (int i = 0; i < 4; ++i) v[i] = vec::load(xg + 8 * i);
  const float amax = vec::hmax(vec::max(vec::max(vec::abs(v[0]), vec::abs(v[1])), vec::max(vec::abs(v[2]), vec::abs(v[3]))));
  const vec::vf inv = vec::set1(amax > 0 ? top / amax : 0.0f);
  alignas(32) int32_t q[32];
  for (int i = 0; i < 4; ++i) vec::round_i32(q + 8 * i, vec::mul(v[i], inv));
  qsum = 0;
  for (int j = 0; j < 32; ++j) {
    const int32_t c = std::min(std::max(q[j], -top), top);
    qsum += c;
    if (Wide) reinterpret_cast<int16_t*>(words)[j] = static_cast<int16_t>(c);
    else words[j] = static_cast<char>(c);
  }
  return amax / top;
}

// one chunk's groups (gc of them; its halves 0 .. NH - 1 hold them) for R rows of W, added into yacc
template <int M, int R, bool Q8, int NH>
inline void chunk(const Acts& a, int64_t G, const uint8_t* codes, const c10::Half* scales, int64_t n, int64_t c,
                  int64_t gc, __m256 (&yacc)[R][M]) {
  const int64_t row = Q8 ? 32 * G : 16 * G;  // code bytes a row
  const __m256i low4 = _mm256_set1_epi8(15);
  constexpr int Q = Q8 ? 2 * NH : NH;  // int32 accumulators a (row, x row): q8's pair sums of bytes 16 q .. 16 q + 15
  const int live[2] = {static_cast<int>(std::min<int64_t>(gc, 8)), static_cast<int>(std::max<int64_t>(gc - 8, 0))};
  __m256i acc[R][M][Q];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int q = 0; q < Q; ++q) acc[r][m][q] = _mm256_setzero_si256();
  for (int t = 0; t < 8; t += Q8 ? 1 : 2) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = codes + (n + r) * row + c * (Q8 ? 512 : 256) + 4 * gc * (Q8 ? t : t / 2);
      __m256i v[NH];
      for (int h = 0; h < NH; ++h) v[h] = load_codes(p + 32 * h, live[h]);
      if (Q8) {  // 16-bit activations: pair sums of bytes 16 q .. 16 q + 15 in acc[..][q]
        __m256i u[Q];
        for (int h = 0; h < NH; ++h) {
          u[2 * h] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v[h]));
          u[2 * h + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v[h], 1));
        }
        for (int m = 0; m < M; ++m) {
          const __m256i* xs = static_cast<const __m256i*>(a.codes(m, c, t));
          for (int q = 0; q < Q; ++q)
            acc[r][m][q] = _mm256_add_epi32(acc[r][m][q], _mm256_madd_epi16(u[q], _mm256_load_si256(xs + q)));
        }
      } else {
        __m256i lo[NH], hi[NH];
        for (int h = 0; h < NH; ++h) {
          lo[h] = _mm256_and_si256(v[h], low4);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v[h], 4), low4);
        }
        for (int m = 0; m < M; ++m) {
          const __m256i* xl = static_cast<const __m256i*>(a.codes(m, c, t));
          const __m256i* xh = static_cast<const __m256i*>(a.codes(m, c, t + 1));
          for (int h = 0; h < NH; ++h) {
            acc[r][m][h] = dot4(acc[r][m][h], lo[h], _mm256_load_si256(xl + h));
            acc[r][m][h] = dot4(acc[r][m][h], hi[h], _mm256_load_si256(xh + h));
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const c10::Half* d = scales + (n + r) * G * (Q8 ? 1 : 2) + 16 * c;
    for (int h = 0; h < NH; ++h) {
      const __m256 dv = load_scales(d + 8 * h, live[h]);
      const __m256 lv = Q8 ? dv : load_scales(d + G + 8 * h, live[h]);
      for (int m = 0; m < M; ++m) {
        __m256i dot = Q8 ? groups8(acc[r][m][2 * h], acc[r][m][2 * h + 1]) : acc[r][m][h];
        if (Q8)  // codes + 128
          dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(a.csum(m, c) + 8 * h)), 7));
        const __m256 f = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(dot));
        yacc[r][m] = _mm256_fmadd_ps(f, _mm256_load_ps(a.scale(m, c) + 8 * h), yacc[r][m]);
        if (!Q8) yacc[r][m] = _mm256_fmadd_ps(lv, _mm256_load_ps(a.xsum(m, c) + 8 * h), yacc[r][m]);
      }
    }
  }
}

// y[m, n .. n + R) for R rows of W over every chunk (weight_kernel.cpp's block): a chunk of at most 8 groups
// (a row's last, where its groups are not a multiple of 16) reads and multiplies one half
template <int M, int R, bool Q8>
inline void block(const Acts& a, int64_t K, const uint8_t* codes, const c10::Half* scales, float* y, int64_t N,
                  int64_t n) {
  const int64_t G = K / 32;
  __m256 yacc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) yacc[r][m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < a.chunks; ++c) {
    const int64_t gc = std::min<int64_t>(16, G - 16 * c);
    if (gc > 8) chunk<M, R, Q8, 2>(a, G, codes, scales, n, c, gc, yacc);
    else chunk<M, R, Q8, 1>(a, G, codes, scales, n, c, gc, yacc);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n + r] = vec::sum(yacc[r][m]);
}
