// A block selection's pick and the rows attention reads, in one call a layer (kv/policies/fused_pick.py):
// the budgeted top-k where every block holds bs tokens (scoring.top_pick: torch's own top-k, so ties
// fall as they do there), the blocks every step reads added, and each sequence's picked blocks laid out
// as cache rows in place (selection._rows_selection's layout), with the counts the statistics need.
// Python took about a dozen tensor calls for this (~0.1 ms a layer at batch 1, ~0.3 ms at batch 4).
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <vector>

// score: [B, nb] float32 (-inf: never picked); own: [B, nb] bool or None (always read, outside the k);
// k: blocks the budget takes beyond own; bs: tokens a block; length: cached tokens (the open block is
// length - nb bs of them, always read).
// Returns {pick [B, nb] bool, rows [B, W] int64, mask [B, 1, W] bool, readers [nb] int64, seqs [B, n] bool}:
// row b holds sequence b's picked blocks ascending, padded to the longest row with the first blocks it
// did not pick (masked out), then the open block's positions; readers counts the sequences picking each
// block; seqs says which sequences read each of the n blocks some sequence picked, and the open block.
std::vector<torch::Tensor> pick_rows(torch::Tensor score, c10::optional<torch::Tensor> own, int64_t k, int64_t bs,
                                     int64_t length) {
  TORCH_CHECK(score.dim() == 2 && score.scalar_type() == torch::kFloat32, "score: float32 [B, nb]");
  const int64_t B = score.size(0), nb = score.size(1), open = length - nb * bs;
  TORCH_CHECK(bs >= 1 && open >= 0 && open < bs, "length within the open block after nb sealed ones");
  torch::Tensor pick;
  torch::Tensor s = score;
  if (own.has_value()) {
    TORCH_CHECK(own->scalar_type() == torch::kBool && own->sizes() == score.sizes(), "own: bool [B, nb]");
    s = score.masked_fill(*own, -std::numeric_limits<float>::infinity());
    pick = own->contiguous().clone();
  } else {
    pick = torch::zeros({B, nb}, score.options().dtype(torch::kBool));
  }
  bool* pp = pick.data_ptr<bool>();
  const int64_t kk = std::min(k, nb);
  if (kk > 0) {
    auto top = at::topk(s, kk, -1, true, false);
    auto vals = std::get<0>(top).contiguous(), idx = std::get<1>(top).contiguous();
    const float* vp = vals.data_ptr<float>();
    const int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < kk; ++j)
        if (vp[b * kk + j] > -std::numeric_limits<float>::infinity()) pp[b * nb + ip[b * kk + j]] = true;
  }
  auto readers = torch::zeros({nb}, score.options().dtype(torch::kLong));
  int64_t* rp = readers.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    for (int64_t j = 0; j < nb; ++j) {
      n += pp[b * nb + j];
      rp[j] += pp[b * nb + j];
    }
    most = std::max(most, n);
  }
  const int64_t W = most * bs + open;
  auto rows = torch::empty({B, W}, score.options().dtype(torch::kLong));
  auto mask = torch::empty({B, 1, W}, score.options().dtype(torch::kBool));
  int64_t* wp = rows.data_ptr<int64_t>();
  bool* mp = mask.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t* w = wp + b * W;
    bool* m = mp + b * W;
    int64_t at = 0;
    for (int pass = 1; pass >= 0 && at < most; --pass)  // the picked blocks, then unpicked ones as padding
      for (int64_t j = 0; j < nb && at < most; ++j) {
        if (pp[b * nb + j] != static_cast<bool>(pass)) continue;
        for (int64_t t = 0; t < bs; ++t) {
          w[at * bs + t] = j * bs + t;
          m[at * bs + t] = pass;
        }
        ++at;
      }
    for (int64_t t = 0; t < open; ++t) {
      w[most * bs + t] = nb * bs + t;
      m[most * bs + t] = true;
    }
  }
  std::vector<int64_t> cols;
  for (int64_t j = 0; j < nb; ++j)
    if (rp[j]) cols.push_back(j);
  const int64_t n = cols.size() + (open > 0);
  auto seqs = torch::ones({B, n}, score.options().dtype(torch::kBool));
  bool* sp = seqs.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b)
    for (size_t c = 0; c < cols.size(); ++c) sp[b * n + c] = pp[b * nb + cols[c]];
  return {pick, rows, mask, readers, seqs};
}
