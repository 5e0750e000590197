// A decode step's small operations, one call each (models/layers.py): torch runs an RMSNorm as six tensor
// calls and a rotary embedding as five, each a few microseconds of dispatch over a vector of a few hundred
// values, about sixty of them a step a layer stack deep. float32 or bfloat16 tensors (all of one dtype);
// the arithmetic is float32, each output rounded once to the tensors' dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <vector>

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
// at one row). x: [..., H] (at most 8 rows), w: [H], x's dtype; codes and scales as q4_matmul takes them.
// Returns [..., H], x's shape.
torch::Tensor q4_mlp(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor gu_codes, torch::Tensor gu_dm,
                     torch::Tensor down_codes, torch::Tensor down_dm) {
  const torch::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();  // [R, H]
  const torch::Tensor act = silu_mul_rows(q4_matmul(rms_norm_rows(rows, w.contiguous(), eps), gu_codes, gu_dm));  // [R, F]
  return (rows + q4_matmul(act, down_codes, down_dm)).view(x.sizes());
}

// A decode step's attention input with a 4-bit q|k|v weight (models/fused.py q4_qkv): h = rms_norm(x) * w,
// h's q|k|v product split into heads, RoPE on q and k: the kernels models/llama.py calls one by one, in its
// order and dtypes. x: [B, S, hidden] (B S <= 8); w: [hidden]; cos, sin: [B, 1, S, D], x's dtype.
// Returns h [B, S, hidden] (SparPR's checkpoint), q [B, H, S, D] and k [B, Hkv, S, D] (contiguous), and v
// [B, Hkv, S, D] (a view of the product, as models/layers.py split_heads gives it).
std::vector<torch::Tensor> q4_qkv(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor codes, torch::Tensor dm,
                                  torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 4, "x [B, S, hidden], cos [B, 1, S, D]");
  const int64_t B = x.size(0), S = x.size(1), hidden = x.size(2), D = cos.size(3), qd = heads * D, kvd = kv_heads * D;
  const torch::Tensor h = rms_norm_rows(x.reshape({B * S, hidden}).contiguous(), w.contiguous(), eps);  // [B S, hidden]
  const torch::Tensor y = q4_matmul(h, codes, dm).view({B, S, -1});  // [B, S, qd + 2 kvd]
  TORCH_CHECK(y.size(2) == qd + 2 * kvd, "the q|k|v weight's rows: (heads + 2 kv_heads) x head_dim");
  const auto part = [&](int64_t start, int64_t n, int64_t nh) {  // [B, nh, S, D], a view
    return y.narrow(2, start, n).view({B, S, nh, D}).transpose(1, 2);
  };
  return {h.view({B, S, hidden}), rope_rows(part(0, qd, heads), cos, sin), rope_rows(part(qd, kvd, kv_heads), cos, sin),
          part(qd + kvd, kvd, kv_heads)};
}

// x + o's heads merged times a 4-bit output weight (models/fused.py q4_out; models/llama.py attn_output):
// x [B, S, hidden], o [B, H, S, D] -> [B, S, hidden], x's dtype
torch::Tensor q4_out(torch::Tensor x, torch::Tensor o, torch::Tensor codes, torch::Tensor dm) {
  TORCH_CHECK(x.dim() == 3 && o.dim() == 4, "x [B, S, hidden], o [B, H, S, D]");
  const torch::Tensor a = o.transpose(1, 2).reshape({x.size(0) * x.size(1), -1}).to(x.scalar_type()).contiguous();
  return x + q4_matmul(a, codes, dm).view(x.sizes());
}

// A step's new tokens into a KV buffer (kv/block_table.py append), one call for every plane, no tensor made:
// planes[i] [B, Hkv, S, D] into dst[i, :, :, row:row + S] (dst: [planes, B, Hkv, T, D]; any strides; float32,
// bfloat16 or float16 each, converted as copy_ converts: rounded to nearest). Returns false, having written
// nothing, where a tensor is of another dtype or device (the caller copies then).
namespace {
template <typename O, typename I>
void put_plane(O* d, const torch::Tensor& dst, int64_t row, const I* x, const torch::Tensor& p) {
  const int64_t B = p.size(0), H = p.size(1), S = p.size(2), D = p.size(3), od = dst.stride(4), id = p.stride(3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s) {
        O* o = d + b * dst.stride(1) + h * dst.stride(2) + (row + s) * dst.stride(3);
        const I* r = x + b * p.stride(0) + h * p.stride(1) + s * p.stride(2);
        for (int64_t i = 0; i < D; ++i) o[i * od] = static_cast<O>(static_cast<float>(r[i * id]));
      }
}

bool float_cpu(const torch::Tensor& t) {
  const auto dt = t.scalar_type();
  return t.is_cpu() && (dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf);
}
}  // namespace

bool put_rows(torch::Tensor dst, int64_t row, std::vector<torch::Tensor> planes) {
  TORCH_CHECK(dst.dim() == 5 && static_cast<int64_t>(planes.size()) <= dst.size(0), "dst: [planes, B, Hkv, T, D]");
  bool ok = float_cpu(dst);
  for (const auto& p : planes) {
    TORCH_CHECK(p.dim() == 4 && p.size(0) == dst.size(1) && p.size(1) == dst.size(2) && p.size(3) == dst.size(4) &&
                    row >= 0 && row + p.size(2) <= dst.size(3),
                "planes: [B, Hkv, S, D] like dst's, inside dst's T");
    ok = ok && float_cpu(p);
  }
  if (!ok) return false;
  for (size_t i = 0; i < planes.size(); ++i) {
    const torch::Tensor& p = planes[i];
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst.scalar_type(), "put_rows", [&] {
      using O = scalar_t;
      O* d = dst.data_ptr<O>() + static_cast<int64_t>(i) * dst.stride(0);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "put_rows", [&] {
        put_plane(d, dst, row, p.data_ptr<scalar_t>(), p);
      });
    });
  }
  return true;
}

std::vector<torch::Tensor> decode_attention_parts(torch::Tensor q, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                                                  std::vector<c10::optional<torch::Tensor>> masks,
                                                  std::vector<c10::optional<torch::Tensor>> rows);  // decode_kernel.cpp

// decode_attention over a decode step's query as the model gives it (models/layers.py kernel_decode): q [B, H, 1, D]
// (float32 or bfloat16), its heads grouped over k's Hkv in the call, not around it. Returns (out [B, H, 1, D] in q's
// dtype, lse [B, H, 1] float32).
std::vector<torch::Tensor> decode_attention_heads(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                  c10::optional<torch::Tensor> mask, c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && q.size(1) % k.size(1) == 0,
              "q [B, H, 1, D] over k [B, Hkv, T, D], H a multiple of Hkv");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1);
  auto got = decode_attention_parts(q.reshape({B, Hkv, H / Hkv, D}).contiguous(), {k}, {v}, {mask}, {rows});
  return {got[0].view({B, H, 1, D}), got[1].view({B, H, 1})};
}
