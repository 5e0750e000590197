"""The results plan's retrieval (scripts/needle.py, frontier.py, agreement.py) and perplexity
(scripts/ppl.py) grids (docs/fidelity.md, docs/sparpr.md, docs/weights.md). Each keeps the flags
its recorded plan holds (split, tasks, lengths, trials, policies, keeps), so a rerun resumes into
the published file; where a figure is about a flag (--block-size, --dkv-residuals,
--dkv-exact-routed, --weight-format) the entry's name says which."""
from __future__ import annotations

from .plan import Entry

SIX = "passkey,multi-key,multi-value,two-needles,long-key,phrase"
SIX_8K = "passkey,long-key,multi-key,multi-value,phrase,two-needles"  # that run's order: it seeds the prompts
ALL7 = "dkv,flexgen-topk,h2o,quest,sparpr,streaming-llm,sparpr+dkv"
FIVE = "flexgen-topk,h2o,quest,sparpr,streaming-llm"
FRESH = ("--split", "fresh", "--task", "passkey,multi-key")


# a grid whose published file holds only its first part (the part the docs cite); 8192 no longer
# fits with the answer in SmolLM2's 8192 positions (7936 is the longest that does)
_CUT = "the published file stopped before {0}: it is kept, and --force reruns the part these arguments name"


def _needle(folder: str, *flags: str, quick: bool = False, partial: str = "") -> Entry:
    out = f"results/{folder}"
    return Entry(folder.replace("/", "-"), "scripts/needle.py", (*flags, "--quiet", "--out", out),
                 (f"{out}/needle.json", f"{out}/needle.md"),
                 ("--task", "passkey", "--lengths", "256", "--trials", "1", "--batch", "1", "--policies", "sparpr",
                  "--keep", "0.1", "--quiet", "--out", "{out}") if quick else None, resumable=True, partial=partial)


def _held(folder: str, tasks: str, lengths: str, policies: str, keep: str, *more: str, quick: bool = False,
          partial: str = "") -> Entry:
    return _needle(f"fidelity/{folder}", "--split", "held-out", "--task", tasks, "--lengths", lengths,
                   "--policies", policies, "--keep", keep, *more, quick=quick, partial=partial)


def _ppl(folder: str, *flags: str, quick: bool = False, partial: str = "") -> Entry:
    out = f"results/{folder}"
    return Entry(folder.replace("/", "-"), "scripts/ppl.py", (*flags, "--score-tokens", "64", "--quiet", "--out", out),
                 (f"{out}/ppl.json", f"{out}/ppl.md"),
                 ("--texts", "asyoulik", "--lengths", "256", "--windows", "1", "--batch", "1", "--score-tokens", "8",
                  "--policies", "sparpr", "--keep", "0.1", "--quiet", "--out", "{out}") if quick else None,
                 resumable=True, partial=partial)


def _held_ppl(folder: str, lengths: str, policies: str, keep: str = "0.5,0.25,0.1,0.05", *more: str,
              quick: bool = False, partial: str = "") -> Entry:
    return _ppl(folder, "--split", "held-out", "--lengths", lengths, "--windows", "3", "--batch", "6",
                "--policies", policies, "--keep", keep, *more, quick=quick, partial=partial)


def _fresh_ppl(folder: str, length: str, policies: str, batch: str, *more: str, partial: str = "") -> Entry:
    return _ppl(folder, "--split", "fresh", "--stream", "--lengths", length, "--windows", "12", "--batch", batch,
                "--policies", policies, "--keep", "0.1", *more, partial=partial)


# a study of the ratio budget alone (--min-keep-tokens 0: at 2048 the floor would read 768 tokens)
_STUDY = ",".join(f"{c}:min_keep_tokens=0" for c in (
    "sparpr", "sparpr:summary=exact", "sparpr:per_head=true", "sparpr:summary=exact:per_head=true"))
_FLOORS = "sparpr:min_keep_tokens=0,sparpr:min_keep_tokens=512,sparpr,sparpr:min_keep_tokens=1024"
# every policy at its defaults, and SparPR without the budget's token floor (the ratio alone)
_DEFAULT_PPL = "sparpr,sparpr:min_keep_tokens=0,quest,h2o,streaming-llm,flexgen-topk,dkv,sparpr+dkv"

# dense's and DKV's answers on the held-out prompts, then DKV's with its top 2 routed blocks read raw
_EXACT2 = [f"results/fidelity/{d}/needle.json" for d in (
    "retrieval-dkv-2k", "late-question", "retrieval-4k", "retrieval-dkv-4k-follow12", "late-question-4k",
    "retrieval-8k", "passkey-dkv-8k", "late-question-8k", "late-question-8k-others", "dkv-exact2-2048",
    "dkv-exact2-2048-late", "dkv-exact2-4096", "dkv-exact2-4096-late", "dkv-exact2-7936-late")]
_DEFAULTS = [f"results/fidelity/defaults/{n}/needle.json" for n in (2048, 4096, 8000)]
_FRONTIER = [f"results/fidelity/{d}/needle.json" for d in (
    "retrieval-dkv-2k", "retrieval-2k-lowrank", "retrieval-2k-lowrank-more", "retrieval-dkv-2k-m32",
    "retrieval-dkv-2k-m64", "retrieval-2k-quest-sdkv", "retrieval-4k", "retrieval-dkv-4k", "retrieval-dkv-4k-follow12",
    "retrieval-4k-lowrank", "retrieval-4k-lowrank-more", "retrieval-dkv-4k-m32", "retrieval-dkv-4k-m64",
    "retrieval-4k-sdkv", "retrieval-8k", "retrieval-8k-lowrank", "retrieval-8k-lowrank-more", "passkey-dkv-8k",
    "dkv-exact2-2048", "dkv-exact2-4096")]

FIDELITY = [
    # the engine's defaults on the fresh split (docs/fidelity.md's headline)
    _needle("fidelity/defaults/2048", *FRESH, "--lengths", "2048", "--trials", "24", "--batch", "6",
            "--keep", "0.5,0.1", "--frontier-keep", "0.25,0.05,0.025", quick=True),
    _needle("fidelity/defaults/4096", *FRESH, "--lengths", "4096", "--trials", "24", "--batch", "6",
            "--keep", "0.5,0.1", "--frontier-keep", "0.25,0.05,0.025"),
    _needle("fidelity/defaults/8000", *FRESH, "--lengths", "8000", "--trials", "12", "--batch", "4",
            "--keep", "0.5,0.1", "--frontier-keep", "0.25,0.05,0.025"),
    Entry("fidelity-defaults-frontier", "scripts/frontier.py", (*_DEFAULTS, "--out", "results/fidelity/defaults"),
          ("results/fidelity/defaults/frontier.json", "results/fidelity/defaults/frontier.md")),
    Entry("fidelity-defaults-agreement", "scripts/agreement.py",
          (*_DEFAULTS, "--target", "sparpr@0.1", "--out", "results/fidelity/defaults"),
          ("results/fidelity/defaults/agreement.json", "results/fidelity/defaults/agreement.md")),
    # dense and SparPR keep 0.1 alone at the defaults, the same prompts (a rerun at today's engine in minutes)
    *[_needle(f"fidelity/defaults-sparpr/{n}", *FRESH, "--lengths", str(n), "--trials", t, "--batch", b,
              "--policies", "sparpr", "--keep", "0.1") for n, t, b in ((2048, "24", "6"), (4096, "24", "6"),
                                                                         (8000, "12", "4"))],
    Entry("fidelity-defaults-sparpr-agreement", "scripts/agreement.py",
          (*[f"results/fidelity/defaults-sparpr/{n}/needle.json" for n in (2048, 4096, 8000)], "--target", "sparpr@0.1",
           "--out", "results/fidelity/defaults-sparpr"),
          ("results/fidelity/defaults-sparpr/agreement.json", "results/fidelity/defaults-sparpr/agreement.md")),
    *[_needle(f"fidelity/defaults-block/b{b}", *FRESH, "--lengths", "2048", "--trials", "12", "--batch", "6",
              "--policies", "sparpr", "--keep", "0.1", "--block-size", str(b)) for b in (16, 64)],
    # the held-out split: six retrieval tasks and the late question
    _held("retrieval", SIX, "2048", FIVE, "0.5,0.1,0.05", "--frontier-keep", "0.25,0.02",
          partial=_CUT.format("4096 and 8192 (retrieval-4k/ and retrieval-8k/ hold them)")),
    _held("retrieval-4k", SIX, "4096", FIVE, "0.5,0.1,0.05", "--frontier-keep", "0.25,0.02"),
    _held("retrieval-8k", SIX_8K, "7936", FIVE, "0.5,0.1,0.05", "--frontier-keep", "0.25,0.02"),
    _held("retrieval-2k-lowrank", SIX, "2048", "sparpr", "0.5,0.1"),
    _held("retrieval-2k-lowrank-more", SIX, "2048", "sparpr", "0.25,0.05"),
    _held("retrieval-4k-lowrank", SIX, "4096", "sparpr", "0.1"),
    _held("retrieval-4k-lowrank-more", SIX, "4096", "sparpr", "0.5,0.25,0.05"),
    _held("retrieval-8k-lowrank", SIX_8K, "7936", "sparpr", "0.1"),
    _held("retrieval-8k-lowrank-more", SIX_8K, "7936", "sparpr", "0.5,0.25,0.05"),
    _held("retrieval-2k-quest-sdkv", SIX, "2048", "quest,sparpr+dkv", "0.5,0.1", "--frontier-keep", "0.25,0.05"),
    _held("retrieval-4k-sdkv", SIX, "4096", "sparpr+dkv", "0.5,0.1", "--frontier-keep", "0.25,0.05"),
    _held("retrieval-dkv-2k", SIX, "2048", "dkv,sparpr+dkv,sparpr", "0.5,0.1"),
    _held("retrieval-dkv-4k", SIX, "4096", "dkv,sparpr+dkv", "0.5,0.1"),
    *[_held(f"retrieval-dkv-{n}k-m{m}", SIX, str(1024 * n), "dkv", "0.5,0.1,0.05", "--dkv-residuals", str(m))
      for n in (2, 4) for m in (32, 64)],
    _held("passkey-dkv-8k", "passkey", "7936", "dkv,sparpr+dkv", "0.5,0.1"),
    *[_held(f"dkv-exact2-{n}", SIX, str(n), "dkv", "0.5,0.1,0.05", "--dkv-exact-routed", "2") for n in (2048, 4096)],
    *[_held(f"dkv-exact2-{n}-late", "late-question", str(n), "dkv", "0.5,0.1,0.05", "--dkv-exact-routed", "2")
      for n in (2048, 4096, 7936)],
    _held("dkv-held-out-2k", "passkey", "2048", "dkv,sparpr+dkv", "0.5,0.1", partial=_CUT.format("4096")),
    _held("sparpr-dkv-held-out", "passkey", "2048,4096", "sparpr+dkv", "0.5,0.1",
          partial="the published file holds one of the two 4096 batches; it is kept, and --force reruns all"),
    _held("late-question", "late-question", "2048", ALL7, "0.1"),
    _held("late-question-4k", "late-question", "4096", ALL7, "0.1"),
    _held("late-question-8k", "late-question", "7936", "flexgen-topk,sparpr", "0.1"),
    _held("late-question-8k-others", "late-question", "7936", "quest,h2o,streaming-llm,dkv", "0.1"),
    *[_held(f"late-question-{n}-lowrank", "late-question", str(m), "sparpr", "0.1")
      for n, m in (("2k", 2048), ("4k", 4096), ("8k", 7936))],
    Entry("fidelity-frontier", "scripts/frontier.py",
          (*_FRONTIER, "--drop", "sparpr@0.02", "--out", "results/fidelity"),
          ("results/fidelity/frontier.json", "results/fidelity/frontier.md")),
    Entry("fidelity-dkv-exact2-agreement", "scripts/agreement.py",
          (*_EXACT2, "--target", "dkv-exact2@0.2749", "--watch", "dkv-exact2@0.2749",
           "--pair", "dkv@0.2749,dkv-exact2@0.2749", "--title", "DKV without -> with --dkv-exact-routed 2",
           "--out", "results/fidelity/dkv-exact2-agreement"),
          ("results/fidelity/dkv-exact2-agreement/agreement.json", "results/fidelity/dkv-exact2-agreement/agreement.md")),
    Entry("fidelity-retrieval-2k-lowrank-frontier", "scripts/frontier.py",
          (*_FRONTIER[:5], "--out", "results/fidelity/retrieval-2k-lowrank"),
          ("results/fidelity/retrieval-2k-lowrank/frontier.json", "results/fidelity/retrieval-2k-lowrank/frontier.md")),
    # passkey on the tuning split, the first retrieval figure (results/README.md)
    # (made before the split and the resumable format, at 8192 tokens: --force reruns it at the default 7936)
    _needle("needle", "--split", "tuning", "--task", "passkey", "--keep", "0.5,0.1",
            "--policies", "flexgen-topk,h2o,quest,streaming-llm", "--batch", "2"),
    # perplexity
    # the budget's token floor (--min-keep-tokens, default 768), chosen on the tuning split at keep 0.1
    *[_ppl(f"ppl-min-keep-tokens/{n}", "--split", "tuning", "--lengths", str(n), "--windows", w, "--batch", b,
           "--policies", _FLOORS, "--keep", "0.1") for n, w, b in ((2048, "12", "6"), (4096, "8", "4"))],
    _fresh_ppl("ppl-defaults/2048", "2048", _DEFAULT_PPL, "6"),
    _fresh_ppl("ppl-defaults/4096", "4096", _DEFAULT_PPL, "6"),
    _fresh_ppl("ppl-defaults/8000", "8000", "sparpr,quest,h2o,streaming-llm,flexgen-topk,dkv,sparpr+dkv", "4"),
    # the raw-KV policies alone at 8000 (no DKV prefill): all 12 windows, before ppl-defaults/8000 held them
    _fresh_ppl("ppl-defaults-raw/8000", "8000", "sparpr,quest,h2o,streaming-llm,flexgen-topk", "4"),
    *[_fresh_ppl(f"ppl-weights/{w}", "2048", "sparpr", "4", "--weight-format", w) for w in ("auto", "raw")],
    # what bounds keep 0.1 at 2k: SparPR's scores against the exact keys', one set for all KV heads
    # against each its own, per selection granularity (docs/fidelity.md, "What bounds keep 0.1")
    *[_fresh_ppl(f"ppl-granularity/b{bs}", "2048", _STUDY + (",flexgen-topk:min_keep_tokens=0" if bs == 16 else ""), "6",
                 "--block-size", str(bs)) for bs in (16, 4, 2)],
    # quantized KV (--kv-dtype q8 / q4 on the disk tier), alone and under SparPR's selection, beside DKV
    _fresh_ppl("ppl-kv-dtype/2048", "2048", "dense+q8,dense+q4,sparpr,sparpr+q8,sparpr+q4,dkv", "6"),
    # the same on the needle prompts of fidelity/defaults/2048 (DKV's rows are in that file)
    _needle("fidelity/kv-dtype/2048", *FRESH, "--lengths", "2048", "--trials", "24", "--batch", "6",
            "--policies", "dense+q8,dense+q4,sparpr,sparpr+q8,sparpr+q4", "--keep", "0.1"),
    _held_ppl("ppl", "2048", ALL7, quick=True, partial=_CUT.format("4096 and 8192 (ppl-4k8k/ holds them)")),
    _held_ppl("ppl-4k8k", "4096,7936", FIVE),
    _held_ppl("ppl-2k-lowrank", "2048", "sparpr"),
    _held_ppl("ppl-4k8k-lowrank", "4096,7936", "sparpr"),
    _ppl("ppl-8k-8windows", "--split", "held-out", "--lengths", "7936", "--windows", "4", "--batch", "4",
         "--policies", "sparpr", "--keep", "0.1,0.25"),
    _held_ppl("ppl-dkv-4k", "4096", "dkv,sparpr+dkv"),
    _held_ppl("ppl-dkv-8k", "7936", "dkv,sparpr+dkv"),
    _held_ppl("ppl-dkv-exact2-8k", "7936", "dkv", "0.5", "--dkv-exact-routed", "2"),
]
