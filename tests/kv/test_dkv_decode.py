"""DKV's decode state: the exact rows a step attends that change only when a block seals (the
residual rows and, on the CPU, a copy of the sink and recent blocks with room for the open block,
which each step writes its token into) are made once per seal."""
from __future__ import annotations

import pytest
import torch

import flexgen_sparpr.kv.policies.dkv as dkv_mod
from flexgen_sparpr.bench.forced import ForcedTokens
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies.dkv import DKV
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 43)), list(range(50, 79))]


def _decodes(model_dir, tmp_path, residuals):
    """Seals during the decode, a restore to before them, a second decode forced onto other tokens
    (the same blocks sealed again with other rows) and a prefill of other prompts of the same
    lengths: the three results."""
    forced = [[(7 * i + 5 * b) % 90 + 3 for i in range(20)] for b in range(len(PROMPTS))]
    cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path), kv_policy="dkv",
                       policy_args={"rank": 2, "residuals": residuals, "topk": 1})
    with Engine(resolve_source(str(model_dir), ""), Policy(gpu_batch_size=2), cfg) as eng:
        snap = eng.snapshot(eng.prefill(PROMPTS, 20, keep_logits=True))  # 20 tokens: 8-token blocks seal
        first = eng.decode(eng.restore(snap))
        st = eng.restore(snap)
        st.sampler = ForcedTokens(forced)
        again = eng.decode(st)
        other = eng.generate([[t + 1 for t in p] for p in PROMPTS], 20, keep_logits=True)
    assert first.tokens != again.tokens  # the second decode wrote other rows
    return first, again, other


@pytest.mark.parametrize("copies", [True, False])
@pytest.mark.parametrize("residuals", [1, 0])
def test_fixed_exact_rows_are_made_once_per_seal_and_equal_making_them_every_step(tiny_llama_dir, tmp_path,
                                                                                   monkeypatch, copies, residuals):
    """The residual rows and (copies: the CPU's way) a copy of the sink and recent blocks and of
    the open block (its token written each step) are attended as one tensor, made again only when
    a block seals, a prefill changes the blocks or a restore rewinds the table: the same logits as
    making it every step."""
    monkeypatch.setattr(dkv_mod, "copies_window", lambda device: copies)
    made, calls = DKV._fixed, {"made": 0, "steps": 0}

    def counting(st, *a):
        calls["steps"] += 1
        key = st.fixed_key
        out = made(st, *a)
        calls["made"] += st.fixed_key != key
        return out

    def every_step(st, *a):
        st.fixed_key = None
        return made(st, *a)
    out = {}
    for name, fn in (("cached", counting), ("every", every_step)):
        monkeypatch.setattr(DKV, "_fixed", staticmethod(fn))
        out[name] = _decodes(tiny_llama_dir, tmp_path, residuals)
    assert 0 < calls["made"] < calls["steps"] / 3
    for got, ref in zip(out["cached"], out["every"]):
        assert got.tokens == ref.tokens
        torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)


def test_copied_exact_blocks_equal_attending_them_in_place(tiny_llama_dir, tmp_path, monkeypatch):
    """The CPU's copy of the sink and recent blocks gives the logits of attending them where they
    live (the GPU's way), to float rounding (the partial attentions merge in another order)."""
    out = {}
    for copies in (True, False):
        monkeypatch.setattr(dkv_mod, "copies_window", lambda device: copies)
        out[copies] = _decodes(tiny_llama_dir, tmp_path, 1)
    for got, ref in zip(out[True], out[False]):
        assert got.tokens == ref.tokens
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_open_block_copy_from_the_first_token(tiny_llama_dir, tmp_path, monkeypatch):
    """Prompts shorter than a block (nothing sealed, the copy only the open block's room) decoded
    past the first seals: the CPU's copy gives the logits of attending the open block where it
    lives."""
    out = {}
    for copies in (True, False):
        monkeypatch.setattr(dkv_mod, "copies_window", lambda device: copies)
        cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path), kv_policy="dkv",
                           policy_args={"rank": 2, "residuals": 1, "topk": 1})
        with Engine(resolve_source(str(tiny_llama_dir), ""), Policy(gpu_batch_size=2), cfg) as eng:
            out[copies] = eng.generate([[5, 6, 7], [9, 10, 11, 12, 13]], 20, keep_logits=True)
    assert out[True].tokens == out[False].tokens
    torch.testing.assert_close(out[True].logits, out[False].logits, rtol=1e-5, atol=1e-5)
