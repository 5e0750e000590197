"""README's "From Python" section runs as written: its Python blocks (generate, stream) in one
process, its shell block (a batch job) with the console script, both in a scratch folder."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_OFFLOAD = "/tmp/flexgen-offload"


def section_blocks(title: str) -> dict[str, list[str]]:
    """The fenced code blocks of a README section, by language."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S):
        blocks.setdefault(lang, []).append(code)
    return blocks


def test_the_python_section_runs(smollm2_dir, tmp_path):
    blocks = section_blocks("From Python")
    assert len(blocks["python"]) == 1 and len(blocks["sh"]) == 1
    # the one change: the README's offload folder becomes this test's (other runs share /tmp)
    off = tmp_path / "off"
    code = blocks["python"][0].replace(f'"{README_OFFLOAD}"', repr(str(off)))
    assert code != blocks["python"][0], f"the README's Python block no longer names {README_OFFLOAD}"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["0", "1", "2"]  # input order
    assert re.match(r"\d+ tokens in [\d.]+ s, 2 batches, moved \{.*'cpu->disk': \d+", lines[3]), lines[3]
    assert len(lines[4]) > 20  # the streamed story
    assert not off.exists() or not any(off.iterdir())  # the with block removed its offload files

    r = subprocess.run(["bash", "-ec", blocks["sh"][0].rstrip() + f" --offload-dir {off}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in rows) == ["a", "b"]
    assert all(x["token_ids"] and isinstance(x["text"], str) and x["finish_reason"] in ("stop", "length") for x in rows)
    assert not off.exists() or not any(off.iterdir())
