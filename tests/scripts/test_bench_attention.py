"""scripts/bench_attention.py at tiny sizes: both kernels timed, the files written with their config."""
import json

from tests.models.test_cpu_kernel import BUILDABLE
from tests.scripts.runner import run_script


def test_tiny_run_writes_both_kernels(tmp_path):
    r = run_script("bench_attention.py", "--lengths", "64", "--batches", "1,2", "--kv-dtypes", "float32,bfloat16",
                   "--repeats", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["config"]["engine_commit"] and len(data["cells"]) == 4
    for c in data["cells"]:
        assert c["dense_torch_ms"] > 0 and c["sparse_gather_torch_ms"] > 0
        assert ("dense_kernel_ms" in c) == BUILDABLE and ("sparse_rows_kernel_ms" in c) == BUILDABLE
    assert "| tokens | batch |" in (tmp_path / "attention.md").read_text()


def test_bad_flags_end_in_one_line():
    r = run_script("bench_attention.py", "--lengths", "8")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
