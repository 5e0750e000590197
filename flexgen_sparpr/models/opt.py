"""OPT decoder (HF OPTForCausalLM naming, learned positions offset by 2, ReLU MLP)."""
from __future__ import annotations

import torch

from .layers import layer_norm, linear, merge_heads, split_heads
from .spec import ModelSpec

_P = "model.decoder."


class OPT:
    def __init__(self, spec: ModelSpec):
        self.spec = spec

    # --- weight names: short key -> checkpoint name ---
    def embed_names(self) -> dict[str, str]:
        names = {"tok": _P + "embed_tokens.weight", "pos": _P + "embed_positions.weight"}
        if self.spec.word_embed_dim:
            names["proj_in"] = _P + "project_in.weight"
        return names

    def attn_names(self, i: int) -> dict[str, str]:
        p = f"{_P}layers.{i}."
        names = {"ln.w": p + "self_attn_layer_norm.weight", "ln.b": p + "self_attn_layer_norm.bias"}
        for s in ("q", "k", "v", "out"):
            names[f"{s}.w"] = f"{p}self_attn.{s}_proj.weight"
            names[f"{s}.b"] = f"{p}self_attn.{s}_proj.bias"
        return names

    def mlp_names(self, i: int) -> dict[str, str]:
        p = f"{_P}layers.{i}."
        names = {"ln.w": p + "final_layer_norm.weight", "ln.b": p + "final_layer_norm.bias"}
        for s in ("fc1", "fc2"):
            names[f"{s}.w"], names[f"{s}.b"] = p + s + ".weight", p + s + ".bias"
        return names

    def head_names(self) -> dict[str, str]:
        names = {"tok": _P + "embed_tokens.weight"}
        if self.spec.pre_norm:
            names |= {"ln.w": _P + "final_layer_norm.weight", "ln.b": _P + "final_layer_norm.bias"}
        if self.spec.word_embed_dim:
            names["proj_out"] = _P + "project_out.weight"
        if not self.spec.tie_embeddings:
            names["tok"] = "lm_head.weight"
        return names

    # --- maths ---
    def embed(self, w, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids, pos: [B, S] -> x: [B, S, hidden]."""
        x = w["tok"][ids]
        if "proj_in" in w:
            x = linear(x, w["proj_in"])
        return x + w["pos"][pos + 2]

    def attn_input(self, w, x: torch.Tensor) -> torch.Tensor:
        """The input of the Q/K/V projections (the recompute checkpoint)."""
        return layer_norm(x, w["ln.w"], w["ln.b"]) if self.spec.pre_norm else x

    def input_qkv(self, w, x: torch.Tensor, pos: torch.Tensor):
        """attn_input, then qkv: (h, q, k, v)."""
        h = self.attn_input(w, x)
        return (h, *self.qkv(w, h, pos))

    def kv(self, w, h: torch.Tensor, pos: torch.Tensor):
        """h: [B, S, hidden] -> k, v: [B, Hkv, S, D]."""
        nh = self.spec.num_kv_heads
        return (split_heads(linear(h, w["k.w"], w["k.b"]), nh),
                split_heads(linear(h, w["v.w"], w["v.b"]), nh))

    def query(self, w, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """h: [B, S, hidden] -> q: [B, H, S, D] (the query alone, e.g. to select blocks early)."""
        return split_heads(linear(h, w["q.w"], w["q.b"]), self.spec.num_heads)

    def qkv(self, w, h: torch.Tensor, pos: torch.Tensor):
        return (self.query(w, h, pos), *self.kv(w, h, pos))

    def attn_output(self, w, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x: [B, S, hidden] residual; o: [B, H, S, D] attention output."""
        x = x + linear(merge_heads(o).to(x.dtype), w["out.w"], w["out.b"])
        return x if self.spec.pre_norm else layer_norm(x, w["ln.w"], w["ln.b"])

    def mlp(self, w, x: torch.Tensor) -> torch.Tensor:
        h = layer_norm(x, w["ln.w"], w["ln.b"]) if self.spec.pre_norm else x
        x = x + linear(torch.relu(linear(h, w["fc1.w"], w["fc1.b"])), w["fc2.w"], w["fc2.b"])
        return x if self.spec.pre_norm else layer_norm(x, w["ln.w"], w["ln.b"])

    def head(self, w, x: torch.Tensor) -> torch.Tensor:
        """x: [B, hidden] (last position) -> logits: [B, vocab]."""
        if "ln.w" in w:
            x = layer_norm(x, w["ln.w"], w["ln.b"])
        if "proj_out" in w:
            x = linear(x, w["proj_out"])
        return linear(x, w["tok"])
