"""scripts/frontier.py's inputs and report: needle.py results files joined by trial (refusing files
of other prompts), DKV's budget as its bytes per block, the frontier's plot and DKV's cell."""
from __future__ import annotations

import json
from pathlib import Path

from ..kv.dkv.codec import DKVCodec
from ..kv.policies.dkv import DKV
from .args import die


POLICIES = ("sparpr", "quest", "sparpr+dkv")


PROMPT_KEYS = ("split", "texts", "depths", "seed", "tasks", "trials", "batch", "answer_prefix")


def parse_drop(text: str) -> frozenset[str]:
    """--drop's entries: LABEL (every length) or LABEL:LENGTH (that context length only)."""
    out = set()
    for x in filter(None, text.split(",")):
        label, _, length = x.partition(":")
        if not label or "@" not in label or (length and not length.isdigit()):
            die(f"--drop {x!r}: expected policy@keep or policy@keep:length (e.g. sparpr@0.02 or sparpr@0.5:4096)")
        out.add(x)
    return frozenset(out)


def load(paths: list[Path], drop: frozenset = frozenset()) -> tuple[dict, list[dict], list[str]]:
    """(prompt plan, records joined by (trial, label), engine commits), without the records `drop`
    names (LABEL, or LABEL:LENGTH for one length). Dies on files whose prompts differ, and on an
    entry of `drop` that matches no record."""
    plan, recs, commits, prompts, dropped = None, {}, [], {}, set()
    seen_lengths: set[int] = set()
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            die(f"cannot read {p}: {e}")
        if "plan" not in data or "records" not in data:
            die(f"{p} is not a scripts/needle.py results file")
        mine = {k: data["plan"].get(k) for k in PROMPT_KEYS}
        lengths = set(data["plan"].get("lengths") or [])
        # trials and batch only cut a length's prompts into trial ids: files of disjoint lengths may differ there
        keys = [k for k in PROMPT_KEYS if k != "tasks" and (k not in ("trials", "batch") or lengths & seen_lengths)]
        if plan is None:
            plan = mine
        elif any(mine[k] != plan[k] for k in keys):
            die(f"{p} was made from other prompts than {paths[0]} (plans differ in "
                f"{', '.join(k for k in keys if mine[k] != plan[k])})")
        seen_lengths |= lengths
        dkv_args = dict(data["plan"].get("dkv_args", {}))  # a needle.py run's DKV knobs, where not the defaults
        exact = dkv_args.pop("exact_routed", 0)  # routed blocks read raw: another column, the same bytes stored
        share = dkv_bytes(data["plan"].get("dkv_block", 256), **dkv_args)  # the file's one DKV configuration
        for r in data["records"]:
            if r["policy"] == DKV.name:  # its budget is its bytes: one label per DKV configuration
                pol = f"dkv-exact{exact}" if exact else "dkv"
                r = dict(r, policy=pol, keep=round(share, 4), label=f"{pol}@{share:.4f}")
            elif dkv_args and r["policy"] == "sparpr+dkv":
                die(f"{p}: sparpr+dkv over a DKV configuration other than the default ({dkv_args}): its keeps "
                    f"would mix with the default's; give its frontier on its own")
            hit = drop & {r["label"], f"{r['label']}:{r['length']}"}
            if hit:
                dropped |= hit
                continue
            recs[(r["trial"], r["label"])] = r
            # a trial id names the same prompt in every file only if its draws agree
            seen = prompts.setdefault(r["trial"], (r["expected"], r["depth"], r.get("text")))
            if seen != (r["expected"], r["depth"], r.get("text")):
                die(f"{p}: trial {r['trial']} is another prompt than in an earlier file (keys {seen[0]} vs "
                    f"{r['expected']}): runs whose task lists differ draw their prompts differently")
        ran = sorted({b["engine"] for b in data.get("batches", []) if "engine" in b})  # each batch's, where named
        commits.extend(ran or [data["config"].get("engine_commit", "unknown")])
    if drop - dropped:
        die(f"--drop {','.join(sorted(drop - dropped))}: no such label in the inputs")
    return plan, list(recs.values()), commits


def dkv_bytes(block: int = 256, rank: int = DKV().rank, residuals: int = DKV().residuals) -> float:
    """DKV's encoded block over a raw one for SmolLM2 (3 KV heads x 64), float32."""
    return DKVCodec.formula(1, 3, block, 64, rank, residuals, 4) / (2 * 3 * block * 64 * 4)


def plot(fr: dict, cells: list[tuple[str, int]], png: Path) -> None:
    """Per task, each policy's smallest agreeing keep (DKV's: bytes) against the context length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    tasks = sorted({t for t, _ in cells})
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 3.6), squeeze=False, sharey=True)
    for ax, task in zip(axes[0], tasks):
        lengths = sorted(n for t, n in cells if t == task)
        for i, pol in enumerate(fr):  # measured cells only; 1.05: measured, never agreed enough
            pts = [(n, fr[pol][(task, n)]) for n in lengths if (task, n) in fr[pol]]
            style = dict(marker="os^"[i], label=pol) if i < len(POLICIES) else \
                dict(ls=":", color="k" if pol == DKV.name else "tab:red", marker="x" if pol == DKV.name else "+",
                     label=f"{pol} (bytes)")
            ax.plot([n for n, _ in pts], [y if y is not None else 1.05 for _, y in pts], **style)
        ax.axhline(1.05, color="0.8", lw=0.8)
        ax.set(title=task, xlabel="context tokens", xscale="log", yscale="log", ylim=(0.015, 1.2))
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # under a decade: minor labels overlap
        ax.set_xticks(lengths)
        ax.set_xticklabels([str(n) for n in lengths])
    axes[0][0].set_ylabel("smallest keep (dkv: bytes) with >= 95 %\nagreement (top line: none measured)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def dkv_cell(k: float | None, configs: list[dict]) -> str:
    """DKV's column: the smallest share of dense's bytes that meets the bar, then each configuration
    measured: its trials equal to dense's and dense's hits it keeps."""
    head = f"{k:.3f}" if k is not None else f"> {max(r['keep'] for r in configs):.3f}"
    return head + " (" + "; ".join(f"{r['keep']:.3f}: {r['agree']}/{r['n']}, {r['kept']} of dense's {r['dense_hits']} hits"
                                   for r in sorted(configs, key=lambda r: r["keep"])) + ")"
