// The compiled CPU kernels' Python module (models/cpu_kernel.py builds it with the other .cpp files).
#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> decode_attention_parts(torch::Tensor q, std::vector<torch::Tensor> ks,
                                                  std::vector<torch::Tensor> vs,
                                                  std::vector<c10::optional<torch::Tensor>> masks,
                                                  std::vector<c10::optional<torch::Tensor>> rows);  // decode_kernel.cpp
bool simd();  // decode_kernel.cpp
int64_t simd_width();  // decode_kernel.cpp
torch::Tensor lowrank_scores(torch::Tensor q, torch::Tensor basis, torch::Tensor codes, c10::optional<torch::Tensor> bias,
                             int64_t bs, int64_t nb);  // lowrank_kernel.cpp
bool lowrank_encode(torch::Tensor keys, torch::Tensor u, torch::Tensor step, torch::Tensor codes,
                    int64_t block);  // lowrank_kernel.cpp

std::vector<torch::Tensor> pick_rows(torch::Tensor score, c10::optional<torch::Tensor> own, int64_t k, int64_t bs,
                                     int64_t length);  // select_kernel.cpp

torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor dm);  // weight_kernel.cpp
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d);  // weight_kernel.cpp
std::vector<torch::Tensor> quantize_rows(torch::Tensor x, bool wide);  // weight_kernel.cpp
torch::Tensor bf16_matmul(torch::Tensor x, torch::Tensor w);  // bf16_kernel.cpp
torch::Tensor f32_matmul(torch::Tensor x, torch::Tensor w);  // bf16_kernel.cpp
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps);  // glue_kernel.cpp
torch::Tensor rope_rows(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);  // glue_kernel.cpp
torch::Tensor silu_mul_rows(torch::Tensor gu);  // glue_kernel.cpp
torch::Tensor q4_mlp(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor gu_codes, torch::Tensor gu_dm,
                     torch::Tensor down_codes, torch::Tensor down_dm);  // glue_kernel.cpp
std::vector<torch::Tensor> q4_qkv(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor codes, torch::Tensor dm,
                                  torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads);  // glue_kernel.cpp
torch::Tensor q4_out(torch::Tensor x, torch::Tensor o, torch::Tensor codes, torch::Tensor dm);  // glue_kernel.cpp
bool put_rows(torch::Tensor dst, int64_t row, std::vector<torch::Tensor> planes);  // glue_kernel.cpp
std::vector<torch::Tensor> decode_attention_heads(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                  c10::optional<torch::Tensor> mask, c10::optional<torch::Tensor> rows);  // glue_kernel.cpp

// The kernels touch no Python object: they let go of the GIL while they run, so the engine's I/O threads
// (disk reads, copies) go on meanwhile instead of waiting for the kernel to return.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("simd", &simd);
  m.def("simd_width", &simd_width);
  m.def("decode_attention_parts", &decode_attention_parts, nogil);
  m.def("lowrank_scores", &lowrank_scores, nogil);
  m.def("lowrank_encode", &lowrank_encode, nogil);
  m.def("pick_rows", &pick_rows, nogil);
  m.def("q4_matmul", &q4_matmul, nogil);
  m.def("q8_matmul", &q8_matmul, nogil);
  m.def("quantize_rows", &quantize_rows, nogil);
  m.def("bf16_matmul", &bf16_matmul, nogil);
  m.def("f32_matmul", &f32_matmul, nogil);
  m.def("rms_norm_rows", &rms_norm_rows, nogil);
  m.def("rope_rows", &rope_rows, nogil);
  m.def("silu_mul_rows", &silu_mul_rows, nogil);
  m.def("q4_mlp", &q4_mlp, nogil);
  m.def("q4_qkv", &q4_qkv, nogil);
  m.def("q4_out", &q4_out, nogil);
  m.def("put_rows", &put_rows, nogil);
  m.def("decode_attention_heads", &decode_attention_heads, nogil);
}
