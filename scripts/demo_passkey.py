"""`make run`: four passkeys, each hidden in 8000 tokens of Alice in Wonderland, asked of SmolLM2
as one batch, decoded with dense attention and with SparPR side by side from one prefill
(`LLM.compare`).

The setting is the one an offloading engine is for: the KV cache does not fit where the compute
is, so it lives on the disk tier (page cache bypassed) and every decode step must bring it back.
Dense attention reads all of it every step; SparPR scores every block from summaries kept on the
compute device and reads only the blocks it picks that it does not already hold (each layer keeps
the blocks it read on the compute device: engine/recall.py). Both decode the same fixed number of
steps; for each: the median step and what it was spent on, decode tokens/s, bytes read from disk
per step, and the answers.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # not its warning about the book's length: we cut it

from flexgen_sparpr import LLM  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, passkey_hit, random_key  # noqa: E402
from flexgen_sparpr.utils.guard import guarded  # noqa: E402
from flexgen_sparpr.utils.args import OneLineParser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB = 2 ** 20
PARTS = ("select", "read", "rebuild", "io_wait", "compute")


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8000,
                    help="prompt length in tokens (default 8000: SmolLM2 holds 8192 positions)")
    ap.add_argument("--batch", type=int, default=4, help="prompts decoded together (default 4)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps each policy runs (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="picks the keys and the excerpts")
    ap.add_argument("--keep", type=float, default=0.1,
                    help="SparPR's keep ratio, its budget's ceiling (default 0.1, the paper's tight setting)")
    ap.add_argument("--min-keep-tokens", type=int, default=None,
                    help="the least cached tokens SparPR's step reads (default: the engine's, 768; 0: the keep alone)")
    ap.add_argument("--percent", nargs=6, type=int, default=[100, 0, 0, 0, 100, 0],
                    help="placement, as FlexGen's --percent (default: the whole KV cache on disk)")
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-demo"))
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args()
    if args.tokens < 128 or not 1 <= args.batch <= 16 or args.steps < 3 or (args.min_keep_tokens or 0) < 0:
        print("error: --tokens must be >= 128, --batch in 1..16, --steps >= 3 and --min-keep-tokens >= 0",
              file=sys.stderr)
        return 2
    with LLM("smollm2-135m", gpu_batch_size=args.batch, percent=args.percent, direct_io=True,
             offload_dir=args.offload_dir, quiet=args.quiet) as llm:
        rng = random.Random(args.seed)
        book = NeedlePrompts(llm.tokenizer, ROOT / "tests" / "data" / "alice29.txt")
        depths = [(i + 1) / (args.batch + 1) for i in range(args.batch)]
        needles = [book.build(args.tokens, d, random_key(rng, 5), rng) for d in depths]
        print(f"prompts: {args.batch} x {args.tokens} tokens of Alice in Wonderland, a passkey hidden in each "
              f"(depths {' '.join(f'{d:.2f}' for d in depths)}); KV placement --percent "
              f"{' '.join(map(str, args.percent))} (disk: O_DIRECT)", flush=True)
        label = f"sparpr@{args.keep:g}"
        knobs = {"kv_policy": "sparpr", "keep_ratio": args.keep}
        if args.min_keep_tokens is not None:
            knobs["min_keep_tokens"] = args.min_keep_tokens
        runs = llm.compare([n.ids for n in needles], {label: knobs},
                           max_new_tokens=args.steps + 1, stop=None)
        eos = llm.spec.eos_id
        tok = llm.tokenizer
    print(f"prefill (one, shared): {runs['dense'][1].prefill_s:.1f} s on {runs['dense'][1].device}\n")
    print(f"{'':11} {'step':>8} {'tok/s':>7} {'disk MiB':>9}   " + " ".join(f"{p:>8}" for p in PARTS)
          + "   answers")
    med = {}
    for label, (outs, s) in runs.items():
        steps = s.step_times[0][1:]  # the decode steps (the prefill gives the first token)
        med[label] = statistics.median(steps)
        disk = s.bytes_moved.get("disk->cpu", 0) / len(steps) / MiB
        parts = s.decode_step_parts
        found = sum(passkey_hit(tok.decode(o.token_ids[:o.token_ids.index(eos)] if eos in o.token_ids else
                                           o.token_ids, skip_special_tokens=True), n.key) for o, n in zip(outs, needles))
        print(f"{label:11} {med[label]:7.3f}s {args.batch / med[label]:7.1f} {disk:9.1f}   "
              + " ".join(f"{parts[p]:7.3f}s" for p in PARTS) + f"   {found}/{len(outs)} found")
    sp = [k for k in runs if k != "dense"][0]
    stats = runs[sp][1].kv_policy_stats["totals"]
    dense_disk = runs["dense"][1].bytes_moved.get("disk->cpu", 0)
    ratio = runs[sp][1].bytes_moved.get("disk->cpu", 0) / dense_disk if dense_disk else float("nan")
    print(f"\n{sp} decodes at {med['dense'] / med[sp]:.2f}x dense's speed (median step), reading "
          f"{ratio:.2f}x its disk bytes: it attended {stats['effective_keep']:.0%} of the context per step (its "
          f"budget set between --min-keep and --keep-ratio by the copy and rebuild costs it measured here) and "
          f"read only the blocks its layers did not already hold")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
