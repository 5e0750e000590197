"""The shared peer runners (flexgen_sparpr/bench/peers.py): a stopped upstream child is one line,
and HF's compute-tier need is what its cap is checked against."""
from types import SimpleNamespace

from flexgen_sparpr.bench.peers import hf_need, hf_offload_opt, upstream


def test_upstream_past_its_timeout_is_one_line():
    r = upstream(0.01, model="opt-125m", batch=1, prompt_len=8, gen_len=2)
    assert r == {"ok": False, "timeout": True, "error": "timed out after 0.01 s"}


def test_hf_over_the_cap_is_oom_without_running():
    spec = SimpleNamespace(num_layers=2, kv_dim=8, hidden=8, ffn=32, num_params=lambda: 1000)
    need = hf_need(spec, batch=2, ctx=10, gen_len=2)
    assert need == {"weights": 4000, "kv": 2 * 2 * 12 * 2 * 8 * 4, "activations": 2 * 10 * (8 * 4 + 32) * 4}
    r = hf_offload_opt(spec, [[5] * 10] * 2, 2, cap=need["kv"] + need["activations"], seed=0, offload_dir=".")
    assert r["ok"] is False and r["oom"] and r["error"].startswith("OOM: KV cache + activations")
