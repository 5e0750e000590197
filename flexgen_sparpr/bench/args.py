"""What the benchmark scripts' command lines share: one-line argument errors, list types, the
context check, the OPT offload flags and the fidelity scripts' split flags."""
from __future__ import annotations

import argparse
import sys

from ..config.flags import DEFAULTS
from ..kv.knobs import knobs
from ..kv.policies.sparpr import SparPR
from ..utils.args import OneLineParser  # noqa: F401  (the scripts' parser: one-line errors)
from .texts import SPLITS, texts_of


def die(msg: str, code: int = 2) -> None:
    """Bad input: one clear line on stderr, then exit (2 by default)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def int_list(text: str) -> list[int]:
    """'2048,4096' -> [2048, 4096] (for argparse `type=`; raises ValueError on bad input)."""
    vals = [int(v) for v in text.split(",") if v.strip()]
    if not vals or any(v < 1 for v in vals):
        raise ValueError(text)
    return vals


def tokens_at_least_0(text: str) -> int:
    """argparse type: a token count >= 0 (a refused value: one line, exit 2, as any bad flag)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0 (got {text!r})")
    return n


def float_list(text: str) -> list[float]:
    vals = [float(v) for v in text.split(",") if v.strip()]
    if not vals:
        raise ValueError(text)
    return vals


def check_context(spec, cells: list[tuple[int, int]], flag: str = "--lengths") -> None:
    """cells: (prompt tokens, tokens decoded after it). Refuses up front, in one line, a cell the
    model cannot hold (instead of failing once the cells before it have run)."""
    limit, what = spec.context_limit()
    bad = sorted({(n, new) for n, new in cells if n + new > limit})
    if bad:
        n, new = bad[0]
        die(f"{flag} {n} plus the {new} tokens decoded after it exceed {spec.name}'s {what}: "
            f"the longest prompt that fits is {limit - new}")


def add_opt_bench_args(ap, gen_len: int) -> None:
    """The flags the OPT offload benchmarks share (bench_sparpr, reproduce_latency)."""
    ap.add_argument("--model", default="opt-125m", help="an OPT size name (default: opt-125m)")
    ap.add_argument("--contexts", default="1024,2048,4096,8192", help="prompt lengths (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per batch (default: 4)")
    ap.add_argument("--gpu-batches", type=int, default=1,
                    help="GPU batches the batch is cut into (FlexGen's --num-gpu-batches); with 2 or more, "
                         "SparPR's recovery of the next cell overlaps the current one's compute (default: 1)")
    ap.add_argument("--gen-len", type=int, default=gen_len, help=f"new tokens per sequence, >= 2 (default: {gen_len})")
    sparpr = {k.name: k.default for k in knobs(SparPR)}  # the engine's defaults, never the benchmark's own
    ap.add_argument("--keep-ratio", type=float, default=sparpr["keep_ratio"],
                    help="SparPR's ceiling (default: the engine's, %(default)s)")
    ap.add_argument("--min-keep", type=float, default=sparpr["min_keep"],
                    help="SparPR's floor (default: the engine's, %(default)s)")
    ap.add_argument("--min-keep-tokens", type=tokens_at_least_0, default=sparpr["min_keep_tokens"],
                    help="the least cached tokens SparPR's step reads (0: the keep ratio alone, the paper's budget; "
                         "default: the engine's, %(default)s)")
    ap.add_argument("--gamma", type=float, default=sparpr["gamma"],
                    help="SparPR's dense-fallback threshold (default: the engine's, %(default)s)")
    ap.add_argument("--block-size", type=int, default=DEFAULTS["block_size"],
                    help="tokens per KV block (default: the engine's, %(default)s)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")


def split_args(ap, depths: bool = False) -> None:
    """--split (tuning | held-out), --texts and --seed (default: the split's); with `depths`,
    --depths too. After parse_args, call resolve_split(args)."""
    ap.add_argument("--split", default="held-out", choices=list(SPLITS),
                    help="which texts/depths/seeds: held-out (reported results) or tuning (what rules were tuned on)")
    ap.add_argument("--texts", default="", help="comma list of texts of the split (default: all of the split's)")
    ap.add_argument("--seed", type=int, default=None, help="default: the split's")
    if depths:
        ap.add_argument("--depths", type=float_list, default=None,
                        help="needle depths, trial i uses depths[i %% n] (default: the split's)")


def resolve_split(args) -> None:
    """Fill args.text_objs, args.seed (and args.depths, if the parser has them) from the split."""
    sp = SPLITS[args.split]
    try:
        args.text_objs = texts_of(args.split, [t for t in args.texts.split(",") if t])
    except ValueError as e:
        die(str(e))
    args.seed = sp.seed if args.seed is None else args.seed
    if hasattr(args, "depths"):
        args.depths = list(sp.depths) if args.depths is None else args.depths
        if not all(0 <= d <= 1 for d in args.depths):
            die(f"--depths must be in [0, 1] (got {args.depths})")


def exact_routed_arg(ap) -> None:
    """--dkv-exact-routed E (>= 0): the dkv engine's E routed blocks read raw and attended exactly
    (the policy's --dkv-exact-routed; its raw copies in host memory)."""
    def count(text: str) -> int:
        if not text.isdigit():
            raise ValueError(text)  # argparse: "invalid count value", one line
        return int(text)
    count.__name__ = "count"
    ap.add_argument("--dkv-exact-routed", type=count, default=0, metavar="E",
                    help="the dkv engine's E routed blocks of most mass read raw and attended exactly (0: none)")
