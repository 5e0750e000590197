"""An embedding table on the disk tier is looked up where it lies (engine/table_rows.py): a decode
step reads the rows it embeds, not the table; the tokens and logits are those of the weights held in
memory, for Llama's token table and OPT's token and position tables."""
from __future__ import annotations

import torch

from flexgen_sparpr.engine import weights as W
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.table_rows import TableRows
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 20)), list(range(40, 52))]  # the second is left-padded
GEN = 6


def _run(model_dir, out, **placement):
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=8, offload_dir=str(out), weight_format="raw")
    with Engine(resolve_source(str(model_dir), ""), Policy(gpu_batch_size=2, **placement), cfg) as eng:
        r = eng.generate(PROMPTS, GEN, keep_logits=True)
        tables = {short: eng.weights.stored[full].nbytes for short, full in eng.weights.layers[0].items()
                  if short in W.LOOKUP_TABLES}
        return r.tokens, torch.stack(r.logits), eng.devices.counters.snapshot().get("disk->cpu", 0), tables


def test_disk_tables_are_read_by_row_with_the_same_logits(tiny_model_dir, tmp_path, monkeypatch):
    tokens, logits, _, _ = _run(tiny_model_dir, tmp_path / "a")
    on_disk = dict(w_gpu_percent=0, w_cpu_percent=0)
    got_tokens, got_logits, by_row, tables = _run(tiny_model_dir, tmp_path / "b", **on_disk)
    assert got_tokens == tokens and torch.equal(got_logits, logits)
    monkeypatch.setattr(W.WeightStore, "_table_rows", W.WeightStore.fetch)  # the table read whole every step
    _, _, whole, _ = _run(tiny_model_dir, tmp_path / "c", **on_disk)
    # each decode step after the first skips reading the tables whole (the prefill reads them whole either way)
    assert whole - by_row > (GEN - 2) * sum(tables.values())


def test_rows_come_back_in_the_index_shape_and_many_read_the_table(tmp_path):
    from flexgen_sparpr.storage.disk_store import DiskStore
    from flexgen_sparpr.storage.tiers import Devices, Tier

    table = torch.randn(300, 24)  # 96-byte rows: a page holds parts of several
    devices = Devices("cpu")
    with DiskStore(tmp_path, direct=True) as store:
        f = store.new_file("tok", 1, table.nbytes)
        f.write(0, table)
        rows = TableRows(W.StoredWeight(Tier.DISK, tuple(table.shape), 0, table.nbytes, None, f), torch.float32,
                         devices)
        ids = torch.tensor([[5, 299, 5], [0, 42, 170]])
        assert torch.equal(rows[ids], table[ids])
        before = f.bytes_read
        many = torch.arange(0, 300, 3)  # a third of the rows: the table read whole, once
        assert torch.equal(rows[many], table[many]) and f.bytes_read - before == table.nbytes
