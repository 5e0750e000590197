// One decode query per head over a KV cache read where it lies, on a CPU with AVX-512 or AVX2 (simd.h;
// models/cpu_kernel.py builds this once per machine). K and V may be float32, bfloat16 or float16 (widened to float32 as they are
// read); q, the scores, the softmax and the output are float32. A KV head's G query heads share its keys, so
// each key and value row is read once for all of them. The keys are split into chunks of kChunk over the
// threads (flash-decoding: a batch of one has too few heads to keep two cores busy); each chunk keeps its
// (max score, sum of exp, weighted values) and the chunks are merged at the end. The keys may lie in several
// places (parts: a resident arena, disk blocks where they landed, a gather buffer): one call, one softmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

constexpr int kChunk = 512;     // keys per work item: G x kChunk scores stay in the L1 cache

// One source of keys (decode_attention_parts): k, v rows, which of them are attended, which are valid.
struct Part {
  const void* k;
  const void* v;
  int64_t kb, kh, vb, vh, row;  // strides (elements): sequence, KV head, row
  const int64_t* idx;           // rows [1|B, T] attended (null: row t of t < keys)
  int64_t idx_b;                // its stride per sequence (0: one list for all)
  const bool* mask;             // [B, 1|Hkv, T] or null (every key)
  int64_t mb, mh;               // its strides per sequence and per KV head (0: one for all heads)
  int64_t keys, chunks, first;  // keys; chunks of kChunk (at least 1); its first among all parts' chunks
  c10::ScalarType dtype;
};

}  // namespace

#if KERNEL_SIMD
namespace {

using vec::kLanes;
using vec::vf;

constexpr float kLow = -1e30f;  // a masked key's score: finite, as -ffast-math's vector exp needs

// a row this many keys ahead is asked of memory now: rows read by index (the hardware's prefetcher does
// not follow a jump from one block to the next), and rows read in order (it alone leaves a core at about
// 80 % of what it streams: measured 6.1 against 5.0-5.3 ms a 2k step's attention, 16 and 32 alike). The
// score pass asks for the value row too, into the shared cache, so that the values stream in while the
// scores compute (8000 keys, float16, cold: 524 -> 446 us a call; 48 or 128 keys ahead, or keys asked
// further ahead into the shared cache, were slower)
constexpr int kAhead = 8, kAheadInOrder = 16;

// the row to ask of memory at key t of t0..t1: kAhead (by index) or kAheadInOrder keys on; -1: none
inline int64_t ahead(const int64_t* idx, int64_t t, int64_t t1) {
  if (idx) return t + kAhead < t1 ? idx[t + kAhead] : -1;
  return t + kAheadInOrder < t1 ? t + kAheadInOrder : -1;
}

template <int Hint = _MM_HINT_T0>
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, static_cast<_mm_hint>(Hint));
}

// Keys t0..t1 of one (sequence, KV head): key t is row idx[t] of k and v (idx null: row t). m[g], l[g]: the
// max score and the sum of exp(score - max) (l 0: no valid key); acc[g, :]: the values weighted by
// exp(score - max).
template <typename T, int G, int D>
void attend_chunk(const float* q, const T* k, const T* v, int64_t row, const int64_t* idx, int64_t t0, int64_t t1,
                  const bool* mask, float scale, float* m, float* l, float* acc) {
  constexpr int V = D / kLanes;
  alignas(64) float s[G][kChunk];
  float mx[G];
  int live = 0;
  vf qv[G][V];
  for (int g = 0; g < G; ++g) {
    mx[g] = kLow;
    for (int i = 0; i < V; ++i) qv[g][i] = vec::mul(vec::load(q + g * D + i * kLanes), vec::set1(scale));
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t j = t - t0;
    if (mask && !mask[t]) {
      for (int g = 0; g < G; ++g) s[g][j] = kLow;
      continue;
    }
    ++live;
    vf kv[V];
    const T* kt = k + (idx ? idx[t] : t) * row;
    if (const int64_t a = ahead(idx, t, t1); a >= 0) {
      prefetch_row(k + a * row, D * sizeof(T));
      prefetch_row<_MM_HINT_T1>(v + a * row, D * sizeof(T));  // the value pass then reads the shared cache
    }
    for (int i = 0; i < V; ++i) kv[i] = vec::load(kt + i * kLanes);
    for (int g = 0; g < G; ++g) {
      vf a = vec::mul(qv[g][0], kv[0]);
      for (int i = 1; i < V; ++i) a = vec::fma(qv[g][i], kv[i], a);
      const float dot = vec::sum(a);
      s[g][j] = dot;
      mx[g] = std::max(mx[g], dot);
    }
  }
  const int64_t n = t1 - t0;
  for (int g = 0; g < G; ++g) {
    float sum = 0.f;
    const float top = mx[g];
    float* sg = s[g];
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const float e = std::exp(sg[j] - top);
      sg[j] = e;
      sum += e;
    }
    m[g] = top;
    l[g] = live ? sum : 0.f;
  }
  vf av[G][V];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) av[g][i] = vec::zero();
  for (int64_t t = t0; t < t1; ++t) {
    if (mask && !mask[t]) continue;
    vf vv[V];
    const T* vt = v + (idx ? idx[t] : t) * row;
    if (const int64_t a = ahead(idx, t, t1); a >= 0) prefetch_row(v + a * row, D * sizeof(T));
    for (int i = 0; i < V; ++i) vv[i] = vec::load(vt + i * kLanes);
    for (int g = 0; g < G; ++g) {
      const vf p = vec::set1(s[g][t - t0]);
      for (int i = 0; i < V; ++i) av[g][i] = vec::fma(p, vv[i], av[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) vec::store(acc + g * D + i * kLanes, av[g][i]);
}

template <int G, int D>
void run(const float* qp, int64_t B, int64_t H, const std::vector<Part>& parts, float* op, float* lp) {
  const int64_t chunks = parts.back().first + parts.back().chunks, items = B * H * chunks;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> m(items * G), l(items * G), acc(items * G * D);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / chunks, c = i % chunks, b = bh / H, h = bh % H;
      size_t pi = 0;
      while (c >= parts[pi].first + parts[pi].chunks) ++pi;
      const Part& p = parts[pi];
      const int64_t t0 = (c - p.first) * kChunk, t1 = std::min<int64_t>(p.keys, t0 + kChunk);
      const bool* mb = p.mask ? p.mask + b * p.mb + h * p.mh : nullptr;
      const int64_t* ib = p.idx ? p.idx + b * p.idx_b : nullptr;
      const int64_t ko = b * p.kb + h * p.kh, vo = b * p.vb + h * p.vh;
      float *mi = &m[i * G], *li = &l[i * G], *ai = &acc[i * G * D];
      const float* qi = qp + bh * G * D;
      if (p.dtype == torch::kFloat32)
        attend_chunk<float, G, D>(qi, (const float*)p.k + ko, (const float*)p.v + vo, p.row, ib, t0, t1, mb, scale, mi, li, ai);
      else if (p.dtype == torch::kBFloat16)
        attend_chunk<c10::BFloat16, G, D>(qi, (const c10::BFloat16*)p.k + ko, (const c10::BFloat16*)p.v + vo, p.row, ib,
                                          t0, t1, mb, scale, mi, li, ai);
      else
        attend_chunk<c10::Half, G, D>(qi, (const c10::Half*)p.k + ko, (const c10::Half*)p.v + vo, p.row, ib, t0, t1, mb,
                                      scale, mi, li, ai);
    }
  });
  for (int64_t bh = 0; bh < B * H; ++bh) {
    for (int g = 0; g < G; ++g) {
      float top = kLow;
      bool any = false;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = (bh * chunks + c) * G + g;
        if (l[i] > 0.f) {
          top = any ? std::max(top, m[i]) : m[i];
          any = true;
        }
      }
      float* o = op + (bh * G + g) * D;
      std::fill(o, o + D, 0.f);
      if (!any) {  // no valid key: output 0, log-sum-exp -inf (what the torch paths give)
        lp[bh * G + g] = -std::numeric_limits<float>::infinity();
        continue;
      }
      float den = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = (bh * chunks + c) * G + g;
        if (l[i] == 0.f) continue;
        const float w = std::exp(m[i] - top);
        den += w * l[i];
        const float* a = &acc[i * D];
        for (int d = 0; d < D; ++d) o[d] += w * a[d];
      }
      for (int d = 0; d < D; ++d) o[d] /= den;
      lp[bh * G + g] = top + std::log(den);
    }
  }
}

template <int D>
bool run_g(int64_t g, const float* qp, int64_t B, int64_t H, const std::vector<Part>& parts, float* op, float* lp) {
  switch (g) {
    case 1: run<1, D>(qp, B, H, parts, op, lp); return true;
    case 2: run<2, D>(qp, B, H, parts, op, lp); return true;
    case 3: run<3, D>(qp, B, H, parts, op, lp); return true;
    case 4: run<4, D>(qp, B, H, parts, op, lp); return true;
    case 5: run<5, D>(qp, B, H, parts, op, lp); return true;
    case 6: run<6, D>(qp, B, H, parts, op, lp); return true;
    case 7: run<7, D>(qp, B, H, parts, op, lp); return true;
    case 8: run<8, D>(qp, B, H, parts, op, lp); return true;
  }
  return false;
}

}  // namespace
#endif

// the vector width the kernels were built for: 512 (AVX-512), 256 (AVX2) or 0 (neither: not usable)
int64_t simd_width() { return KERNEL_SIMD; }

bool simd() { return KERNEL_SIMD != 0; }

// One part of the keys (decode_attention_parts), checked against q: [B, Hkv, G, D].
Part part(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const c10::optional<torch::Tensor>& mask,
          const c10::optional<torch::Tensor>& rows) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  k.size(3) == q.size(3) && k.device().is_cpu() && v.device().is_cpu(),
              "k, v: [B, Hkv, T, D] like q, on the CPU");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == v.stride(2),
              "k, v: one dtype, rows of D contiguous, one row stride");
  const auto dt = k.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf, "k, v: float32, bfloat16 or float16");
  Part p{k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), k.stride(2),
         nullptr, 0, nullptr, 0, 0, k.size(2), 0, 0, dt};
  if (rows.has_value()) {
    const torch::Tensor& rp = rows.value();
    TORCH_CHECK(rp.scalar_type() == torch::kLong && rp.dim() == 2 && (rp.size(0) == 1 || rp.size(0) == q.size(0)) &&
                    rp.stride(1) == 1,
                "rows: int64 [1|B, T']");
    const int64_t* r = rp.data_ptr<int64_t>();
    bool inside = true;  // a row outside k would read outside its memory
    for (int64_t i = 0; i < rp.size(0); ++i)
      for (int64_t j = 0; j < rp.size(1); ++j) {
        const int64_t x = r[i * rp.stride(0) + j];
        inside &= x >= 0 && x < k.size(2);
      }
    TORCH_CHECK(inside, "rows: within k's T");
    p.idx = r;
    p.idx_b = rp.size(0) > 1 ? rp.stride(0) : 0;
    p.keys = rp.size(1);
  }
  if (mask.has_value()) {
    const torch::Tensor& mp = mask.value();
    TORCH_CHECK(mp.scalar_type() == torch::kBool && mp.dim() == 3 && mp.size(0) == q.size(0) &&
                    (mp.size(1) == 1 || mp.size(1) == q.size(1)) && mp.size(2) == p.keys && mp.stride(2) == 1,
                "mask: bool [B, 1|Hkv, T]");
    p.mask = mp.data_ptr<bool>();
    p.mb = mp.stride(0);
    p.mh = mp.size(1) == 1 ? 0 : mp.stride(1);
  }
  p.chunks = std::max<int64_t>(1, (p.keys + kChunk - 1) / kChunk);
  return p;
}

// q: [B, Hkv, G, D] float32 or bfloat16, contiguous (G <= 8; D 64 or 128). The keys come in parts: part i's
// ks[i], vs[i]: [B, Hkv, T, D] of one dtype (float32, bfloat16 or float16; the parts' may differ), each key a
// contiguous row of D, one row stride; masks[i]: [B, 1|Hkv, T'] bool, T' contiguous, or None (every key);
// rows[i]: [1|B, T'] int64 (T' contiguous) or None: the keys attended are rows rows[b, :] of k and v (shared by
// the sequences when its first size is 1), else T' = T. One softmax over every part's keys.
// Returns (out [B, Hkv, G, D] in q's dtype (a bfloat16 q: read widened, out rounded once), lse [B, Hkv, G]
// float32).
std::vector<torch::Tensor> decode_attention_parts(torch::Tensor q, std::vector<torch::Tensor> ks,
                                                  std::vector<torch::Tensor> vs,
                                                  std::vector<c10::optional<torch::Tensor>> masks,
                                                  std::vector<c10::optional<torch::Tensor>> rows) {
  TORCH_CHECK(simd(), "built without AVX-512 or AVX2");
  const bool wide = q.scalar_type() == torch::kFloat32;
  TORCH_CHECK((wide || q.scalar_type() == torch::kBFloat16) && q.is_contiguous() && q.dim() == 4,
              "q: contiguous float32 or bfloat16 [B, Hkv, G, D]");
  TORCH_CHECK(!ks.empty() && ks.size() == vs.size() && ks.size() == masks.size() && ks.size() == rows.size(),
              "one k, v, mask and rows a part, at least one part");
  std::vector<Part> parts;
  for (size_t i = 0; i < ks.size(); ++i) {
    parts.push_back(part(q, ks[i], vs[i], masks[i], rows[i]));
    parts.back().first = i ? parts[i - 1].first + parts[i - 1].chunks : 0;
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat32));
  const int64_t n = q.numel();
  std::vector<float> qw(wide ? 0 : n), ow(wide ? 0 : n);  // a bfloat16 q widened, its out before rounding
  if (!wide) {
    const c10::BFloat16* qb = q.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) qw[i] = static_cast<float>(qb[i]);
  }
  const float* qp = wide ? q.data_ptr<float>() : qw.data();
  float* op = wide ? out.data_ptr<float>() : ow.data();
  bool done = false;
#if KERNEL_SIMD
  if (q.size(3) == 64) done = run_g<64>(q.size(2), qp, q.size(0), q.size(1), parts, op, lse.data_ptr<float>());
  else if (q.size(3) == 128) done = run_g<128>(q.size(2), qp, q.size(0), q.size(1), parts, op, lse.data_ptr<float>());
#endif
  TORCH_CHECK(done, "shape not built (G <= 8, D 64 or 128)");
  if (!wide) {
    c10::BFloat16* ob = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) ob[i] = static_cast<c10::BFloat16>(ow[i]);
  }
  return {out, lse};
}
