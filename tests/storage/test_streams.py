"""storage/streams.py's ordering rules, checked on the CPU by tests/stream_double.py (CUDA's stream
and event API with a race checker): disk readers copy on the I/O stream, every hand-off records
its payload (a prefetch's Fetched dataclass, DKV exact rows made in store jobs), and a decode
step makes no host sync per layer outside the selection's own. Each test also shows the double
catching the old code (the fix undone), so a clean run means something."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.io import IOPool
from flexgen_sparpr.engine.recovery import Fetched
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.tier_store import TierStore
from flexgen_sparpr.kv.policy import Selection
from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.streams import Streams
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source
from tests.stream_double import Preloaded, StreamDouble

B, HKV, BS, HD = 2, 2, 4, 8


def _old_carry(self, fn):
    """Streams.carry before #18: the reader thread kept only the caller's inference mode."""
    mode = torch.is_inference_mode_enabled()

    def run(*args):
        with torch.inference_mode(mode):
            return fn(*args)
    return run


@pytest.mark.parametrize("placed", [False, True], ids=["reader-copies", "placed"])
@pytest.mark.parametrize("fixed", [True, False])
def test_disk_readers_copy_on_the_io_stream(fixed, placed, tmp_path, monkeypatch):
    """A gather into a buffer just filled on the I/O stream: the disk readers' copies must be
    ordered after the fill (old code: they ran on their thread's default stream, racing it).
    Placed raw reads (the default) copy nothing on the readers: the calling thread places every
    run in one copy, so they cannot race even with the old code."""
    if not fixed:
        monkeypatch.setattr(Streams, "carry", _old_carry)
    monkeypatch.setattr(TierStore, "placed_reads", placed)
    disk = DiskStore(tmp_path / "offload", read_depth=4)
    try:
        with StreamDouble() as cuda:
            dev = Devices(torch.device("cpu"), stream_api=cuda)
            t = BlockTable(name="t", batch=B, num_kv_heads=HKV, head_dim=HD, block_size=BS, max_len=4 * BS,
                           dtype=torch.float32, homes=[Tier.DISK] * 4, devices=dev, disk=disk)
            k, v = torch.randn(2, B, HKV, 4 * BS, HD)  # k, v: [B, Hkv, T, D]
            for job in t.append(k, v):
                dev.streams.io_task(job)

            def gather():
                buf = torch.zeros(2, B, HKV, 4 * BS, HD)  # the fill, on the I/O stream
                return t.gather(list(range(4)), buf)[0]
            kv = dev.streams.io_task(gather)  # kv: [2, B, Hkv, T, D]
            torch.testing.assert_close(kv, torch.stack([k, v]), rtol=0, atol=0)
    finally:
        disk.close()
    races = [p for p in cuda.problems if p.startswith("race")]
    assert (races == []) == (fixed or placed), cuda.problems


@pytest.mark.parametrize("adopt", [True, False])
def test_a_fetched_dataclass_is_recorded_on_the_compute_stream(adopt):
    """Every tensor of a prefetch's Fetched (kv, pos, hidden, slots, room) made on the I/O stream
    is recorded on the compute stream when the compute thread takes it (old code: dicts and
    tuples only, so the caching allocator could hand pos/hidden/slots/room to the next prefetch)."""
    with StreamDouble() as cuda:
        io = IOPool(Devices(torch.device("cpu"), stream_api=cuda), threads=1, overlap=True)
        try:
            def make():
                room = torch.zeros(2, B, HKV, 6, HD)
                return Fetched(room[:, :, :, :5], torch.arange(5) * 1, Selection([0]), hidden=torch.ones(B, 3, 4) * 2,
                               slots=torch.arange(3) + 1, room=room)
            f = io.submit(make).result()
            f = io.adopt(f) if adopt else f  # not adopted: as the old adopt left a dataclass
            [x.sum() for x in (f.kv, f.pos, f.hidden, f.slots, f.room)]  # used on the compute stream
        finally:
            io.close()
    unrecorded = [p for p in cuda.problems if p.startswith("unrecorded")]
    assert (unrecorded == []) == adopt, cuda.problems


PROMPTS = [list(range(3, 43)), list(range(50, 79))]  # the second is left-padded


def _run_under_double(model_dir, tmp_path, policy: str, codec: dict):
    names = list(safe_open(str(model_dir / "model.safetensors"), "pt").keys())
    src = Preloaded(resolve_source(str(model_dir), ""), names)  # safetensors cannot read under the double
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=8, offload_dir=str(tmp_path / "offload"),
                       kv_policy=policy, policy_args={"keep_ratio": 0.3, "min_keep_tokens": 0}, **codec)
    with StreamDouble() as cuda:
        with Engine(src, Policy(gpu_batch_size=2, num_gpu_batches=2, cache_gpu_percent=0), cfg,
                    stream_api=cuda) as eng:
            tokens = eng.generate(PROMPTS * 2, 4).tokens
    return cuda, tokens


@pytest.mark.parametrize("policy, codec", [("sparpr", dict(cold_codec="dkv", codec_args={"rank": 1, "residuals": 3})),
                                           ("quest", {})])
def test_an_offloaded_decode_has_no_race_and_no_sync_per_layer(policy, codec, tiny_llama_dir, tmp_path):
    """The whole overlapped schedule (two GPU batches, KV on disk, DKV's exact rows held on
    compute) under the double: no race, nothing used unrecorded, the same tokens as without it;
    and no host sync in the model or the policies' budget maths (old code: torch.equal per layer in
    llama.py, .tolist() per layer in base.py, sparpr.py and block_table.py). The selection's one
    sync per layer (which blocks to read is a host decision) is the most left in kv/."""
    cuda, tokens = _run_under_double(tiny_llama_dir, tmp_path, policy, codec)
    assert cuda.problems == []
    src = resolve_source(str(tiny_llama_dir), "")
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=8, offload_dir=str(tmp_path / "offload"),
                       kv_policy=policy, policy_args={"keep_ratio": 0.3, "min_keep_tokens": 0}, **codec)
    with Engine(src, Policy(gpu_batch_size=2, num_gpu_batches=2, cache_gpu_percent=0), cfg) as eng:
        assert eng.generate(PROMPTS * 2, 4).tokens == tokens
    decode = {site: n for site, n in cuda.syncs.items() if "models/layers.py" not in site}  # prefill's mask
    assert not [s for s in decode if "models/llama.py" in s or "block_table.py" in s or "sparpr.py" in s]
    kv = {s: n for s, n in decode.items() if "kv/" in s}
    layers_x_steps = 2 * 2 * 3  # 2 layers x 2 GPU batches x 3 decode steps after the first token
    assert sum(kv.values()) <= layers_x_steps + 4, kv  # at most one per layer call + prefill's pads per layer


def test_dkv_exact_rows_made_in_store_jobs_are_recorded(tiny_llama_dir, tmp_path, monkeypatch):
    """The exact rows a DKV store job makes on the I/O stream are read by the compute stream:
    without their hand-off the double reports it (the fix undone here)."""
    real = Streams.hand_off

    def no_rows(self, obj):  # the hand-off of everything but a store job's exact rows
        return obj if isinstance(obj, tuple) and len(obj) == 2 and obj[0].dtype == torch.long else real(self, obj)
    monkeypatch.setattr(Streams, "hand_off", no_rows)
    cuda, _ = _run_under_double(tiny_llama_dir, tmp_path, "sparpr",
                                dict(cold_codec="dkv", codec_args={"rank": 1, "residuals": 3}))
    assert any(p.startswith("unrecorded") and "kv/dkv" in p for p in cuda.problems), cuda.problems
