"""SparPR's cost model (runtime/costs.py) and the start-up probe's cache (runtime/probe.py)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgen_sparpr.runtime import probe as probe_mod
from flexgen_sparpr.runtime.costs import (CostModel, cost_ratio, keep_target, kv_rebuild_flops, merge_spans,
                                          plan_recovery, serial, should_fall_back)
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.utils import host as host_mod
from flexgen_sparpr.utils.host import disk_key

CPU = Devices(torch.device("cpu"))
ratios = st.one_of(st.floats(0, 1e6, allow_nan=False), st.just(math.inf), st.just(math.nan))
fractions = st.floats(1e-4, 1.0)


@settings(max_examples=300, deadline=None)
@given(ratio=ratios, ceiling=fractions, floor=fractions)
def test_keep_target_stays_between_floor_and_ceiling(ratio, ceiling, floor):
    r = keep_target(ratio, ceiling, floor)
    assert min(floor, ceiling) <= r <= ceiling
    if not ratio > 1:  # copying no dearer than rebuilding (or unknown): the ceiling
        assert r == ceiling


@settings(max_examples=200, deadline=None)
@given(a=st.floats(1, 1e3), b=st.floats(1, 1e3), ceiling=st.floats(0.01, 0.99))
def test_keep_target_falls_as_copying_gets_dearer(a, b, ceiling):
    lo, hi = sorted((a, b))
    assert keep_target(hi, ceiling, 1e-9) <= keep_target(lo, ceiling, 1e-9)
    assert keep_target(hi, 1.0, 0.1) == 1.0  # keep_ratio 1 reads what dense reads


@settings(max_examples=300, deadline=None)
@given(copy=st.floats(0, 1e3), rec=st.floats(0, 1e3))
def test_cost_ratio(copy, rec):
    r = cost_ratio(copy, rec)
    assert r >= 0
    if copy > 0 and rec > 0:
        assert r == pytest.approx(copy / rec)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 40))
def test_merge_spans_is_exact(data, n):
    homes = data.draw(st.lists(st.sampled_from(list(Tier)), min_size=n, max_size=n))
    blocks = sorted(data.draw(st.sets(st.integers(0, n - 1))))
    spans = merge_spans(blocks, homes)
    assert [b for s in spans for b in s] == blocks  # every block once, in order
    for s in spans:  # consecutive ids, one home
        assert s == list(range(s[0], s[-1] + 1)) and len({homes[b] for b in s}) == 1
    for x, y in zip(spans, spans[1:]):  # maximal: a gap or a change of home between spans
        assert y[0] > x[-1] + 1 or homes[y[0]] != homes[x[-1]]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 20), overhead=st.floats(0, 10))
def test_plan_recovery_takes_the_cheaper_way_per_span(data, n, overhead):
    copy = data.draw(st.lists(st.floats(0, 100), min_size=n, max_size=n))
    rec = data.draw(st.lists(st.one_of(st.floats(0, 100), st.just(math.inf)), min_size=n, max_size=n))
    spans = merge_spans(list(range(n)), data.draw(st.lists(st.sampled_from([Tier.CPU, Tier.DISK]), min_size=n,
                                                               max_size=n)))
    rebuild, total = plan_recovery(spans, copy, rec, overhead)
    want = 0.0
    for s in spans:
        c, r = sum(copy[b] for b in s), sum(rec[b] for b in s) + overhead
        assert (s[0] in rebuild) == (r < c) and all((b in rebuild) == (s[0] in rebuild) for b in s)
        want += min(c, r)
    assert total == pytest.approx(want)


@settings(max_examples=300, deadline=None)
@given(sparse=st.floats(0, 1e3), dense=st.floats(0, 1e3), gamma=st.floats(0.01, 1))
def test_fallback_exactly_when_sparse_exceeds_gamma_dense(sparse, dense, gamma):
    assert should_fall_back(sparse, dense, gamma) == (sparse > gamma * dense)


def test_block_costs_follow_the_formulas():
    cm = CostModel(disk_read_Bps=2e9, h2d_Bps=8e9, matmul_flops={"float16": 1e12}, live=False)
    cuda = Devices(torch.device("cpu"))
    assert cm.copy_s(1 << 20, Tier.DISK, cuda) == (1 << 20) / 2e9  # CPU compute: no host->device hop
    assert cm.copy_s(1 << 20, Tier.COMPUTE, cuda) == 0
    assert serial(2e9, 8e9) == pytest.approx(1 / (1 / 2e9 + 1 / 8e9))
    flops = kv_rebuild_flops(batch=4, block_len=64, hidden=4096, kv_dim=4096)
    assert flops == 4 * 64 * 4096 * 2 * 4096 * 2
    assert cm.recompute_s(1 << 19, flops, Tier.DISK, cuda, torch.float16) == pytest.approx(
        (1 << 19) / 2e9 + flops / 1e12)
    with pytest.raises(ValueError, match="bfloat16"):
        cm.flop_s(1, torch.bfloat16)
    with pytest.raises(ValueError):
        CostModel(disk_read_Bps=0)


def test_live_bandwidth_comes_from_the_engines_own_reads():
    dev = Devices(torch.device("cpu"))
    cm = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9})
    assert cm.bandwidth(Tier.DISK, dev) == 1e9  # nothing timed yet: the probe's number
    dev.counters.add("disk", "cpu", 1000, 1e-3)
    assert cm.bandwidth(Tier.DISK, dev) == pytest.approx(1e6)
    cm.live = False
    assert cm.bandwidth(Tier.DISK, dev) == 1e9


def test_the_least_copy_takes_the_faster_of_the_live_and_probed_disk_bandwidth():
    """A selection's small scattered reads time the live link below what a dense step's long runs
    reach: the floor of a dense step (SparPR's measured step fallback) must not rise with them."""
    dev = Devices(torch.device("cpu"))
    cm = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9})
    dev.counters.add("disk", "cpu", 1000, 1e-5)  # live 1e8: slow small reads
    assert cm.copy_s(1e6, Tier.DISK, dev) == pytest.approx(1e-2)
    assert cm.least_copy_s(1e6, Tier.DISK, dev) == pytest.approx(1e-3)  # the probe's 1e9
    dev.counters.add("disk", "cpu", 10 ** 9, 0.25)  # live now ~4e9: faster than the probe
    assert cm.least_copy_s(1e6, Tier.DISK, dev) == pytest.approx(cm.copy_s(1e6, Tier.DISK, dev))
    assert cm.least_copy_s(1e6, Tier.COMPUTE, dev) == 0


def test_probe_cache_round_trips(tmp_path, monkeypatch):
    cache, disk = tmp_path / "cache", tmp_path / "offload"
    first = probe_mod.probe(torch.device("cpu"), [torch.float32], disk, cache_dir=cache)
    path = probe_mod.cache_path(torch.device("cpu"), cache)
    assert path.is_file() and json.loads(path.read_text()) == first
    assert first["matmul_flops"]["float32"] > 0 and first["h2d_Bps"] is None
    key = disk_key(disk)
    assert first["disk"][key]["read_Bps"] > 0
    cm = CostModel.from_probe(first, disk)
    assert cm.disk_read_Bps == first["disk"][key]["read_Bps"]

    def no_measuring(*a, **k):
        raise AssertionError("measured again although cached")
    monkeypatch.setattr(probe_mod, "disk_bandwidth", no_measuring)
    monkeypatch.setattr(probe_mod, "measure_matmul", no_measuring)
    assert probe_mod.probe(torch.device("cpu"), [torch.float32], disk, cache_dir=cache) == first

    monkeypatch.setattr(probe_mod, "measure_matmul", lambda device, dtype: (5e9, 1e-5))
    more = probe_mod.probe(torch.device("cpu"), [torch.bfloat16], disk, cache_dir=cache)  # extends the cache
    assert more["matmul_flops"] == {"float32": first["matmul_flops"]["float32"], "bfloat16": 5e9}
    assert probe_mod.load(path) == more

    path.write_text("{not json")  # a broken cache is measured again, not trusted
    monkeypatch.setattr(probe_mod, "disk_bandwidth", lambda d, **k: {"read_GBps": 1.0, "write_GBps": 1.0,
                                                                      "mode": "o_direct"})
    again = probe_mod.probe(torch.device("cpu"), [torch.float32], disk, cache_dir=cache)
    assert again["disk"][key]["read_Bps"] == 1e9 and probe_mod.load(path) == again


def test_weight_format_timings_are_cached_beside_the_probe_and_refreshed_on_demand(tmp_path, monkeypatch):
    """--weight-format auto's timings (runtime/probe.py weight_formats): measured once per machine and
    row count, kept in the probe's file beside its other figures, measured again on refresh."""
    cache, disk = tmp_path / "cache", tmp_path / "offload"
    first = probe_mod.probe(torch.device("cpu"), [torch.float32], disk, cache_dir=cache)
    calls = []

    def fake(rows, formats=("raw", "bfloat16", "int8", "int4")):
        calls.append(rows)
        return {"raw": 2e-3, "int4": 5e-4 * len(calls)}
    monkeypatch.setattr(probe_mod, "measure_weight_formats", fake)
    assert probe_mod.weight_formats(1, cache_dir=cache) == {"raw": 2e-3, "int4": 5e-4}
    assert probe_mod.weight_formats(1, cache_dir=cache) == {"raw": 2e-3, "int4": 5e-4} and calls == [1]
    assert probe_mod.weight_formats(6, cache_dir=cache)["int4"] == 1e-3 and calls == [1, 6]  # a batch: its own
    assert probe_mod.weight_formats(1, refresh=True, cache_dir=cache)["int4"] == 1.5e-3
    kept = probe_mod.load(probe_mod.cache_path(torch.device("cpu"), cache))
    assert kept["disk"] == first["disk"] and set(kept["weight_format_s"]) == {"1", "6"}


def test_weight_format_timings_measured_with_other_kernels_are_measured_anew(tmp_path, monkeypatch):
    """A table measured while the compiled kernels were not built (an older engine, another CPU build,
    a failed compile) would keep choosing a format for kernels that are not the ones run now."""
    cache = tmp_path / "cache"
    calls = []

    def fake(rows, formats=("raw", "bfloat16", "int8", "int4")):
        calls.append(rows)
        return {"raw": 2e-3, "int4": 5e-4 * len(calls)}
    monkeypatch.setattr(probe_mod, "measure_weight_formats", fake)
    monkeypatch.setattr(probe_mod, "_kernels", lambda: "none (not built)")
    assert probe_mod.weight_formats(1, cache_dir=cache)["int4"] == 5e-4
    assert probe_mod.weight_formats(1, cache_dir=cache)["int4"] == 5e-4 and calls == [1]
    monkeypatch.setattr(probe_mod, "_kernels", lambda: "flexgen_sparpr_decode_0123")
    assert probe_mod.weight_formats(1, cache_dir=cache)["int4"] == 1e-3 and calls == [1, 1]
    kept = probe_mod.load(probe_mod.cache_path(torch.device("cpu"), cache))
    assert kept["weight_format_kernels"] == "flexgen_sparpr_decode_0123"


def test_weight_format_probe_keeps_each_formats_best_round(monkeypatch):
    """A burst of other work during one round (int4's first here) must not decide the format: the
    rounds interleave the formats, and each keeps its fastest."""
    monkeypatch.setattr(probe_mod, "WEIGHT_PROBE_ROUNDS", 3)
    slow = iter([1.0, 0.2, 0.05, 0.2, 0.05, 0.2])  # round by round: int4, raw; int4's first round slow

    def timed(fn, device):
        return next(slow) * len(probe_mod.WEIGHT_PROBE_SHAPES) * probe_mod.WEIGHT_PROBE_LAYERS
    monkeypatch.setattr(probe_mod, "_timed", timed)
    t = probe_mod.measure_weight_formats(1, formats=("int4", "raw"))
    assert t == pytest.approx({"int4": 0.05, "raw": 0.2})


def test_measured_weight_formats_time_every_kernel_this_torch_has():
    t = probe_mod.measure_weight_formats(1)
    assert set(t) <= {"raw", "bfloat16", "int8", "int4"} and {"raw", "bfloat16"} <= set(t)
    assert all(0 < s < 1 for s in t.values())


def test_probe_measures_a_disk_once_whatever_the_folder(tmp_path, monkeypatch):
    """Folders on one file system share one disk: the probe keys its bandwidth by the file system,
    so a new offload folder there is not measured again (the cache held one entry per folder and
    grew with every temporary folder), an older file's per-folder entries are dropped, and a figure
    taken under the kernel's read caps (bench/throttle.py) is kept apart from the disk's own."""
    cache = tmp_path / "cache"
    calls = []

    def fake(folder, **k):
        calls.append(folder)
        return {"read_GBps": 2.0 if len(calls) == 1 else 0.05, "write_GBps": 1.0, "mode": "o_direct"}
    monkeypatch.setattr(probe_mod, "disk_bandwidth", fake)
    monkeypatch.setattr(probe_mod, "measure_matmul", lambda device, dtype: (5e9, 1e-5))
    path = probe_mod.cache_path(torch.device("cpu"), cache)
    probe_mod.save(path, {**probe_mod._empty(torch.device("cpu")), "disk": {"/old/folder": {"read_Bps": 1.0}}})
    a = probe_mod.probe(torch.device("cpu"), [torch.float32], tmp_path / "a", cache_dir=cache)
    b = probe_mod.probe(torch.device("cpu"), [torch.float32], tmp_path / "b" / "not-made-yet", cache_dir=cache)
    assert len(calls) == 1 and a == b and list(b["disk"]) == [disk_key(tmp_path)]
    assert probe_mod.disk_entry(b, tmp_path / "b")["read_Bps"] == 2e9
    assert CostModel.from_probe(b, tmp_path / "c").disk_read_Bps == 2e9

    monkeypatch.setattr(host_mod, "blkio_read_limits", lambda: "8:0 50000000")  # a throttled run
    capped = probe_mod.probe(torch.device("cpu"), [torch.float32], tmp_path / "a", cache_dir=cache)
    assert len(calls) == 2 and len(capped["disk"]) == 2
    assert probe_mod.disk_entry(capped, tmp_path / "a")["read_Bps"] == 5e7
    monkeypatch.setattr(host_mod, "blkio_read_limits", lambda: "")
    assert probe_mod.disk_entry(probe_mod.load(path), tmp_path / "a")["read_Bps"] == 2e9  # the disk's own


def test_blkio_read_limits_reads_this_process_group(tmp_path):
    """The caps of the process's own blkio group ('' in the root group or without cgroup v1)."""
    root = tmp_path / "blkio"
    (root / "g").mkdir(parents=True)
    (root / "g" / "blkio.throttle.read_bps_device").write_text("8:0 50000000\n259:0 1000\n")
    cg = tmp_path / "cgroup"
    cg.write_text("9:name=systemd:/\n7:blkio:/g\n0::/\n")
    assert host_mod.blkio_read_limits(str(cg), str(root)) == "8:0 50000000; 259:0 1000"
    cg.write_text("7:blkio:/\n")
    assert host_mod.blkio_read_limits(str(cg), str(root)) == ""
    cg.write_text("0::/user.slice\n")  # cgroup v2 only
    assert host_mod.blkio_read_limits(str(cg), str(root)) == ""
    assert host_mod.blkio_read_limits(str(tmp_path / "missing"), str(root)) == ""
