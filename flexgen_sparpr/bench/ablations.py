"""scripts/bench_ablations.py's needle half and report: held-out passkey prompts, each variant's
answers with the KV cache on the (throttled) disk tier, and the table beside the paper's."""
from __future__ import annotations

import random

from .results import md_table

VARIANTS = {"full": {}, "no-dynamic-budget": {"dynamic_budget": False}, "quest-only": {"quest_only": True},
            "no-recompute": {"recompute": False}, "no-fallback": {"fallback": False}}
PAPER = {"full": ".957", "no-dynamic-budget": ".963", "quest-only": ".777", "no-recompute": "n/a",
         "no-fallback": "n/a"}  # the quote of the paper's ablation


def needle_trials(tokenizer, n: int, length: int):
    """n held-out needle prompts (texts, depths and seed of the held-out split)."""
    from .needle_prompt import NeedlePrompts, random_key
    from .texts import SPLITS, texts_of
    sp = SPLITS["held-out"]
    rng = random.Random(sp.seed)
    builders = [NeedlePrompts(tokenizer, t.path, answer_prefix="The secret passkey is") for t in texts_of("held-out")]
    return [builders[i % len(builders)].build(length, sp.depths[i % len(sp.depths)], random_key(rng, 5), rng)
            for i in range(n)]


def needle_run(src, tokenizer, trials, args, policy: str, pargs: dict) -> tuple[list[str], list[dict]]:
    """The answers of every trial, the KV cache all on the (throttled) disk tier, and the
    configuration each prefill's engine resolved (one per --needle-batch group)."""
    from ..api.llm import LLM
    from ..api.resolved import resolved
    answers, configs = [], []
    for i in range(0, len(trials), args.needle_batch):
        group = trials[i:i + args.needle_batch]
        with LLM(src, device="cpu", dtype="float32", block_size=args.needle_block_size, direct_io=True,
                 offload_dir=args.offload_dir, kv_policy=policy, policy_args=pargs, gpu_batch_size=len(group),
                 percent=[100, 0, 0, 0, 100, 0], quiet=True) as llm:
            rows = llm.generate_ids([t.ids for t in group], llm.params(8, stop=None), sort=False)
            configs.append(resolved(llm))
        answers += [tokenizer.decode(toks) for toks in rows]
    return answers, configs


def render_md(p: dict) -> str:
    """The ablation table (speed, counts, needle hits, the paper's column) and its notes."""
    cfg, f = p["config"], (lambda x, n=1: "n/a" if x is None else f"{x:.{n}f}")
    full = p["variants"]["full"]
    head = ["variant", "e2e s", "vs full", "disk MB", "read requests", "selected", "copied", "recomputed",
            "fallbacks", "ρ range", f"needle hits (dense {p['dense_needle_hits']}/{cfg['trials']})",
            "same as dense", "paper"]
    rows = [[n, f(c["e2e_s"]), f"{c['e2e_s'] / full['e2e_s']:.2f}x", f(c["disk_read_bytes"] / 1e6, 0),
             (c.get("requests") or {}).get("disk->cpu", "n/a"), c["blocks_selected"], c["blocks_copied"],
             c["blocks_recomputed"], c["fallbacks"], "n/a" if not c["rho_range"] else
             f"{c['rho_range'][0]:.2f}-{c['rho_range'][1]:.2f}", f"{c['needle_hits']}/{c['needle_trials']}",
             f"{c['same_as_dense']}/{c['needle_trials']}", PAPER[n]] for n, c in p["variants"].items()]
    m = p["machine"]
    notes = [f"- Read cap {p['read_mbps']:g} MB/s" + ("" if p["throttled"] else f" NOT applied ({p['note']})")
             + f"; speed: {cfg['model']} dummy, batch {cfg['batch']}, context {cfg['context']}, gen {cfg['gen_len']}, "
             f"block {cfg['block_size']}, keep ceiling {cfg['keep_ratio']}, min_keep {cfg['min_keep']}, gamma {cfg['gamma']}.",
             f"- Needle: SmolLM2-135M-Instruct, {cfg['trials']} held-out trials of {cfg['needle_length']} tokens "
             f"(texts asyoulik/plrabn12, depths 0.1/0.5/0.9, seed 1001), block {cfg['needle_block_size']}, KV on the "
             "throttled disk tier; 'same as dense' counts trials whose hit/miss equals dense's.",
             "- The paper's column quotes its ablation (full .957, no dynamic budget .963, Quest-only .777); it "
             "has no row for the other two.",
             f"- Host {m['cpu_model']}, {m['cpu_count']} cores, load average at start {m['load_average']}; "
             f"{p['wall_s'] / 60:.1f} min wall. Times compare only within this run."]
    return "# SparPR ablations under a read throttle\n\n" + md_table(head, rows) + "\n" + "\n".join(notes) + "\n"
