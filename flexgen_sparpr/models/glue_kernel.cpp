// A decode step's small operations, one call each (models/layers.py): torch runs an RMSNorm as six tensor
// calls and a rotary embedding as five, each a few microseconds of dispatch over a vector of a few hundred
// values, about sixty of them a step a layer stack deep. float32 or bfloat16 tensors (all of one dtype);
// the arithmetic is float32, each output rounded once to the tensors' dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>

namespace {

inline float wide(float v) { return v; }
inline float wide(c10::BFloat16 v) { return static_cast<float>(v); }

// the dtype both float32 and bfloat16 callers name; anything else is refused
bool bf16_of(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, what, ": float32 or bfloat16");
  return x.scalar_type() == torch::kBFloat16;
}

// HF's order: normalize in float32, round to the dtype, then scale by w
template <typename T>
void rms_rows(const T* xp, const T* wp, T* op, int64_t R, int64_t H, float eps) {
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += wide(xr[i]) * wide(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      for (int64_t i = 0; i < H; ++i) op[r * H + i] = static_cast<T>(wide(wp[i]) * wide(static_cast<T>(wide(xr[i]) * inv)));
    }
  });
}

template <typename T>
void rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), half = D / 2;
  auto xa = x.accessor<T, 4>();
  auto ca = cos.accessor<T, 4>();
  auto sa = sin.accessor<T, 4>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H * S, std::max<int64_t>(1, 16384 / D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * S), h = (i / S) % H, s = i % S;
      const auto xr = xa[b][h][s];
      const auto cr = ca[b][0][s];
      const auto sr = sa[b][0][s];
      T* o = op + i * D;
      for (int64_t d = 0; d < half; ++d) {
        o[d] = static_cast<T>(wide(xr[d]) * wide(cr[d]) - wide(xr[d + half]) * wide(sr[d]));
        o[d + half] = static_cast<T>(wide(xr[d + half]) * wide(cr[d + half]) + wide(xr[d]) * wide(sr[d + half]));
      }
    }
  });
}

template <typename T>
void silu_rows(const T* gp, T* op, int64_t R, int64_t F) {
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / F), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gp + r * 2 * F;
      for (int64_t i = 0; i < F; ++i) {
        const float gi = wide(g[i]);
        op[r * F + i] = static_cast<T>(gi / (1.f + std::exp(-gi)) * wide(g[F + i]));
      }
    }
  });
}

}  // namespace

// x: [R, H] contiguous; w: [H], x's dtype -> x / sqrt(mean(x^2) + eps) * w
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps) {
  const bool bf = bf16_of(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous() && w.scalar_type() == x.scalar_type()
                  && w.size(0) == x.size(1), "x: contiguous [R, H]; w: [H] of x's dtype");
  auto out = torch::empty_like(x);
  if (bf)
    rms_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), x.size(0), x.size(1),
             static_cast<float>(eps));
  else
    rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps));
  return out;
}

// x: [B, H, S, D], any strides; cos, sin: [B, 1, S, D], any strides, x's dtype (rotate-half layout: pairs
// (i, i + D/2)) -> x * cos + rotate_half(x) * sin, contiguous [B, H, S, D]
torch::Tensor rope_rows(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const bool bf = bf16_of(x, "x");
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 4 && sin.dim() == 4 && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(), "x [B, H, S, D], cos and sin [B, 1, S, D], one dtype");
  const int64_t B = x.size(0), S = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == B && cos.size(2) == S && cos.size(3) == D && sin.sizes() == cos.sizes(),
              "cos and sin [B, 1, S, D] for x [B, H, S, D]");
  auto out = torch::empty({B, x.size(1), S, D}, x.options());
  if (bf) rope<c10::BFloat16>(x, cos, sin, out);
  else rope<float>(x, cos, sin, out);
  return out;
}

// gu: [R, 2F] contiguous (gate | up) -> silu(gate) * up: [R, F], gu's dtype
torch::Tensor silu_mul_rows(torch::Tensor gu) {
  const bool bf = bf16_of(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "gu: contiguous [R, 2F]");
  const int64_t R = gu.size(0), F = gu.size(1) / 2;
  auto out = torch::empty({R, F}, gu.options());
  if (bf) silu_rows(gu.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), R, F);
  else silu_rows(gu.data_ptr<float>(), out.data_ptr<float>(), R, F);
  return out;
}

torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor dm);  // weight_kernel.cpp

// A decode step's MLP half with 4-bit gate|up and down weights (models/fused.py): x + down(silu(gate) * up)
// of rms_norm(x) * w, the kernels models/llama.py's mlp calls one by one, in its order and dtypes, in one call
// (a layer-by-layer MLP spends as long in Python between its four kernels as in the two products' kernels
// at one row). x: [R, H] contiguous (R <= 8), w: [H], x's dtype; codes and scales as q4_matmul takes them.
torch::Tensor q4_mlp(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor gu_codes, torch::Tensor gu_dm,
                     torch::Tensor down_codes, torch::Tensor down_dm) {
  const torch::Tensor act = silu_mul_rows(q4_matmul(rms_norm_rows(x, w, eps), gu_codes, gu_dm));  // [R, F]
  return x + q4_matmul(act, down_codes, down_dm);
}
