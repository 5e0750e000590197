"""This engine beside llama.cpp on the same SmolLM2 GGUF, batch 1 and 4, greedy, the same threads and
prompt ids: prefill and decode tokens/s at 512 / 2k / 4k / 8000 tokens, dense and SparPR
(flexgen_sparpr/bench/llamacpp.py says what each cell measures). llama-cpp-python is an optional
bench extra: build it from source without native CPU flags, e.g.
  CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/pip install --no-binary :all: llama-cpp-python
Writes <out>/llamacpp.json (every cell, the configuration, both versions, the machine) and .md.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names

from flexgen_sparpr.bench.args import OneLineParser, die  # noqa: E402
from flexgen_sparpr.bench.llamacpp import gguf_path, render, run_context  # noqa: E402
from flexgen_sparpr.bench.membound import read_bandwidth  # noqa: E402
from flexgen_sparpr.bench.peers import llamacpp_version  # noqa: E402
from flexgen_sparpr.bench.results import publish  # noqa: E402
from flexgen_sparpr.utils.guard import guarded  # noqa: E402


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8000], help="prompt tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="prompts decoded together (default: 1 4)")
    ap.add_argument("--gen-len", type=int, default=32, help="new tokens per run (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--keep", type=float, default=0.1, help="SparPR's keep ratio (default 0.1)")
    ap.add_argument("--weight-formats", nargs="+", default=["auto", "raw", "bfloat16", "int8"],
                    choices=["auto", "raw", "bfloat16", "int8", "int4"],
                    help="this engine's --weight-format values, one run each (default: auto raw bfloat16 int8; "
                         "auto is the probe's pick, int4 where the kernels are built)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "results" / "llamacpp"))
    args = ap.parse_args()
    if args.gen_len < 2 or args.threads < 1 or not all(1 <= b <= 16 for b in args.batches) or not all(128 <= n <= 8100 for n in args.lengths):
        die("--gen-len must be >= 2, --threads >= 1, --batches in 1..16 and --lengths in 128..8100")
    version = llamacpp_version()
    if version is None:
        die("llama-cpp-python is not installed (an optional bench extra; see this script's --help)")
    if gguf_path() is None:
        die("the prepared SmolLM2 GGUF is missing: run `flexgen-sparpr prepare`")
    import torch
    torch.set_num_threads(args.threads)
    read_Bps = read_bandwidth(args.threads)
    cells = []
    for b, n in ((b, n) for b in args.batches for n in args.lengths):
        cells.append(run_context(n, args.gen_len, args.threads, args.keep, args.seed, tuple(args.weight_formats), b,
                                 read_Bps))
        c = cells[-1]
        print(f"{n} x{b}: llama.cpp " + (f"{c['llamacpp']['decode_tok_s']:.1f} tok/s" if c["llamacpp"]["ok"] else
                                   c["llamacpp"]["error"]) + ", " + ", ".join(
            f"{k} {v['decode_tok_s']:.1f} tok/s" for k, v in c["engine"].items()), flush=True)
    publish(args.out, "llamacpp", {**vars(args), "model": "smollm2-135m", "gguf": gguf_path().name,
                                   "llamacpp_version": version, "engine": "defaults, KV resident",
                                   "read_GBps": read_Bps / 1e9},
            cells, render)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
