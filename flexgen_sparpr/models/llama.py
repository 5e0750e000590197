"""Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU (HF naming); the
projection biases of Qwen2 (q, k, v) and of Llama's attention_bias / mlp_bias when the spec has them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import q4_mlp, q4_out, q4_qkv
from .layers import apply_rope, linear, merge_heads, rms_norm, rope_cos_sin, silu_mul, split_heads
from .spec import ModelSpec

_P = "model."
_ROPE_MEMO = 8  # position tensors remembered: a step's GPU batches, the rebuilds between them


class Llama:
    def __init__(self, spec: ModelSpec):
        self.spec = spec
        # every layer of a step shares its positions tensor: its cos and sin, kept by the tensor's
        # identity (comparing values would make the host wait for the device at every layer)
        self._rope_memo: dict[tuple[int, torch.dtype], tuple] = {}

    def embed_names(self) -> dict[str, str]:
        return {"tok": _P + "embed_tokens.weight"}

    def attn_names(self, i: int) -> dict[str, str]:
        p = f"{_P}layers.{i}."
        names = {"ln.w": p + "input_layernorm.weight"}
        for s in ("q", "k", "v", "o"):
            names[f"{s}.w"] = f"{p}self_attn.{s}_proj.weight"
            if self.spec.o_bias if s == "o" else self.spec.qkv_bias:
                names[f"{s}.b"] = f"{p}self_attn.{s}_proj.bias"
        return names

    def mlp_names(self, i: int) -> dict[str, str]:
        p = f"{_P}layers.{i}."
        names = {"ln.w": p + "post_attention_layernorm.weight"}
        for s in ("gate", "up", "down"):
            names[f"{s}.w"] = f"{p}mlp.{s}_proj.weight"
            if self.spec.mlp_bias:
                names[f"{s}.b"] = f"{p}mlp.{s}_proj.bias"
        return names

    def head_names(self) -> dict[str, str]:
        tok = _P + "embed_tokens.weight" if self.spec.tie_embeddings else "lm_head.weight"
        return {"ln.w": _P + "norm.weight", "tok": tok}

    def embed(self, w, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return w["tok"][ids]  # [B, S] -> [B, S, hidden]

    def attn_input(self, w, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, w["ln.w"], self.spec.norm_eps)

    def input_qkv(self, w, x: torch.Tensor, pos: torch.Tensor):
        """attn_input, then qkv: (h [B, S, hidden], q [B, H, S, D], k, v [B, Hkv, S, D]); one compiled
        call for 4-bit decode rows (models/fused.py)."""
        if "qkv.w" in w:
            got = q4_qkv(x, w["ln.w"], self.spec.norm_eps, w["qkv.w"], *self._rope(pos, x.dtype),
                         self.spec.num_heads, self.spec.num_kv_heads)
            if got is not None:
                return got
        h = self.attn_input(w, x)
        return (h, *self.qkv(w, h, pos))

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype):
        """cos, sin for positions pos: [B, S]. Position tensors are never changed in place, so one
        seen before (held here, so its id is not reused) has the same cos and sin."""
        key = (id(pos), dtype)
        m = self._rope_memo.get(key)
        if m is not None:
            return m[1], m[2]
        cos, sin = rope_cos_sin(pos, self.spec.head_dim, self.spec.rope_theta, dtype)
        if len(self._rope_memo) >= _ROPE_MEMO:
            del self._rope_memo[next(iter(self._rope_memo))]  # the oldest
        self._rope_memo[key] = (pos, cos, sin)
        return cos, sin

    def _part(self, w, h: torch.Tensor, part: str) -> torch.Tensor:
        """The q ("q") or k|v ("kv") rows of a fused q|k|v product (engine/weights.py FUSED): its own
        rows of the weight where the format can cut there, else the whole product, sliced."""
        qd = self.spec.num_heads * self.spec.head_dim
        fused = w["qkv.w"]
        span = (0, qd) if part == "q" else (qd, fused.shape[0])
        cut = fused.rows(*span)
        return linear(h, cut) if cut is not None else linear(h, fused)[..., span[0]:span[1]]

    def kv(self, w, h: torch.Tensor, pos: torch.Tensor, rope=None):
        """h: [B, S, hidden]; pos: [B, S] -> k, v: [B, Hkv, S, D] (RoPE applied to k)."""
        cos, sin = rope or self._rope(pos, h.dtype)
        if "kv.w" in w or "qkv.w" in w:  # k and v packed as one product (engine/weights.py FUSED)
            k, v = (linear(h, w["kv.w"]) if "kv.w" in w else self._part(w, h, "kv")).chunk(2, dim=-1)
        else:
            k, v = linear(h, w["k.w"], w.get("k.b")), linear(h, w["v.w"], w.get("v.b"))
        return self._heads_kv(k, v, cos, sin)

    def _heads_kv(self, k, v, cos, sin):
        k, v = split_heads(k, self.spec.num_kv_heads), split_heads(v, self.spec.num_kv_heads)  # [B, Hkv, S, D]
        return apply_rope(k, cos, sin), v

    def query(self, w, h: torch.Tensor, pos: torch.Tensor, rope=None) -> torch.Tensor:
        """h: [B, S, hidden]; pos: [B, S] -> q: [B, H, S, D] with RoPE (the query alone)."""
        cos, sin = rope or self._rope(pos, h.dtype)
        q = self._part(w, h, "q") if "qkv.w" in w else linear(h, w["q.w"], w.get("q.b"))  # q: [B, S, H * D]
        return apply_rope(split_heads(q, self.spec.num_heads), cos, sin)

    def qkv(self, w, h: torch.Tensor, pos: torch.Tensor):
        rope = self._rope(pos, h.dtype)
        if "qkv.w" not in w:
            return (self.query(w, h, pos, rope), *self.kv(w, h, pos, rope))
        qd, kvd = self.spec.num_heads * self.spec.head_dim, self.spec.num_kv_heads * self.spec.head_dim
        q, k, v = linear(h, w["qkv.w"]).split([qd, kvd, kvd], dim=-1)  # one product: [B, S, *] each
        return (apply_rope(split_heads(q, self.spec.num_heads), *rope), *self._heads_kv(k, v, *rope))

    def attn_output(self, w, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        y = q4_out(x, o, w["o.w"]) if "o.b" not in w else None  # 4-bit decode rows: one call (models/fused.py)
        if y is not None:
            return y
        return x + linear(merge_heads(o).to(x.dtype), w["o.w"], w.get("o.b"))

    def mlp(self, w, x: torch.Tensor) -> torch.Tensor:
        if "gate_up.w" in w and "down.b" not in w:  # 4-bit decode rows: one compiled call (models/fused.py)
            y = q4_mlp(x, w["ln.w"], self.spec.norm_eps, w["gate_up.w"], w["down.w"])
            if y is not None:
                return y
        h = rms_norm(x, w["ln.w"], self.spec.norm_eps)
        if "gate_up.w" in w:  # one packed product (engine/weights.py FUSED)
            act = silu_mul(linear(h, w["gate_up.w"]))  # act: [B, S, ffn]
        else:
            act = F.silu(linear(h, w["gate.w"], w.get("gate.b"))) * linear(h, w["up.w"], w.get("up.b"))
        return x + linear(act, w["down.w"], w.get("down.b"))

    def head(self, w, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, w["ln.w"], self.spec.norm_eps), w["tok"])
