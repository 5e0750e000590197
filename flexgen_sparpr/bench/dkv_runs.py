"""scripts/bench_dkv.py's runs: DKV's bytes per block for several model shapes, and one prefill per
configuration (dense, dkv, dkv with block-sparse prefill, sparpr over raw or DKV cold blocks on
disk) whose snapshot every keep ratio decodes from, timed, with the passkey answers; the report."""
from __future__ import annotations

import torch

from ..api.llm import LLM
from ..kv.dkv.codec import PICKS, DKVCodec  # noqa: F401  (PICKS: the script's --residual-pick choices)
from ..kv.policies import make_policy
from ..models.spec import opt_spec
from .needle_prompt import passkey_hit
from ..api.resolved import resolved
from .results import md_table, timer
from .sweep import REFERENCE

CONFIGS = ("dense", "dkv", "dkv-sparse-prefill", "sparpr", "sparpr+dkv")


def compression_rows(block: int, rank: int, residuals: int) -> list[list]:
    """Bytes of one KV block (one sequence, one layer) dense vs DKV, for SmolLM2 and OPT shapes."""
    shapes = {"smollm2-135m": (3, 64)}
    for name in ("opt-125m", "opt-1.3b", "opt-6.7b"):
        spec = opt_spec(name)
        shapes[name] = (spec.num_kv_heads, spec.head_dim)
    rows = []
    for name, (hkv, d) in shapes.items():
        for dtype in (torch.float16, torch.float32):
            c = DKVCodec((2, 1, hkv, block, d), dtype, rank, residuals)
            rows.append([name, str(dtype).split(".")[1], f"2x{hkv}x{d}", c.dense_nbytes(), c.nbytes,
                         round(c.dense_nbytes() / c.nbytes, 2)])
    return rows


def llm_for(src, config: str, args, batch: int, offload: str) -> LLM:
    """The configuration's LLM for one batch of `batch` prompts (its flags as keyword arguments)."""
    dkv = {"dkv_rank": args.rank, "dkv_residuals": args.residuals, "dkv_residual_pick": args.residual_pick}
    flags = dict(device="cpu", block_size=args.block, gpu_batch_size=batch, quiet=True)
    if config.startswith("dkv"):
        flags |= dict(kv_policy="dkv", **dkv, dkv_topk=args.topk, dkv_dense_layers=args.dense_layers,
                      dkv_route=args.route, dkv_sparse_prefill=config == "dkv-sparse-prefill",
                      dkv_pick_follow=args.pick_follow)
    elif config != REFERENCE:  # sparpr decodes from a dense-policy prefill of a disk cache (raw, or in DKV form)
        cold = dict(cold_codec="dkv", **dkv) if config == "sparpr+dkv" else {}
        flags |= dict(offload_dir=offload, direct_io=True, percent=[100, 0, 0, 0, 100, 0], **cold)
    return LLM(src, **flags)


def answers(res, trials, tok, eos) -> list[dict]:
    """Each trial's decoded answer (up to the stop token) and whether it holds the passkey."""
    out = []
    for trial, toks in zip(trials, res.tokens):
        toks = toks[:toks.index(eos)] if eos in toks else toks
        text = tok.decode(toks, skip_special_tokens=True)
        out.append({"key": trial.key, "depth": trial.depth, "answer": text, "hit": passkey_hit(text, trial.key)})
    return out


def run_config(src, config, args, trials, tok, offload) -> list[dict]:
    """One configuration on one batch of passkey trials: a record per keep ratio (one for
    configurations without one), with its timings, disk reads, policy stats, answers and the
    configuration as the engine resolved it (the KV policy the record decoded with)."""
    eos, recs = src.spec.eos_id, []
    with llm_for(src, config, args, len(trials), offload) as llm:
        eng = llm.engine
        runs = [(config, None)] if not config.startswith("sparpr") else [(f"{config}@{k}", k) for k in args.keep]
        observers = tuple(make_policy("sparpr", keep_ratio=k, probe_dir=offload) for _, k in runs if k)
        with timer() as t_pre:
            st = eng.prefill([t.ids for t in trials], args.gen_len, observers=observers)
        prefill_s = t_pre()
        snap = eng.snapshot(st)
        for (name, _), pol in zip(runs, observers or (None,)):
            if pol is not None:
                eng.set_kv_policy(pol, attach=False)
            res = eng.decode(eng.restore(snap), stop=eos)  # the answers (and a warm-up for the timing)
            before = eng.devices.counters.snapshot().get("disk->cpu", 0)
            with timer() as t_dec:  # the same decode again, timed, without the stop token
                timed = eng.decode(eng.restore(snap))
            steps = max(1, len(timed.step_times) - 1)
            recs.append({"config": name, "length": len(trials[0].ids), "prefill_s": round(prefill_s, 2),
                         "decode_s": round(t_dec(), 3), "decode_tok_s": round(len(trials) * steps / t_dec(), 2),  # all sequences, gen_len - 1 steps
                         "decode_steps": steps,
                         "disk_read_bytes": eng.devices.counters.snapshot().get("disk->cpu", 0) - before,
                         "stats": eng.kv_policy.stats() if hasattr(eng.kv_policy, "stats") else None,
                         "resolved": resolved(llm),
                         "trials": answers(res, trials, tok, eos)})
            print(f"{name} @ {recs[-1]['length']}: {sum(t['hit'] for t in recs[-1]['trials'])}/{len(trials)} "
                  f"prefill {prefill_s:.1f}s decode {recs[-1]['decode_tok_s']} tok/s", flush=True)
    return recs


def render(payload) -> str:
    a = payload["config"]
    lines = [f"# DKV on SmolLM2-135M-Instruct ({a['trials']} passkey trials per length)\n",
             f"Block {a['block']} tokens, rank {a['rank']}, {a['residuals']} residual rows, top-{a['topk']} "
             f"routed blocks (routing: {a['route']}), residual pick {a.get('residual_pick', 'error')}, one exact recent "
             f"block. CPU float32, {payload['machine']['cpu_count']} cores, "
             f"load average {payload['machine']['load_average']}. Command: `{payload['command']}`.\n",
             "## Bytes per KV block (one sequence, one layer; the codec's formula)\n",
             md_table(["model", "dtype", "K|V heads x dim", "dense B", "DKV B", "dense / DKV"], payload["compression"]),
             "\n## Passkey retrieval, decode speed, prefill time\n"]
    rows = []
    for r in payload["runs"]:
        hits = sum(t["hit"] for t in r["trials"])
        rows.append([r["config"], r["length"], f"{hits}/{len(r['trials'])}", r["prefill_s"], r["decode_tok_s"],
                     r["disk_read_bytes"]])
    lines.append(md_table(["config", "context", "exact key", "prefill s", "decode tok/s", "disk->cpu B (decode)"],
                          rows))
    return "\n".join(lines)

