// A decode step's small float32 operations, one call each (models/layers.py): torch runs an RMSNorm as
// six tensor calls and a rotary embedding as five, each a few microseconds of dispatch over a vector of a
// few hundred values, about sixty of them a step a layer stack deep. Same arithmetic, in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

// x: [R, H] float32 contiguous; w: [H] float32 -> x / sqrt(mean(x^2) + eps) * w (HF's order: normalize, then scale)
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: contiguous float32 [R, H]");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == torch::kFloat32 && w.size(0) == x.size(1),
              "w: float32 [H]");
  const int64_t R = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) op[r * H + i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

// x: [B, H, S, D] float32, any strides; cos, sin: [B, 1, S, D] float32, any strides (rotate-half layout:
// pairs (i, i + D/2)) -> x * cos + rotate_half(x) * sin, contiguous [B, H, S, D]
torch::Tensor rope_rows(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat32 && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && cos.dim() == 4 && sin.dim() == 4,
              "float32 x [B, H, S, D], cos and sin [B, 1, S, D]");
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == B && cos.size(2) == S && cos.size(3) == D && sin.sizes() == cos.sizes(),
              "cos and sin [B, 1, S, D] for x [B, H, S, D]");
  auto out = torch::empty({B, H, S, D}, x.options());
  auto xa = x.accessor<float, 4>();
  auto ca = cos.accessor<float, 4>();
  auto sa = sin.accessor<float, 4>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H * S, std::max<int64_t>(1, 16384 / D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * S), h = (i / S) % H, s = i % S;
      const auto xr = xa[b][h][s];
      const auto cr = ca[b][0][s];
      const auto sr = sa[b][0][s];
      float* o = op + i * D;
      for (int64_t d = 0; d < half; ++d) {
        o[d] = xr[d] * cr[d] - xr[d + half] * sr[d];
        o[d + half] = xr[d + half] * cr[d + half] + xr[d] * sr[d + half];
      }
    }
  });
  return out;
}

// gu: [R, 2F] float32 contiguous (gate | up) -> silu(gate) * up: [R, F]
torch::Tensor silu_mul_rows(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.scalar_type() == torch::kFloat32 && gu.size(1) % 2 == 0,
              "gu: contiguous float32 [R, 2F]");
  const int64_t R = gu.size(0), F = gu.size(1) / 2;
  auto out = torch::empty({R, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / F), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * 2 * F;
      for (int64_t i = 0; i < F; ++i) op[r * F + i] = g[i] / (1.f + std::exp(-g[i])) * g[F + i];
    }
  });
  return out;
}
