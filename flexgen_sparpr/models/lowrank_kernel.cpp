// SparPR's low-rank block scores on a CPU with AVX-512 or AVX2 (simd.h; kv/policies/sparpr_lowrank.py, head_score
// "softmax"): per sequence, KV head and query head, the query's coordinates in the KV head's basis,
// q . k~ of every sealed token from its 4-bit codes (two a byte, tokens innermost), the softmax over
// the tokens, and each block's share of it, summed over the heads: one call a layer where torch takes
// about fifteen. Float32 throughout (the torch path multiplies in bfloat16).
// The softmax is taken a work item at a time (the item's max, each block's sum of e^(x - max), then one pass
// over the items' blocks), so a work item's logits stay in a buffer the size of L1 and the codes are read once:
// a layer's codes come from the shared cache after the layer's weights went through (at 8000 tokens
// the call took twice as long in place as alone with a buffer of every logit).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

#if KERNEL_SIMD
namespace {

using vec::kLanes;
using vec::vf;

constexpr float kLow = -1e30f;  // a padded token's logit: finite, as -ffast-math's vector exp needs
constexpr int kMaxG = 8;
constexpr int64_t kChunk = 512;  // tokens a thread's work item scores, at least (whole blocks)
constexpr int64_t kAheadBytes = 512;  // how far ahead of the tokens scored each code row is prefetched

// logits [G, T] of one (sequence, KV head), less a constant per query head (8 times its coordinates' sum:
// the codes' offset, which the softmax over the tokens does not see): qs [G, r] (r = 2 half) as pairs
// (qe, qo - 16 qe) of each byte's even and odd direction, so that qe lo + qo hi = qe v + (qo - 16 qe) hi
// with v the byte (two conversions a byte); codes [half, T] with row stride cs.
// G is a template argument so that the G sums stay in registers (a runtime G spilled them: 2x slower)
template <int G>
void logits_g(const float* qs, int half, const uint8_t* codes, int64_t cs, int64_t T, const float* bias,
              float* out, int64_t os) {
  int64_t t0 = 0;
  for (; t0 + kLanes <= T; t0 += kLanes) {
    if (t0 % 64 == 0)  // the r / 2 rows are strided streams too short for the hardware's prefetcher
      for (int i = 0; i < half; ++i) _mm_prefetch(reinterpret_cast<const char*>(codes + i * cs + t0 + kAheadBytes), _MM_HINT_T0);
    vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = vec::zero();
    for (int i = 0; i < half; ++i) {
      const vf v = vec::from_u8(codes + i * cs + t0), hi = vec::from_u8_hi(codes + i * cs + t0);
      for (int g = 0; g < G; ++g) {
        acc[g] = vec::fma(vec::set1(qs[g * 2 * half + 2 * i]), v, acc[g]);
        acc[g] = vec::fma(vec::set1(qs[g * 2 * half + 2 * i + 1]), hi, acc[g]);
      }
    }
    if (bias) {
      const vf b = vec::max(vec::load(bias + t0), vec::set1(kLow));
      for (int g = 0; g < G; ++g) acc[g] = vec::add(acc[g], b);
    }
    for (int g = 0; g < G; ++g) vec::store(out + g * os + t0, acc[g]);
  }
  for (int64_t t = t0; t < T; ++t) {  // the tail, a token at a time
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      for (int i = 0; i < half; ++i) {
        const int c = codes[i * cs + t];
        s += qs[g * 2 * half + 2 * i] * c + qs[g * 2 * half + 2 * i + 1] * (c >> 4);
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

// a work item's logits x [n] (n a whole number of blocks of bs) -> each block's sum of e^(x - m) in s_out, m the
// item's max (returned): one max over the item, not one a block (a horizontal max per block cost as much as the
// logits at 16 tokens a block); a block's terms that underflow against m would underflow against the row's max
// in the merge as well
inline float chunk_stats(const float* x, int64_t n, int64_t bs, float* s_out) {
  vf vm = vec::set1(kLow);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) vm = vec::max(vm, vec::load(x + t));
  float m = vec::hmax(vm);
  for (int64_t j = t; j < n; ++j) m = std::max(m, x[j]);
  const vf vt = vec::set1(m);
  for (int64_t b0 = 0; b0 < n; b0 += bs) {
    vf vs = vec::zero();
    int64_t j = b0;
    for (; j + kLanes <= b0 + bs; j += kLanes) vs = vec::add(vs, vec::exp(vec::sub(vec::load(x + j), vt)));
    float s = vec::sum(vs);
    for (; j < b0 + bs; ++j) s += x[j] - m <= -87.f ? 0.f : std::exp(x[j] - m);
    s_out[b0 / bs] = s;
  }
  return m;
}

}  // namespace
#endif

// q: [B, Hkv, G, D] or [B, H, 1, D] (H = Hkv G, as the model gives it: the same bytes) float32 contiguous; basis:
// [Hkv, D, r] float32 contiguous (the directions, scaled by the steps and 1 / sqrt(D)); codes: uint8 (even
// direction low nibble, odd high; code - 8 steps), tokens contiguous: [B, Hkv, r / 2, T] or the table's
// summaries [B, Hkv, r / 2, capacity / bs, bs] as they lie; nb: the sealed blocks scored, the first nb of codes'
// (T = nb bs); bias: [B, T] float32 contiguous, 0 or -inf (left padding), or None; bs: tokens a block.
// Returns [B, nb] float32: each block's share of each query head's softmax over the T tokens, summed over
// the query heads.
torch::Tensor lowrank_scores(torch::Tensor q, torch::Tensor basis, torch::Tensor codes, c10::optional<torch::Tensor> bias,
                             int64_t bs, int64_t nb) {
#if KERNEL_SIMD
  TORCH_CHECK(basis.scalar_type() == torch::kFloat32 && basis.is_contiguous() && basis.dim() == 3,
              "basis: contiguous float32 [Hkv, D, r]");
  const int64_t B = q.size(0), H = basis.size(0), D = basis.size(1), half = codes.size(2), T = nb * bs;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 4 && q.size(3) == D &&
                  (q.size(1) * q.size(2)) % H == 0 && q.size(1) * q.size(2) / H <= kMaxG,
              "q: contiguous float32 [B, Hkv, G <= 8, D] or [B, Hkv G, 1, D]");
  const int64_t G = q.size(1) * q.size(2) / H;
  const bool whole = codes.dim() == 5;  // the table's summaries: blocks of bs tokens, one after the other
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.size(0) == B && codes.size(1) == H && 2 * half == basis.size(2) &&
                  bs >= 1 && nb >= 0 &&
                  (whole ? codes.size(4) == bs && codes.stride(4) == 1 && codes.stride(3) == bs && nb <= codes.size(3)
                         : codes.dim() == 4 && codes.stride(3) == 1 && T <= codes.size(3)),
              "codes: uint8 [B, Hkv, r / 2, T >= nb bs] or [B, Hkv, r / 2, >= nb, bs], tokens contiguous");
  const int64_t r = 2 * half;
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->dim() == 2 &&
                    bias->size(0) == B && bias->size(1) == T,
                "bias: contiguous float32 [B, T]");
    bp = bias->data_ptr<float>();
  }
  const int64_t BH = B * H;
  if (nb == 0) return torch::empty({B, 0}, q.options());  // nothing sealed yet
  // the query heads' coordinates, qs [B, Hkv, G, r] as logits_g's pairs: a few thousand products
  std::vector<float> qsv(BH * G * r, 0.f);
  const float* qp = q.data_ptr<float>();
  const float* up = basis.data_ptr<float>();
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t g = 0; g < G; ++g) {
      float* o = qsv.data() + (bh * G + g) * r;
      const float* x = qp + (bh * G + g) * D;
      const float* u = up + (bh % H) * D * r;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = 0; j < r; ++j) o[j] += x[d] * u[d * r + j];
      for (int64_t j = 0; j < r; j += 2) o[j + 1] -= 16.f * o[j];  // (qe, qo - 16 qe): logits_g's pairs
    }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  // per (sequence, KV head, query head) and block: the block's max logit and its sum of e^(logit - max)
  std::vector<float> bmax(BH * G * nb), bsum(BH * G * nb);
  const int64_t per = std::max<int64_t>(1, kChunk / bs), nc = (nb + per - 1) / per;  // blocks a work item
  at::parallel_for(0, BH * nc, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / nc, k0 = (i % nc) * per, kn = std::min(per, nb - k0), b = bh / H, h = bh % H;
      const int64_t t0 = k0 * bs, n = kn * bs;
      if (static_cast<int64_t>(buf.size()) < G * n) buf.resize(G * n);
      logits(qsv.data() + bh * G * r, G, half, cp + b * codes.stride(0) + h * codes.stride(1) + t0, codes.stride(2), n,
             bp ? bp + b * T + t0 : nullptr, buf.data(), n);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = (bh * G + g) * nb + k0;
        const float m = chunk_stats(buf.data() + g * n, n, bs, &bsum[at]);
        std::fill(&bmax[at], &bmax[at] + kn, m);
      }
    }
  });
  // each head's softmax from its blocks' (max, sum), summed over the query heads, then over the KV heads
  auto out = torch::empty({B, nb}, q.options());
  float* op = out.data_ptr<float>();
  std::fill(op, op + B * nb, 0.f);
  std::vector<float> e(nb);
  for (int64_t row = 0; row < BH * G; ++row) {  // vector exps: 4500 scalar ones at 500 blocks were a third of a call
    const float* m = bmax.data() + row * nb;
    const float* s = bsum.data() + row * nb;
    int64_t k = 0;
    vf vm = vec::set1(kLow);
    for (; k + kLanes <= nb; k += kLanes) vm = vec::max(vm, vec::load(m + k));
    float top = vec::hmax(vm);
    for (; k < nb; ++k) top = std::max(top, m[k]);
    const vf vt = vec::set1(top);
    vf vz = vec::zero();
    for (k = 0; k + kLanes <= nb; k += kLanes) {
      const vf x = vec::mul(vec::load(s + k), vec::exp(vec::sub(vec::load(m + k), vt)));
      vec::store(e.data() + k, x);
      vz = vec::add(vz, x);
    }
    float z = vec::sum(vz);
    for (; k < nb; ++k) {
      const float x = m[k] - top;
      e[k] = x <= -87.f ? 0.f : s[k] * std::exp(x);
      z += e[k];
    }
    const float inv = z > 0.f ? 1.f / z : 0.f;
    const vf vinv = vec::set1(inv);
    float* o = op + (row / (H * G)) * nb;
    for (k = 0; k + kLanes <= nb; k += kLanes) vec::store(o + k, vec::fma(vec::load(e.data() + k), vinv, vec::load(o + k)));
    for (; k < nb; ++k) o[k] += e[k] * inv;
  }
  return out;
#else
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
#endif
}

// kv/policies/sparpr_lowrank.py encode_into: a sealed block's 4-bit codes written where the scores read them, in
// one call (the torch encode took about twenty tensor calls a block, each slow after a layer's weights went
// through the caches). keys: [B, Hkv, bs, D] float32 / bfloat16 / float16, any strides (the block as the cache
// holds it); u: [Hkv, D, r] float32 contiguous (the directions); step: [Hkv, r] float32 contiguous; codes:
// [B, Hkv, r / 2, nb, bs] uint8, any strides (the table's summaries). Writes block's codes as the torch encode
// does: round(k . u_j / step_j) clamped to -7..7, plus 8, even directions in the low nibble. False: keys not
// of a float dtype (nothing written).
bool lowrank_encode(torch::Tensor keys, torch::Tensor u, torch::Tensor step, torch::Tensor codes, int64_t block) {
  TORCH_CHECK(keys.dim() == 4 && u.dim() == 3 && step.dim() == 2 && codes.dim() == 5, "keys 4-d, u 3-d, step 2-d, codes 5-d");
  const int64_t B = keys.size(0), H = keys.size(1), bs = keys.size(2), D = keys.size(3), r = u.size(2);
  TORCH_CHECK(u.scalar_type() == torch::kFloat32 && u.is_contiguous() && u.size(0) == H && u.size(1) == D && r % 2 == 0 &&
                  step.scalar_type() == torch::kFloat32 && step.is_contiguous() && step.size(0) == H && step.size(1) == r,
              "u: contiguous float32 [Hkv, D, r]; step: contiguous float32 [Hkv, r]");
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.size(0) == B && codes.size(1) == H && 2 * codes.size(2) == r &&
                  codes.size(4) == bs && block >= 0 && block < codes.size(3),
              "codes: uint8 [B, Hkv, r / 2, nb, bs], block < nb");
  const auto kt = keys.scalar_type();
  if (kt != torch::kFloat32 && kt != torch::kBFloat16 && kt != torch::kHalf) return false;
  const float* up = u.data_ptr<float>();
  const float* sp = step.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>() + block * codes.stride(3);
  std::vector<float> k(D), c(r);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kt, "lowrank_encode", [&] {
    const scalar_t* kp = keys.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < bs; ++t) {
          const scalar_t* row = kp + b * keys.stride(0) + h * keys.stride(1) + t * keys.stride(2);
          for (int64_t d = 0; d < D; ++d) k[d] = static_cast<float>(row[d * keys.stride(3)]);
          std::fill(c.begin(), c.end(), 0.f);
          const float* uh = up + h * D * r;
          for (int64_t d = 0; d < D; ++d)
            for (int64_t j = 0; j < r; ++j) c[j] += k[d] * uh[d * r + j];
          uint8_t* o = cp + b * codes.stride(0) + h * codes.stride(1) + t * codes.stride(4);
          for (int64_t j = 0; j < r; j += 2) {
            const float lo = std::min(7.f, std::max(-7.f, std::nearbyint(c[j] / sp[h * r + j])));
            const float hi = std::min(7.f, std::max(-7.f, std::nearbyint(c[j + 1] / sp[h * r + j + 1])));
            o[(j / 2) * codes.stride(2)] = static_cast<uint8_t>((static_cast<int>(lo) + 8) | ((static_cast<int>(hi) + 8) << 4));
          }
        }
  });
  return true;
}
