"""`make run`: hide a passkey in ~4k tokens of Alice in Wonderland and ask SmolLM2 for it, with
dense attention and with SparPR side by side from one prefill (`LLM.compare`).

Half of the KV cache lives on the disk tier (page cache bypassed), so every decode step reads the
cold blocks from disk: dense reads all of them, SparPR only the blocks it selects (at most
--keep of the context, fewer where its measured costs say so). For both: the answer, decode
tokens/s and the bytes read from disk per decoded token.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # not its warning about the book's length: we cut it

from flexgen_sparpr import LLM  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, passkey_hit, random_key  # noqa: E402
from flexgen_sparpr.cli.guard import guarded  # noqa: E402
from flexgen_sparpr.utils.args import OneLineParser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB = 2 ** 20


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default 4096)")
    ap.add_argument("--depth", type=float, default=0.5, help="where the passkey sits, 0..1 (default 0.5)")
    ap.add_argument("--seed", type=int, default=0, help="picks the key and the excerpt")
    ap.add_argument("--keep", type=float, default=0.25, help="SparPR's keep ratio, its ceiling (default 0.25)")
    ap.add_argument("--percent", nargs=6, type=int, default=[100, 0, 50, 0, 100, 0],
                    help="placement, as FlexGen's --percent (default: half the KV cache on disk)")
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-demo"))
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args()
    if not 0 <= args.depth <= 1 or args.tokens < 128:
        print("error: --depth must be in [0, 1] and --tokens >= 128", file=sys.stderr)
        return 2
    with LLM("smollm2-135m", gpu_batch_size=1, percent=args.percent, direct_io=True, offload_dir=args.offload_dir,
             quiet=args.quiet) as llm:
        rng = random.Random(args.seed)
        key = random_key(rng, 5)
        needle = NeedlePrompts(llm.tokenizer, ROOT / "tests" / "data" / "alice29.txt").build(args.tokens, args.depth,
                                                                                           key, rng)
        print(f"prompt: {len(needle.ids)} tokens of Alice in Wonderland, passkey {key} hidden at token "
              f"{needle.needle_at}; KV placement --percent {' '.join(map(str, args.percent))} (disk: O_DIRECT)",
              flush=True)
        sparpr = f"sparpr@{args.keep:g}"
        runs = llm.compare([needle.ids], {sparpr: {"kv_policy": "sparpr", "keep_ratio": args.keep}},
                           max_new_tokens=16, stop="eos")
    stats = {label: s for label, (_, s) in runs.items()}
    print(f"prefill (one, shared): {stats['dense'].prefill_s:.1f} s on {stats['dense'].device}\n")
    print(f"{'':12} {'decode tok/s':>12} {'read from disk / token':>23}  answer")
    dense_read = None
    for label, (outs, s) in runs.items():
        steps = max(1, len(s.step_times[0]) - 1)  # decoded tokens (the prefill gives the first)
        read = s.bytes_moved.get("disk->cpu", 0) / steps
        dense_read = dense_read or read
        ratio = f" ({read / dense_read:.2f}x)" if label != "dense" and dense_read else ""
        answer = outs[0].text.strip()
        found = "FOUND" if passkey_hit(answer, key) else "MISSED"
        print(f"{label:12} {steps / max(s.decode_s, 1e-9):12.1f} {read / MiB:15.1f} MiB{ratio:8} "
              f"{answer!r} -> {found}")
    keep = (stats[sparpr].kv_policy_stats or {}).get("totals", {}).get("effective_keep")
    if keep is not None:
        print(f"\n{sparpr} attended {keep:.0%} of the context per step: its budget lies between --min-keep 0.1 and "
              f"--keep {args.keep:g}, set by the copy and recompute costs it measured on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))  # one error line for any failure, signals included (cli/guard.py)
