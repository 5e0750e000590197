// SparPR's low-rank block scores on a CPU with AVX-512 (kv/policies/sparpr_lowrank.py, head_score
// "softmax"): per sequence, KV head and query head, q . k~ of every sealed token from its 4-bit codes
// (two a byte, tokens innermost), the softmax over the tokens, and each block's share of it, summed
// over the heads: one call a layer where torch takes about fifteen. Float32 throughout (the torch path
// multiplies in bfloat16).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr float kLow = -1e30f;  // a padded token's logit: finite, as -ffast-math's vector exp needs
constexpr int kMaxG = 8;
constexpr int64_t kChunk = 512;  // tokens a thread's work item scores (a multiple of 16)

// e^x, 16 lanes (x <= 0 here: a logit less the row's max): 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2,
// e^r by its Taylor series to r^7 (relative error under 2e-7); below -87 it is 0 as float32's exp gives
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts: exact n ln2_hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512 e = _mm512_scalef_ps(p, n);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LE_OQ), e, _mm512_setzero_ps());
}

// logits [G, T] of one (sequence, KV head): qs [G, r] (r = 2 half), codes [half, T] with row stride cs.
// G is a template argument so that the G sums stay in registers (a runtime G spilled them: 2x slower)
template <int G>
void logits_g(const float* qs, int half, const uint8_t* codes, int64_t cs, int64_t T, const float* bias,
              float* out, int64_t os) {
  int64_t t0 = 0;
  const __m512i low4 = _mm512_set1_epi32(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (; t0 + 16 <= T; t0 += 16) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int i = 0; i < half; ++i) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + i * cs + t0)));
      const __m512 lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(x, low4)), eight);
      const __m512 hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), eight);
      for (int g = 0; g < G; ++g) {
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * 2 * half + 2 * i]), lo, acc[g]);
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * 2 * half + 2 * i + 1]), hi, acc[g]);
      }
    }
    if (bias) {
      const __m512 b = _mm512_max_ps(_mm512_loadu_ps(bias + t0), _mm512_set1_ps(kLow));
      for (int g = 0; g < G; ++g) acc[g] = _mm512_add_ps(acc[g], b);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + g * os + t0, acc[g]);
  }
  for (int64_t t = t0; t < T; ++t) {  // the tail, a token at a time
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      for (int i = 0; i < half; ++i) {
        const int c = codes[i * cs + t];
        s += qs[g * 2 * half + 2 * i] * ((c & 15) - 8) + qs[g * 2 * half + 2 * i + 1] * ((c >> 4) - 8);
      }
      out[g * os + t] = bias ? s + std::max(bias[t], kLow) : s;
    }
  }
}

// logits [G, T] (row stride os) of one (sequence, KV head)'s T tokens
void logits(const float* qs, int G, int half, const uint8_t* codes, int64_t cs, int64_t T, const float* bias,
            float* out, int64_t os) {
  switch (G) {
    case 1: return logits_g<1>(qs, half, codes, cs, T, bias, out, os);
    case 2: return logits_g<2>(qs, half, codes, cs, T, bias, out, os);
    case 3: return logits_g<3>(qs, half, codes, cs, T, bias, out, os);
    case 4: return logits_g<4>(qs, half, codes, cs, T, bias, out, os);
    case 5: return logits_g<5>(qs, half, codes, cs, T, bias, out, os);
    case 6: return logits_g<6>(qs, half, codes, cs, T, bias, out, os);
    case 7: return logits_g<7>(qs, half, codes, cs, T, bias, out, os);
    default: return logits_g<8>(qs, half, codes, cs, T, bias, out, os);
  }
}

}  // namespace
#endif

// qs: [B, Hkv, G, r] float32 contiguous (each query head's coordinates, scaled by the steps and 1 / sqrt(D));
// codes: [B, Hkv, r / 2, T] uint8, tokens contiguous (even direction low nibble, odd high; code - 8 steps);
// bias: [B, T] float32 contiguous, 0 or -inf (left padding), or None; bs: tokens a block (T = nb bs).
// Returns [B, nb] float32: each block's share of each query head's softmax over the T tokens, summed over
// the query heads.
torch::Tensor lowrank_scores(torch::Tensor qs, torch::Tensor codes, c10::optional<torch::Tensor> bias, int64_t bs) {
#if defined(__AVX512F__)
  TORCH_CHECK(qs.scalar_type() == torch::kFloat32 && qs.is_contiguous() && qs.dim() == 4 && qs.size(2) <= kMaxG,
              "qs: contiguous float32 [B, Hkv, G <= 8, r]");
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.dim() == 4 && codes.stride(3) == 1 &&
                  codes.size(0) == qs.size(0) && codes.size(1) == qs.size(1) && 2 * codes.size(2) == qs.size(3),
              "codes: uint8 [B, Hkv, r / 2, T], T contiguous");
  const int64_t B = qs.size(0), H = qs.size(1), G = qs.size(2), half = codes.size(2), T = codes.size(3);
  const int64_t r = 2 * half;
  TORCH_CHECK(bs >= 1 && T % bs == 0, "T a whole number of blocks");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->dim() == 2 &&
                    bias->size(0) == B && bias->size(1) == T,
                "bias: contiguous float32 [B, T]");
    bp = bias->data_ptr<float>();
  }
  const int64_t nb = T / bs, BH = B * H;
  const float* qp = qs.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  // the logits, in chunks of tokens over the threads (a batch of one has only Hkv sequences x heads)
  auto lgt = torch::empty({BH, G, T}, qs.options());
  float* lg = lgt.data_ptr<float>();
  const int64_t nc = (T + kChunk - 1) / kChunk;
  at::parallel_for(0, BH * nc, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / nc, t0 = (i % nc) * kChunk, n = std::min(kChunk, T - t0), b = bh / H, h = bh % H;
      logits(qp + bh * G * r, G, half, cp + b * codes.stride(0) + h * codes.stride(1) + t0, codes.stride(2), n,
             bp ? bp + b * T + t0 : nullptr, lg + bh * G * T + t0, T);
    }
  });
  // each (sequence, KV head, query head)'s softmax over the tokens, summed by block (16 lanes at a time:
  // the compiler's exp over this loop ran scalar, ten times the logits' cost)
  auto mass = torch::empty({BH, G, nb}, qs.options());
  float* mp = mass.data_ptr<float>();
  at::parallel_for(0, BH * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* x = lg + row * T;
      float* out = mp + row * nb;
      const int64_t T16 = T / 16 * 16;
      __m512 vtop = _mm512_set1_ps(kLow);
      for (int64_t t = 0; t < T16; t += 16) vtop = _mm512_max_ps(vtop, _mm512_loadu_ps(x + t));
      float top = _mm512_reduce_max_ps(vtop);
      for (int64_t t = T16; t < T; ++t) top = std::max(top, x[t]);
      const __m512 vt = _mm512_set1_ps(top);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t = 0; t < T16; t += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + t), vt));
        _mm512_storeu_ps(x + t, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      float sum = _mm512_reduce_add_ps(vsum);
      for (int64_t t = T16; t < T; ++t) {
        x[t] = std::exp(x[t] - top);
        sum += x[t];
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int64_t k = 0; k < nb; ++k) {
        const float* xb = x + k * bs;
        float s = 0.f;
        int64_t t = 0;
        if (bs % 16 == 0) {
          __m512 a = _mm512_setzero_ps();
          for (; t < bs; t += 16) a = _mm512_add_ps(a, _mm512_loadu_ps(xb + t));
          s = _mm512_reduce_add_ps(a);
        }
        for (; t < bs; ++t) s += xb[t];
        out[k] = s * inv;
      }
    }
  });
  // summed over the query heads in their order, then over the KV heads
  auto partial = torch::empty({B, H, nb}, qs.options());
  float* pp = partial.data_ptr<float>();
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t k = 0; k < nb; ++k) {
      float s = mp[bh * G * nb + k];
      for (int64_t g = 1; g < G; ++g) s += mp[(bh * G + g) * nb + k];
      pp[bh * nb + k] = s;
    }
  return partial.sum(1);
#else
  TORCH_CHECK(false, "built without AVX-512");
#endif
}
