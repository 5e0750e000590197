"""The GPU check's cut-down SmolLM2 (scripts/device_wheelhouse.py): the first N decoder layers'
tensors byte for byte, the embedding, norm and tokenizer whole, and `prepare --gguf` turns it
into a model dir the engine and HF load."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

pytestmark = pytest.mark.slow


def test_cut_gguf_keeps_the_first_layers_byte_for_byte(smollm2_dir, tmp_path):
    gguf = pytest.importorskip("gguf", reason="reading GGUF needs the gguf package")
    from device_wheelhouse import cut_gguf
    from flexgen_sparpr.weights.prepare import GGUF_NAME, prepare_smollm2

    full = smollm2_dir / GGUF_NAME
    cut = tmp_path / "cut.gguf"
    cut_gguf(full, cut, layers=2)
    a, b = gguf.GGUFReader(full), gguf.GGUFReader(cut)
    assert b.fields["llama.block_count"].contents() == 2
    kept = {t.name: t for t in b.tensors}
    assert all(not n.startswith("blk.") or n.split(".")[1] in ("0", "1") for n in kept)
    for t in a.tensors:
        if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", "1"):
            assert kept[t.name].tensor_type == t.tensor_type and np.array_equal(kept[t.name].data, t.data), t.name
    for key in ("tokenizer.ggml.tokens", "llama.embedding_length"):
        assert b.fields[key].contents() == a.fields[key].contents()
    model = prepare_smollm2(tmp_path / "cache", gguf=cut)
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 2
    assert "cut.gguf" in (model / "SOURCE.md").read_text()
