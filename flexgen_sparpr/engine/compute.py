"""What one cell of the schedule computes: the schedule's layers (embeddings, attention and MLP
of each decoder layer or both fused, the LM head), a layer's maths on one GPU batch's hidden
state, and its attention with the batch's KV table (prefill, prefill onto a kept cache, or a
decode step reading what the KV policy selected), and where the hidden state waits between
layers. The executor (engine/executor.py) decides when; this module, what."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.layers import causal_attention
from ..storage.tiers import Tier
from .attention import append_attention, pads_valid
from .weights import sub_weights


@dataclass
class Layer:
    kind: str  # embed | attn | mlp | block (attn + mlp, when not sep_layer) | head
    index: int
    names: dict[str, str]

    @property
    def reads_cache(self) -> bool:
        """Whether the layer attends, so reads a KV cache at a decode step."""
        return self.kind in ("attn", "block")


def schedule_layers(arch, spec, sep_layer: bool, stage=None) -> list[Layer]:
    """The schedule's layers: this stage's decoder layers, the embeddings on the first stage and
    the LM head on the last (every one without a stage)."""
    a = arch
    layers = [Layer("embed", -1, a.embed_names())] if stage is None or stage.is_first else []
    for i in (stage.layers if stage else range(spec.num_layers)):
        if sep_layer:
            layers += [Layer("attn", i, a.attn_names(i)), Layer("mlp", i, a.mlp_names(i))]
        else:
            names = {f"a.{k}": v for k, v in a.attn_names(i).items()}
            names |= {f"m.{k}": v for k, v in a.mlp_names(i).items()}
            layers.append(Layer("block", i, names))
    return layers + ([Layer("head", -1, a.head_names())] if stage is None or stage.is_last else [])


def compute(eng, layer: Layer, w, x, ids, k: int, pos, pads, fetched, prefill: bool):
    """Layer `layer` on GPU batch k: (its output, store jobs of the KV blocks it sealed)."""
    a = eng.arch
    if layer.kind == "embed":
        return a.embed(w, ids, pos), []
    if layer.kind == "attn":
        return attention(eng, w, x, layer.index, k, pos, pads, fetched, prefill)
    if layer.kind == "mlp":
        return a.mlp(w, x), []
    if layer.kind == "block":
        wa, wm = sub_weights(w, "a."), sub_weights(w, "m.")
        x, jobs = attention(eng, wa, x, layer.index, k, pos, pads, fetched, prefill)
        return a.mlp(wm, x), jobs
    return a.head(w, x[:, -1]).float(), []  # logits: [B, vocab]


def attention(eng, w, x, layer_idx: int, k: int, pos, pads, fetched, prefill: bool):
    a = eng.arch
    h, q, kk, vv = a.input_qkv(w, x, pos)
    t = eng.tables[(layer_idx, k)]
    pol = eng.kv_policy
    ckpt_jobs = t.checkpoints.append(h[:, None]) if t.checkpoints is not None else []  # [B, 1, S, hidden]
    if prefill and t.length:  # onto a kept cache (a reused prefix, one sequence): its blocks read whole
        o, jobs = append_attention(t, q, kk, vv), t.append(kk, vv)
    elif prefill:
        valid = pads_valid(pos, pads)
        o = pol.prefill(t, layer_idx, q, kk, vv, valid)
        if o is None:
            o = causal_attention(q, kk, vv, valid)
        jobs = t.append(kk, vv)
        if valid is None:
            valid = torch.ones(pos.shape, dtype=torch.bool, device=pos.device)
        for observer in (pol, *eng._observers):
            observer.on_prefill(t, layer_idx, q, kk, valid)
    else:  # a decode step: the reader's path (the policy's own, split by home, or read and attend)
        o, jobs = eng.reader.attend(t, layer_idx, q, kk, vv, fetched, w, pads)
    return a.attn_output(w, x, o), jobs + ckpt_jobs


def park(eng, x: torch.Tensor) -> torch.Tensor:
    """Move a batch's hidden state to its activation tier between layers."""
    if eng.act_home == Tier.CPU and x.device != torch.device("cpu"):
        eng.devices.counters.add("compute", "cpu", x.nbytes)
        return x.to("cpu", non_blocking=True)
    return x
