// One decode query per head over a KV cache read where it lies, on a CPU with AVX-512 (models/cpu_kernel.py
// builds this once per machine). K and V may be float32, bfloat16 or float16 (widened to float32 as they are
// read); q, the scores, the softmax and the output are float32. A KV head's G query heads share its keys, so
// each key and value row is read once for all of them. The keys are split into chunks of kChunk over the
// threads (flash-decoding: a batch of one has too few heads to keep two cores busy); each chunk keeps its
// (max score, sum of exp, weighted values) and the chunks are merged at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kChunk = 512;     // keys per work item: G x kChunk scores stay in the L1 cache
constexpr float kLow = -1e30f;  // a masked key's score: finite, as -ffast-math's vector exp needs

// a row this many keys ahead is asked of memory now: rows read by index (the hardware's prefetcher does
// not follow a jump from one block to the next), and rows read in order (it alone leaves a core at about
// 80 % of what it streams: measured 6.1 against 5.0-5.3 ms a 2k step's attention, 16 and 32 alike)
constexpr int kAhead = 8, kAheadInOrder = 16;

// the row to ask of memory at key t of t0..t1: kAhead (by index) or kAheadInOrder keys on; -1: none
inline int64_t ahead(const int64_t* idx, int64_t t, int64_t t1) {
  if (idx) return t + kAhead < t1 ? idx[t + kAhead] : -1;
  return t + kAheadInOrder < t1 ? t + kAheadInOrder : -1;
}

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is float32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// Keys t0..t1 of one (sequence, KV head): key t is row idx[t] of k and v (idx null: row t). m[g], l[g]: the
// max score and the sum of exp(score - max) (l 0: no valid key); acc[g, :]: the values weighted by
// exp(score - max).
template <typename T, int G, int D>
void attend_chunk(const float* q, const T* k, const T* v, int64_t row, const int64_t* idx, int64_t t0, int64_t t1,
                  const bool* mask, float scale, float* m, float* l, float* acc) {
  constexpr int V = D / 16;
  alignas(64) float s[G][kChunk];
  float mx[G];
  int live = 0;
  __m512 qv[G][V];
  for (int g = 0; g < G; ++g) {
    mx[g] = kLow;
    for (int i = 0; i < V; ++i) qv[g][i] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + i * 16), _mm512_set1_ps(scale));
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t j = t - t0;
    if (mask && !mask[t]) {
      for (int g = 0; g < G; ++g) s[g][j] = kLow;
      continue;
    }
    ++live;
    __m512 kv[V];
    const T* kt = k + (idx ? idx[t] : t) * row;
    if (const int64_t a = ahead(idx, t, t1); a >= 0) prefetch_row(k + a * row, D * sizeof(T));
    for (int i = 0; i < V; ++i) kv[i] = load16(kt + i * 16);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int i = 1; i < V; ++i) a = _mm512_fmadd_ps(qv[g][i], kv[i], a);
      const float dot = _mm512_reduce_add_ps(a);
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
  __m512 av[G][V];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) av[g][i] = _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    if (mask && !mask[t]) continue;
    __m512 vv[V];
    const T* vt = v + (idx ? idx[t] : t) * row;
    if (const int64_t a = ahead(idx, t, t1); a >= 0) prefetch_row(v + a * row, D * sizeof(T));
    for (int i = 0; i < V; ++i) vv[i] = load16(vt + i * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[g][t - t0]);
      for (int i = 0; i < V; ++i) av[g][i] = _mm512_fmadd_ps(p, vv[i], av[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc + g * D + i * 16, av[g][i]);
}

template <typename T, int G, int D>
void run(const float* qp, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
         const torch::Tensor* mask, const torch::Tensor* rows, float* op, torch::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), T_ = rows ? rows->size(1) : k.size(2);
  const int64_t* rp = rows ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t rs = rows && rows->size(0) > 1 ? rows->stride(0) : 0;
  const int64_t chunks = std::max<int64_t>(1, (T_ + kChunk - 1) / kChunk), items = B * H * chunks;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> m(items * G), l(items * G), acc(items * G * D);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* mp = mask ? mask->data_ptr<bool>() : nullptr;
  const int64_t mh = mask ? mask->size(1) : 0;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / chunks, c = i % chunks, b = bh / H, h = bh % H;
      const int64_t t0 = c * kChunk, t1 = std::min<int64_t>(T_, t0 + kChunk);
      const bool* mb = mp ? mp + b * mask->stride(0) + (mh == 1 ? 0 : h) * mask->stride(1) : nullptr;
      attend_chunk<T, G, D>(qp + bh * G * D, kp + b * k.stride(0) + h * k.stride(1),
                            vp + b * v.stride(0) + h * v.stride(1), k.stride(2), rp ? rp + b * rs : nullptr, t0,
                            t1, mb, scale, &m[i * G], &l[i * G], &acc[i * G * D]);
    }
  });
  float* lp = lse.data_ptr<float>();
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

template <typename T, int D>
bool run_g(int64_t g, const float* qp, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
           const torch::Tensor* mask, const torch::Tensor* rows, float* op, torch::Tensor& lse) {
  switch (g) {
    case 1: run<T, 1, D>(qp, q, k, v, mask, rows, op, lse); return true;
    case 2: run<T, 2, D>(qp, q, k, v, mask, rows, op, lse); return true;
    case 3: run<T, 3, D>(qp, q, k, v, mask, rows, op, lse); return true;
    case 4: run<T, 4, D>(qp, q, k, v, mask, rows, op, lse); return true;
    case 5: run<T, 5, D>(qp, q, k, v, mask, rows, op, lse); return true;
    case 6: run<T, 6, D>(qp, q, k, v, mask, rows, op, lse); return true;
    case 7: run<T, 7, D>(qp, q, k, v, mask, rows, op, lse); return true;
    case 8: run<T, 8, D>(qp, q, k, v, mask, rows, op, lse); return true;
  }
  return false;
}

template <typename T>
bool run_d(const float* qp, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
           const torch::Tensor* mask, const torch::Tensor* rows, float* op, torch::Tensor& lse) {
  if (q.size(3) == 64) return run_g<T, 64>(q.size(2), qp, q, k, v, mask, rows, op, lse);
  if (q.size(3) == 128) return run_g<T, 128>(q.size(2), qp, q, k, v, mask, rows, op, lse);
  return false;
}

}  // namespace
#endif

bool simd() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// q: [B, Hkv, G, D] float32 or bfloat16, contiguous (G <= 8; D 64 or 128); k, v: [B, Hkv, T, D] of one dtype (float32,
// bfloat16 or float16), each key a contiguous row of D, one row stride; mask: [B, 1|Hkv, T] bool, T
// contiguous, or None (every key); rows: [1|B, T'] int64 (T' contiguous) or None: the keys attended are rows
// rows[b, :] of k and v (shared by the sequences when its first size is 1), and T in mask is T'.
// Returns (out [B, Hkv, G, D] in q's dtype (a bfloat16 q: read widened, out rounded once), lse [B, Hkv, G]
// float32).
std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                            c10::optional<torch::Tensor> mask, c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(simd(), "built without AVX-512");
  const bool wide = q.scalar_type() == torch::kFloat32;
  TORCH_CHECK((wide || q.scalar_type() == torch::kBFloat16) && q.is_contiguous() && q.dim() == 4,
              "q: contiguous float32 or bfloat16 [B, Hkv, G, D]");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  k.size(3) == q.size(3),
              "k, v: [B, Hkv, T, D] like q");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == v.stride(2),
              "k, v: one dtype, rows of D contiguous, one row stride");
  const torch::Tensor* rp = rows.has_value() ? &rows.value() : nullptr;
  if (rp) {
    TORCH_CHECK(rp->scalar_type() == torch::kLong && rp->dim() == 2 && (rp->size(0) == 1 || rp->size(0) == q.size(0)) &&
                    rp->stride(1) == 1,
                "rows: int64 [1|B, T']");
    const int64_t* r = rp->data_ptr<int64_t>();
    bool inside = true;  // a row outside k would read outside its memory
    for (int64_t i = 0; i < rp->size(0); ++i)
      for (int64_t j = 0; j < rp->size(1); ++j) {
        const int64_t x = r[i * rp->stride(0) + j];
        inside &= x >= 0 && x < k.size(2);
      }
    TORCH_CHECK(inside, "rows: within k's T");
  }
  const int64_t keys = rp ? rp->size(1) : k.size(2);
  const torch::Tensor* mp = mask.has_value() ? &mask.value() : nullptr;
  if (mp)
    TORCH_CHECK(mp->scalar_type() == torch::kBool && mp->dim() == 3 && mp->size(0) == q.size(0) &&
                    (mp->size(1) == 1 || mp->size(1) == q.size(1)) && mp->size(2) == keys && mp->stride(2) == 1,
                "mask: bool [B, 1|Hkv, T]");
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
#if defined(__AVX512F__)
  if (k.scalar_type() == torch::kFloat32) done = run_d<float>(qp, q, k, v, mp, rp, op, lse);
  else if (k.scalar_type() == torch::kBFloat16) done = run_d<c10::BFloat16>(qp, q, k, v, mp, rp, op, lse);
  else if (k.scalar_type() == torch::kHalf) done = run_d<c10::Half>(qp, q, k, v, mp, rp, op, lse);
#endif
  TORCH_CHECK(done, "shape or dtype not built (G <= 8, D 64 or 128; float32, bfloat16, float16)");
  if (!wide) {
    c10::BFloat16* ob = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) ob[i] = static_cast<c10::BFloat16>(ow[i]);
  }
  return {out, lse};
}

torch::Tensor lowrank_scores(torch::Tensor qs, torch::Tensor codes, c10::optional<torch::Tensor> bias, int64_t bs);  // lowrank_kernel.cpp

std::vector<torch::Tensor> pick_rows(torch::Tensor score, c10::optional<torch::Tensor> own, int64_t k, int64_t bs,
                                     int64_t length);  // select_kernel.cpp

torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor dm);  // weight_kernel.cpp
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d);  // weight_kernel.cpp
std::vector<torch::Tensor> quantize_rows(torch::Tensor x, bool wide);  // weight_kernel.cpp
torch::Tensor bf16_matmul(torch::Tensor x, torch::Tensor w);  // bf16_kernel.cpp
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps);  // glue_kernel.cpp
torch::Tensor rope_rows(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);  // glue_kernel.cpp
torch::Tensor silu_mul_rows(torch::Tensor gu);  // glue_kernel.cpp

// The kernels touch no Python object: they let go of the GIL while they run, so the engine's I/O threads
// (disk reads, copies) go on meanwhile instead of waiting for the kernel to return.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("simd", &simd);
  m.def("decode_attention", &decode_attention, nogil);
  m.def("lowrank_scores", &lowrank_scores, nogil);
  m.def("pick_rows", &pick_rows, nogil);
  m.def("q4_matmul", &q4_matmul, nogil);
  m.def("q8_matmul", &q8_matmul, nogil);
  m.def("quantize_rows", &quantize_rows, nogil);
  m.def("bf16_matmul", &bf16_matmul, nogil);
  m.def("rms_norm_rows", &rms_norm_rows, nogil);
  m.def("rope_rows", &rope_rows, nogil);
  m.def("silu_mul_rows", &silu_mul_rows, nogil);
}
