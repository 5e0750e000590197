// A block selection's pick and the rows attention reads, in one call a layer (kv/policies/fused_pick.py):
// the budgeted top-k where every block holds bs tokens (scoring.top_pick: torch's own top-k, so ties
// fall as they do there), the blocks every step reads added, and each sequence's picked blocks laid out
// as cache rows in place (selection._rows_selection's layout), with the counts the statistics need.
// Python took about a dozen tensor calls for this (~0.1 ms a layer at batch 1, ~0.3 ms at batch 4).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// bit tests: -ffast-math lets the compiler assume no value is infinite or NaN
inline bool neg_inf(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u == 0xff800000u;
}

inline bool nan(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x7fffffffu) > 0x7f800000u;
}

// The k largest of a row's n scores (k < n) when they are one set whatever the ties: the k-th largest, or
// false where a NaN is there or the k-th ties the next one (then torch's own top-k decides which equal
// block it takes). Here without a tensor call: after a layer's weights went through the caches each such
// call cost 5-20 us.
bool unique_kth(const float* s, int64_t n, int64_t k, std::vector<float>& buf, float* kth) {
  buf.assign(s, s + n);
  for (float x : buf)
    if (nan(x)) return false;
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
  *kth = buf[k - 1];
  const float next = *std::max_element(buf.begin() + k, buf.end());
  return next < *kth || neg_inf(*kth);
}

}  // namespace

// score: [B, nb] float32 (-inf: never picked); own: [B, nb] bool or None (always read, outside the k);
// k: blocks the budget takes beyond own; bs: tokens a block; length: cached tokens (the open block is
// length - nb bs of them, always read).
// Returns {pick [B, nb] bool, rows [B, W + 1] int64, mask [B, 1, W] bool, host [2 + 2 n] int64, seqs [B, n'] bool}:
// row b holds sequence b's picked blocks ascending, padded to the longest row with the first blocks it
// did not pick (masked out), then the open block's positions, then `length` (the step's new token, appended
// next: the caller attends rows[:, :W] until then); host holds, for the one host read, the spans (runs of
// blocks some sequence reads) and the tokens read (the statistics), the n blocks some sequence picked
// (ascending), then how many sequences read each; seqs says which sequences read each of them, and the open
// block (n' = n + 1 where there is one).
std::vector<torch::Tensor> pick_rows(torch::Tensor score, c10::optional<torch::Tensor> own, int64_t k, int64_t bs,
                                     int64_t length) {
  TORCH_CHECK(score.dim() == 2 && score.scalar_type() == torch::kFloat32, "score: float32 [B, nb]");
  const int64_t B = score.size(0), nb = score.size(1), open = length - nb * bs;
  TORCH_CHECK(bs >= 1 && open >= 0 && open < bs, "length within the open block after nb sealed ones");
  const bool has_own = own.has_value();
  if (has_own) TORCH_CHECK(own->scalar_type() == torch::kBool && own->sizes() == score.sizes(), "own: bool [B, nb]");
  const torch::Tensor sc = score.contiguous(), ow = has_own ? own->contiguous() : torch::Tensor();
  const float* scp = sc.data_ptr<float>();
  const bool* owp = has_own ? ow.data_ptr<bool>() : nullptr;
  auto pick = torch::empty({B, nb}, score.options().dtype(torch::kBool));
  bool* pp = pick.data_ptr<bool>();
  const int64_t kk = std::min(k, nb);
  std::vector<float> row(nb), buf;
  for (int64_t b = 0; b < B; ++b) {
    bool* pr = pp + b * nb;
    for (int64_t j = 0; j < nb; ++j) {  // own blocks are read anyway: out of the k
      pr[j] = owp && owp[b * nb + j];
      row[j] = pr[j] ? -std::numeric_limits<float>::infinity() : scp[b * nb + j];
    }
    if (kk == 0) continue;
    float kth;
    if (kk == nb || unique_kth(row.data(), nb, kk, buf, &kth)) {
      for (int64_t j = 0; j < nb; ++j)
        if (!neg_inf(row[j]) && (kk == nb || row[j] >= kth)) pr[j] = true;
      continue;
    }
    auto top = at::topk(torch::from_blob(row.data(), {nb}, sc.options()), kk, -1, true, false);
    auto vals = std::get<0>(top).contiguous(), idx = std::get<1>(top).contiguous();
    const float* vp = vals.data_ptr<float>();
    const int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t j = 0; j < kk; ++j)
      if (!neg_inf(vp[j])) pr[ip[j]] = true;
  }
  std::vector<int64_t> readers(nb + 2, 0);
  int64_t* rp = readers.data();
  int64_t most = 0, picked = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    for (int64_t j = 0; j < nb; ++j) {
      n += pp[b * nb + j];
      rp[j] += pp[b * nb + j];
    }
    most = std::max(most, n);
    picked += n;
  }
  for (int64_t j = 0; j < nb; ++j) rp[nb] += rp[j] && (j == 0 || !rp[j - 1]);  // spans: runs of blocks some sequence reads
  rp[nb + 1] = picked * bs + B * open;  // tokens read: every block holds bs (the fused pick's premise)
  const int64_t W = most * bs + open;
  auto rows = torch::empty({B, W + 1}, score.options().dtype(torch::kLong));
  auto mask = torch::empty({B, 1, W}, score.options().dtype(torch::kBool));
  int64_t* wp = rows.data_ptr<int64_t>();
  bool* mp = mask.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t* w = wp + b * (W + 1);
    bool* m = mp + b * W;
    w[W] = length;
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
  const int64_t nc = cols.size(), n = nc + (open > 0);
  auto host = torch::empty({2 + 2 * nc}, score.options().dtype(torch::kLong));
  int64_t* hp = host.data_ptr<int64_t>();
  hp[0] = rp[nb];
  hp[1] = rp[nb + 1];
  for (int64_t c = 0; c < nc; ++c) {
    hp[2 + c] = cols[c];
    hp[2 + nc + c] = rp[cols[c]];
  }
  auto seqs = torch::empty({B, n}, score.options().dtype(torch::kBool));
  bool* sp = seqs.data_ptr<bool>();
  std::fill(sp, sp + B * n, true);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < nc; ++c) sp[b * n + c] = pp[b * nb + cols[c]];
  return {pick, rows, mask, host, seqs};
}
