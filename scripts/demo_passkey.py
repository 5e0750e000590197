"""`make run`: hide a passkey in ~4k tokens of Alice in Wonderland and ask SmolLM2 for it.

Half of the KV cache lives on the disk tier (page cache bypassed), so the run shows the engine
offloading; the answer, latency, peak memory and bytes moved are printed.
"""
from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, passkey_hit, random_key
from flexgen_sparpr.cli.main import guarded
from flexgen_sparpr.cli.prompts import load_tokenizer
from flexgen_sparpr.cli.run import run
from flexgen_sparpr.utils.args import OneLineParser
from flexgen_sparpr.weights.resolve import resolve_source

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default 4096)")
    ap.add_argument("--depth", type=float, default=0.5, help="where the passkey sits, 0..1 (default 0.5)")
    ap.add_argument("--seed", type=int, default=0, help="picks the key and the excerpt")
    ap.add_argument("--percent", nargs=6, default=["100", "0", "50", "0", "100", "0"],
                    help="placement, as FlexGen's --percent (default: half the KV cache on disk)")
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-demo"))
    args = ap.parse_args()
    if not 0 <= args.depth <= 1 or args.tokens < 128:
        print("error: --depth must be in [0, 1] and --tokens >= 128", file=sys.stderr)
        return 2
    src = resolve_source("smollm2-135m", "")
    prompts = NeedlePrompts(load_tokenizer(src.tokenizer_dir), ROOT / "tests" / "data" / "alice29.txt")
    rng = random.Random(args.seed)
    key = random_key(rng, 5)
    needle = prompts.build(args.tokens, args.depth, key, rng)
    with tempfile.TemporaryDirectory() as tmp:
        ids_file, out_file = Path(tmp) / "ids.json", Path(tmp) / "out.json"
        ids_file.write_text(json.dumps([needle.ids]))
        argv = ["--model", "smollm2-135m", "--prompt-ids-file", str(ids_file), "--gpu-batch-size", "1",
                "--gen-len", "16", "--stop", "eos", "--percent", *args.percent, "--direct-io",
                "--offload-dir", args.offload_dir, "--no-log", "--verbose", "1", "--output-json", str(out_file)]
        print(f"prompt: {len(needle.ids)} tokens of Alice in Wonderland, passkey {key} hidden at "
              f"token {needle.needle_at}; KV placement --percent {' '.join(args.percent)}\n", flush=True)
        rc = guarded(run, argv)
        if rc:
            return rc
        out = json.loads(out_file.read_text())
    answer = out["texts"][0].strip()
    t, mem = out["timings"], out["peak_memory"]
    moved = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(out["bytes_moved"].items())) or "none"
    print(f"\nanswer: {answer!r} -> passkey {'FOUND' if passkey_hit(answer, key) else 'MISSED'} (expected {key})")
    print(f"latency: prefill {t['prefill_s']:.2f} s, decode {t['decode_s']:.2f} s "
          f"({t['decode_tokens_per_s']:.1f} tok/s), total {t['total_s']:.2f} s on {out['device']}")
    print(f"memory: peak host RSS {mem['host_rss_peak_bytes'] / 2**30:.2f} GiB, "
          f"peak GPU {mem['gpu_peak_bytes'] / 2**30:.2f} GiB; moved: {moved} "
          f"(disk I/O: {', '.join(out['disk_io_mode'] or ['none'])})")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.cli.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (cli/guard.py)
