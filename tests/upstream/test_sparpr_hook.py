"""apply_sparpr: SparPR inside upstream FlexGen. Its decode cache loading moves only the selected
blocks (counted per home); keep_ratio 1.0 changes nothing, bit for bit."""
from __future__ import annotations

import math
import os
import subprocess

import pytest
import torch

from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.upstream.sparpr_hook import (SparPRConfig, _Summaries, apply_sparpr, pick_blocks,
                                                 remove_sparpr, sparpr_stats)
from tests.upstream.recording import B, G, P, run_recording

DISK = (100, 0, 0, 0, 100, 0)  # upstream's --percent with the KV cache on its disk tier
ROW = B * 768 * 2 * 2  # K and V of one position of opt-125m's batch, float16


@pytest.fixture(autouse=True)
def unhooked():
    yield
    remove_sparpr()


@pytest.fixture(scope="module")
def dense_disk():
    return run_recording(percent=DISK)


def test_keep_ratio_one_is_bit_identical(dense_recorded, dense_disk):
    for (dense, dense_outs), percent in ((dense_recorded, None), (dense_disk, DISK)):
        hooked, hooked_outs = run_recording({"keep_ratio": 1.0, "block_size": 16},
                                            **({"percent": percent} if percent else {}))
        st = sparpr_stats()
        assert st.calls == len(hooked_outs) == 12 * (G - 1)  # every layer of both decode steps went through it
        assert st.tokens_read == st.tokens_valid > 0
        assert hooked["tokens"] == dense["tokens"]
        assert all(torch.equal(a, b) for a, b in zip(dense_outs, hooked_outs))
        # cached positions [0, P + i - 1) of every layer and step came through, from disk when it is the home
        want = sum(P + i - 1 for i in range(1, G)) * 12 * ROW
        assert st.bytes_moved == ({"disk": want} if percent else {})


def test_below_one_moves_only_the_selected_blocks(dense_disk, monkeypatch):
    import flexgen.pytorch_backend as backend
    copies, general_copy = [], backend.general_copy

    def recording(dst, dst_idx, src, src_idx):
        if getattr(src.device, "device_type", None) == backend.DeviceType.DISK:
            copies.append((src_idx[0].start, src_idx[0].stop))
        return general_copy(dst, dst_idx, src, src_idx)
    monkeypatch.setattr(backend, "general_copy", recording)
    hooked, outs = run_recording({"keep_ratio": 0.3, "block_size": 4}, percent=DISK)
    st = sparpr_stats()
    rows = sum(b - a for a, b in copies) // 2  # K and V
    assert st.bytes_moved == {"disk": rows * ROW} and st.requests == {"disk": len(copies)}
    assert st.tokens_read == rows * B  # no padding: every row copied is read by both sequences
    assert rows * ROW < 0.5 * dense_disk[0]["kv_read_bytes"]
    for context, read, valid in st.per_call:
        assert read <= B * (math.ceil(0.3 * context) + 4)  # the budget (+ a block: the sink's floor)
    assert not all(torch.equal(a, b) for a, b in zip(dense_disk[1], outs))
    assert st.spans * 2 == len(copies) and st.summary_bytes > 0


def test_summaries_are_the_masked_mean_of_each_run():
    torch.manual_seed(0)
    b, h, d, run = 2, 3, 4, 4
    k = torch.randn(13, b * h, d)
    valid = torch.ones(b, 13, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    s = _Summaries(16, b * h, d, b, run, torch.float32, torch.device("cpu"))
    s.add(k[:10], valid[:, :10], 0)  # a prefill, then decode tokens one by one
    for p in range(10, 13):
        s.add(k[p:p + 1], valid[:, p:p + 1], p)
    kk = k.view(13, b, h, d)
    for r in range(4):
        for q in range(b):
            pos = [p for p in range(r * run, min(13, (r + 1) * run)) if valid[q, p]]
            assert int(s.count[r, q]) == len(pos)
            if pos:
                torch.testing.assert_close(s.mean[r].view(b, h, d)[q], kk[pos, q].mean(dim=0))


def test_pick_keeps_sink_recent_and_the_best_block_for_the_batch():
    """4 blocks of 2 sealed + the open token; block 1 points along the query for both sequences."""
    b, h, d = 2, 2, 4
    k = 0.01 * torch.randn(9, b * h, d)
    k[2:4, :, 0] = 5.0
    q = torch.zeros(b, h, 1, d)
    q[..., 0] = 1.0
    mask = torch.ones(b, 10, dtype=torch.bool)
    s = _Summaries(10, b * h, d, b, 2, torch.float32, torch.device("cpu"))
    s.add(k, mask[:, :9], 0)
    cfg = SparPRConfig(SparPR(keep_ratio=0.7, recent_blocks=1, summary_tokens=0), block_size=2)
    assert pick_blocks(q, s, mask, cfg) == [0, 1, 3]  # sink, best, recent (budget 7 of 9 tokens)
    assert pick_blocks(q, s, mask, SparPRConfig(SparPR(keep_ratio=1.0), block_size=2)) == [0, 1, 2, 3]


def test_apply_and_remove():
    import flexgen.flex_opt as flex
    originals = flex.SelfAttention.load_cache, flex.SelfAttention.forward
    apply_sparpr(keep_ratio=0.5)
    apply_sparpr(keep_ratio=0.25)  # re-applying changes the knobs, wraps once
    assert flex.SelfAttention.forward is not originals[1]
    remove_sparpr()
    assert (flex.SelfAttention.load_cache, flex.SelfAttention.forward) == originals
    for bad in (dict(keep_ratio=0), dict(keep_ratio=1.5), dict(min_keep=0), dict(block_size=0),
                dict(recent_blocks=-1), dict(block_size=64, summary_tokens=5)):
        with pytest.raises(ValueError):
            apply_sparpr(**bad)
    # the engine's own SparPR object: its knobs have one home (kv/policies/sparpr.py)
    own = SparPR(keep_ratio=0.3, min_keep=0.2)
    cfg = apply_sparpr(own, block_size=16)
    assert cfg.policy is own and (cfg.keep_ratio, cfg.min_keep, cfg.block_size) == (0.3, 0.2, 16)
    assert apply_sparpr().keep_ratio == SparPR().keep_ratio  # the policy's default, not a second one
    with pytest.raises(ValueError, match="not both"):
        apply_sparpr(own, keep_ratio=0.5)
    remove_sparpr()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/blkio/cgroup.procs"),
                    reason="counts the device's reads in a blkio cgroup: needs root and cgroup v1 blkio")
def test_uncached_disk_tier_reads_what_it_asks_for_from_the_disk(tmp_path):
    """Upstream re-reads its memory-mapped KV from the page cache; with its disk tier uncached
    (upstream/patches.py) the device serves about the bytes its loads ask for."""
    from flexgen_sparpr.bench.throttle import ReadThrottle, ThrottleUnavailable
    from flexgen_sparpr.upstream.run import parse_child, upstream_command
    folder = "/var/tmp"
    try:
        th = ReadThrottle(10_000, folder).open()  # a cap far above the disk: used only to count
    except ThrottleUnavailable as e:
        pytest.skip(str(e))
    try:
        got = {}
        for uncached in (False, True):
            before = th.read_bytes()
            cmd = upstream_command(batch=2, prompt_len=256, gen_len=4, percent=DISK, offload_dir=folder,
                                   drop_page_cache=uncached, threads=1)
            proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=lambda: th.attach(os.getpid()))
            r = parse_child(proc.returncode, proc.stdout, proc.stderr)
            assert r["ok"], r
            got[uncached] = (th.read_bytes() - before, r["kv_read_bytes"])
    finally:
        th.close()
    assert got[False][0] < 0.2 * got[False][1]
    assert 0.9 * got[True][1] <= got[True][0] <= 1.3 * got[True][1]
