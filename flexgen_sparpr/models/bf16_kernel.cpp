// Decode-sized products with float weights: x [M, K] (M <= 8) times W^T, W [N, K], read once per call.
// - bfloat16 W (models/packed.py bfloat16, and a bfloat16 run's own weights): each weight is widened to
//   float32 as it is read (a bfloat16 is a float32's top half: a shift) and multiplied by the float32
//   activations, so the product is exact up to float32 sums. torch's bfloat16 product of one row ran at a
//   third of its float32 one on this project's CPUs (39 vs 13 us for 576 x 576), which made a bfloat16
//   decode step slower than a float32 one with twice the bytes.
// - float32 W (a float32 run's raw weights, batch > 1): CPU BLAS read the weights at half the memory
//   bus's pace for 2-8 rows (12-18 against 24-27 GB/s at one row, Intel Xeon, SmolLM2's shapes); here
//   every weight row is read once for all M rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "simd.h"

#if KERNEL_SIMD
namespace {

using vec::kLanes;
using vec::vf;

constexpr int64_t kMaxRows = 8;
constexpr int64_t kAheadBytes = 4096;  // each row stream prefetched this far ahead of its loads

inline vf wload(const uint16_t* p) { return vec::load(reinterpret_cast<const c10::BFloat16*>(p)); }
inline vf wload(const float* p) { return vec::load(p); }
inline vf wload_n(const uint16_t* p, int n) { return vec::widen_n(p, n); }
inline vf wload_n(const float* p, int n) { return vec::load_n(p, n); }

// y[m, n .. n + R) for R rows of W (T: uint16_t for bfloat16, float)
template <int M, int R, typename T>
inline void block(const float* x, int64_t K, const T* w, float* y, int64_t N, int64_t n) {
  vf acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vec::zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vf xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vec::load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r) * K + k) + kAheadBytes, _MM_HINT_T0);
      const vf wv = wload(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = vec::fma(wv, xv[m], acc[r][m]);
    }
  }
  if (k < K) {  // the last K % kLanes inputs, the lanes past them zero
    const int live = static_cast<int>(K - k);
    vf xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vec::load_n(x + m * K + k, live);
    for (int r = 0; r < R; ++r) {
      const vf wv = wload_n(w + (n + r) * K + k, live);
      for (int m = 0; m < M; ++m) acc[r][m] = vec::fma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n + r] = vec::sum(acc[r][m]);
}

template <int M, typename T>
void rows_of(const float* x, int64_t K, const T* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int R = M == 1 ? 4 : M <= 4 ? 2 : 1;
  int64_t n = n0;
  for (; n + R <= n1; n += R) block<M, R>(x, K, w, y, N, n);
  for (; n < n1; ++n) block<M, 1>(x, K, w, y, N, n);
}

template <typename T>
void product(const float* xp, int64_t M, int64_t K, const T* wp, float* yp, int64_t N) {
  const int64_t grain = std::max<int64_t>(4, 16384 / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows_of<1>(xp, K, wp, yp, N, n0, n1); break;
      case 2: rows_of<2>(xp, K, wp, yp, N, n0, n1); break;
      case 3: rows_of<3>(xp, K, wp, yp, N, n0, n1); break;
      case 4: rows_of<4>(xp, K, wp, yp, N, n0, n1); break;
      case 5: rows_of<5>(xp, K, wp, yp, N, n0, n1); break;
      case 6: rows_of<6>(xp, K, wp, yp, N, n0, n1); break;
      case 7: rows_of<7>(xp, K, wp, yp, N, n0, n1); break;
      default: rows_of<8>(xp, K, wp, yp, N, n0, n1); break;
    }
  });
}

}  // namespace
#endif

// x: [M, K] float32 or bfloat16 (M <= 8); w: [N, K] bfloat16 contiguous -> [M, N] in x's dtype
torch::Tensor bf16_matmul(torch::Tensor x, torch::Tensor w) {
#if KERNEL_SIMD
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x: contiguous float32 or bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kBFloat16 && w.size(1) == x.size(1),
              "w: contiguous bfloat16 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "x: 1..8 rows");
  const auto xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  float* yp = y.data_ptr<float>();
  product(xp, M, K, wp, yp, N);
  if (x.scalar_type() == torch::kFloat32) return y;
  auto yb = torch::empty({M, N}, x.options());  // one rounding of the float32 sums
  c10::BFloat16* bp = yb.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < M * N; ++i) bp[i] = static_cast<c10::BFloat16>(yp[i]);
  return yb;
#else
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
#endif
}

// x: [M, K] float32 (M <= 8); w: [N, K] float32 contiguous -> [M, N] float32
torch::Tensor f32_matmul(torch::Tensor x, torch::Tensor w) {
#if KERNEL_SIMD
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kFloat32 && w.size(1) == x.size(1),
              "w: contiguous float32 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "x: 1..8 rows");
  auto y = torch::empty({M, N}, x.options());
  product(x.data_ptr<float>(), M, K, w.data_ptr<float>(), y.data_ptr<float>(), N);
  return y;
#else
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
#endif
}
