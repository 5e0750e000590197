"""What every results file's "resolved" entry must name (api/resolved.py, issue 34's list)."""
from __future__ import annotations

KEYS = {"device", "compute_dtype", "kv_dtype", "block_size", "weight_format", "placement", "schedule", "kv_policy"}


def check_resolved(conf: dict, **want) -> dict:
    """conf holds every key of KEYS, its KV policy names itself, and each `want` item is equal."""
    assert KEYS <= set(conf), sorted(KEYS - set(conf))
    assert conf["kv_policy"]["name"] and conf["block_size"] >= 1
    for key, value in want.items():
        got = conf["kv_policy"]["name"] if key == "policy" else conf[key]
        assert got == value, (key, got, value)
    return conf
