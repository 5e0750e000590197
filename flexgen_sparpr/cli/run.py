"""`flexgen-sparpr run` / `python -m flexgen_sparpr.flex_opt`: one offloaded generation,
reported as upstream FlexGen reports it."""
from __future__ import annotations

import dataclasses
import sys

import torch

from ..engine.config import ConfigError
from ..engine.executor import Engine
from ..engine.memory import PeakMemory
from ..engine.sampling import Sampler
from ..utils.files import write_json_atomic
from ..weights.resolve import DUMMY, resolve_source
from . import report
from .flags import build_parser
from .options import apply_auto_policy, resolve
from .prompts import build_prompts, load_tokenizer


def run(argv=None, prog: str = "flexgen-sparpr run") -> dict:
    args = build_parser(prog).parse_args(argv)
    opts, policy, ecfg = resolve(args)
    is_dummy = DUMMY in opts.path
    max_seq = opts.max_seq_len or (opts.prompt_len + opts.gen_len if is_dummy else None)
    src = resolve_source(opts.model, opts.path, max_seq, opts.seed)
    spec = src.spec
    plan = None
    if opts.policy == "auto":  # placement and batch split from the hardware file (runtime/placement.py)
        policy, ecfg, plan, hw = apply_auto_policy(opts, policy, ecfg, spec)
    tok = load_tokenizer(src.tokenizer_dir) if not is_dummy else None
    prompts = build_prompts(opts, tok, policy.batch_size, spec.vocab)
    explicit = opts.prompt or opts.prompt_file or opts.prompt_ids_file
    pad_to = 0 if explicit else opts.prompt_len
    plen = max(pad_to, max(map(len, prompts)))
    stop = None if opts.stop is None else spec.eos_id if opts.stop == "eos" else _int(opts.stop, "--stop")
    say = (lambda *a: print(*a, flush=True)) if opts.verbose >= 1 else (lambda *a: None)
    n = policy.batch_size
    cache_b, hidden_b = spec.cache_bytes(n, plen + opts.gen_len), spec.hidden_bytes(n, plen + opts.gen_len)
    say(f"model size: {spec.model_bytes() / report.GB:.3f} GB, cache size: {cache_b / report.GB:.3f} GB, "
        f"hidden size (prefill): {hidden_b / report.GB:.3f} GB")
    if plan is not None:
        say(f"policy auto for {hw.name} ({hw.source}): {plan.describe(opts.gen_len)}")
    say("init weight...")
    tty = sys.stderr.isatty() and opts.verbose >= 1
    eng = Engine(src, policy, ecfg, progress=tty)
    try:
        if opts.warmup:
            say("warmup - generate")
            eng.generate([p[:32] for p in prompts], 1)
        say("benchmark - generate")
        eng.devices.counters.reset()
        gen_len = opts.cut_gen_len or opts.gen_len
        sampler = Sampler(opts.do_sample, opts.temperature, opts.top_p, opts.seed)
        with PeakMemory(eng.devices.compute) as mem:
            res = eng.generate(prompts, gen_len, sampler, stop=stop, progress=tty, pad_to=pad_to)
        moved = eng.devices.counters.snapshot()
        disk_mode = sorted({f.direct_mode for f in eng.disk.files.values()}) if eng.disk else None
    finally:
        eng.close()
    times = res.step_times
    prefill_lat = times[0]
    projected = bool(opts.debug_mode or opts.cut_gen_len)
    decode_lat = report.project_decode_latency(times, opts.gen_len) if opts.cut_gen_len else sum(times[1:])
    steps_done = opts.gen_len if opts.cut_gen_len else len(times)
    total_lat = prefill_lat + decode_lat
    mem_report = mem.report()
    texts = [tok.decode(t, skip_special_tokens=True) for t in res.tokens] if tok is not None else None
    if texts is not None and opts.verbose >= 2:
        show = "Outputs:\n" + 70 * "-" + "\n"
        for i in sorted({0, len(texts) - 1}):
            show += f"{i}: {texts[i]}\n" + "-" * 70 + "\n"
        print(show)
    if opts.debug_mode:
        say("step times (s): " + " ".join(f"{t:.4f}" for t in times))
    log = report.summary(spec.model_bytes(), cache_b, hidden_b, mem_report["gpu_peak_bytes"],
                         projected, prefill_lat, n * plen / prefill_lat, decode_lat,
                         n * (steps_done - 1) / max(decode_lat, 1e-10), total_lat, n * steps_done / total_lat)
    if not opts.no_log:
        report.append_log(opts.log_file if opts.log_file != "auto" else report.flexgen_log_name(opts, policy), log)
    say(log)
    if plan is not None:
        say(f"policy auto: predicted {plan.per_token_s(opts.gen_len):.4f} s/token, measured "
            f"{total_lat / opts.gen_len:.4f} s/token")
    say(f"peak host rss: {mem_report['host_rss_peak_bytes'] / report.GB:.3f} GB\t"
        f"bytes moved: " + (", ".join(f"{k} {v / report.GB:.3f} GB" for k, v in sorted(moved.items())) or "none"))
    out = {
        "model": spec.name, "weights": src.describe(), "device": str(eng.devices.compute),
        "dtype": str(eng.dtype).replace("torch.", ""), "prompt_len": plen, "gen_len": opts.gen_len,
        "batch_size": n, "prompt_ids": prompts, "output_ids": res.tokens, "texts": texts,
        "timings": {"prefill_s": prefill_lat, "decode_s": decode_lat, "total_s": total_lat,
                    "per_token_s": times, "projected": projected,
                    "decode_tokens_per_s": n * (steps_done - 1) / max(decode_lat, 1e-10)},
        "peak_memory": mem_report, "bytes_moved": moved, "disk_io_mode": disk_mode,
        "policy": dataclasses.asdict(policy), "engine": dataclasses.asdict(ecfg),
        "torch": torch.__version__,
    }
    if plan is not None:
        out["auto_policy"] = {"hardware": hw.name, "hardware_source": hw.source, **dataclasses.asdict(plan),
                              "predicted_per_token_s": plan.per_token_s(opts.gen_len)}
    if hasattr(eng.kv_policy, "stats"):  # per-step statistics of policies that keep them (sparpr)
        out["kv_policy_stats"] = eng.kv_policy.stats()
    if opts.output_json:
        write_json_atomic(opts.output_json, out)
    return out


def _int(v: str, flag: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{flag} takes a token id or 'eos', got {v!r}") from None
