"""scripts/dkv_speed.py's measurement and report: dense and dkv engines on the same batch, each
prefilled once, their answers compared, then decodes timed in alternating rounds from their
snapshots (so a change in the machine's load hits both alike)."""
from __future__ import annotations

import statistics

from ..api.llm import LLM
from ..api.resolved import resolved
from .results import md_table, timer
from .tasks import canonical

TARGET = 0.8  # dkv decode tok/s >= 0.8 x dense at 4k and 8k


def interleaved(src, tok, trials, args) -> dict:
    """One batch of passkey trials: each engine's decode tok/s per round, their ratios and median,
    how many answers equal dense's, and each engine's configuration as it resolved it (args:
    --batch, --gen-len, --rounds, --block, --dkv-exact-routed)."""
    eos = src.spec.eos_id
    llms = {name: LLM(src, gpu_batch_size=args.batch, device="cpu", block_size=args.block, quiet=True, **kw)
            for name, kw in (("dense", {}), ("dkv", {"kv_policy": "dkv", "dkv_exact_routed": args.dkv_exact_routed}))}
    engines = {name: llm.engine for name, llm in llms.items()}
    configs = {name: resolved(llm) for name, llm in llms.items()}
    try:
        snaps, answers = {}, {}
        for name, eng in engines.items():
            snaps[name] = eng.snapshot(eng.prefill([t.ids for t in trials], args.gen_len))
            res = eng.decode(eng.restore(snaps[name]), stop=eos)  # the answers, and a warm-up
            answers[name] = [tok.decode(r[:r.index(eos)] if eos in r else r, skip_special_tokens=True)
                             for r in res.tokens]
        speed = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, eng in engines.items():
                with timer() as t:
                    eng.decode(eng.restore(snaps[name]))
                speed[name].append(args.batch * (args.gen_len - 1) / t())
    finally:
        for llm in llms.values():
            llm.close()
    ratios = [k / d for k, d in zip(speed["dkv"], speed["dense"])]
    equal = sum(canonical("passkey", a) == canonical("passkey", b) for a, b in zip(answers["dkv"], answers["dense"]))
    return {"trials": len(trials), "dense_tok_s": speed["dense"], "dkv_tok_s": speed["dkv"], "ratios": ratios,
            "ratio_median": statistics.median(ratios), "answers_equal": equal, "answers": answers, "resolved": configs}


def render(payload) -> str:
    """speed.md: per length, each engine's tok/s per round, their median ratio, answers equal."""
    c = payload["config"]
    rows = [[r["length"], " / ".join(f"{x:.1f}" for x in r["dense_tok_s"]), " / ".join(f"{x:.1f}" for x in r["dkv_tok_s"]),
             f"{r['ratio_median']:.2f}", f"{r['answers_equal']}/{r['trials']}"] for r in payload["runs"]]
    return "\n".join([
        "# DKV decode speed vs dense, interleaved (SmolLM2-135M-Instruct)", "",
        f"Batch {c['batch']}, {c['gen_len']} tokens per timed decode (no stop), {c['rounds']} alternating rounds per "
        f"length, KV blocks of {c['block']} tokens on the compute tier, {c['device']}; torch threads "
        f"{payload['machine']['torch_threads']}, load average at the start {payload['machine']['load_average']}. "
        f"Held-out passkey prompts ({', '.join(c['texts'])}). Target: dkv ≥ {TARGET} × dense at 4k and 8k.", "",
        md_table(["context", "dense tok/s (rounds)", "dkv tok/s (rounds)", "dkv / dense (median of rounds)",
                  "answers equal"], rows),
        f"Command: `{payload['command']}`. Engine: {c['engine_commit']}. Wall: {payload.get('wall_s')} s.", ""])
