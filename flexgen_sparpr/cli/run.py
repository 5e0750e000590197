"""`flexgen-sparpr run` / `python -m flexgen_sparpr.flex_opt`: one offloaded generation,
reported as upstream FlexGen reports it; a thin user of the Python API (api/llm.py).

Three steps, each callable from Python without argparse: `set_up` (the weights, the tokenizer,
the prompts and, with --policy auto, the placement), `generate` (the engine's warm-up and timed
generation) and `report` (FlexGen's summary lines and log, the JSON). `run` is the CLI: flags
(config/options.py `resolve`, which also takes a plain dict of flag values), then the three.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..api.llm import LLM, Params
from ..api.resolved import resolved
from ..engine.config import EngineConfig, Policy
from ..engine.state import GenerationResult
from ..engine.step_clock import median_parts
from ..runtime.stages import stage_spec
from ..utils.progress import bars_wanted
from ..weights.resolve import DUMMY, SMOLLM2, resolve_source
from ..config import preflight
from . import report as fmt
from .parser import build_parser
from ..config.options import RunOptions, apply_auto_policy, resolve
from .outputs import deliver, writable_file
from ..config.prompts import build_prompts, load_tokenizer
from .stream import StreamPrinter


@dataclass
class Setup:
    """A run ready to start: what to run, on which placement and engine config, with which weights,
    tokenizer and prompt ids."""

    opts: RunOptions
    policy: Policy
    engine: EngineConfig
    source: object  # weights/sources.py WeightSource
    tokenizer: object | None
    prompts: list[list[int]]
    pad_to: int  # the prompts are left-padded to at least this many tokens
    stop: int | None
    plan: object | None = None  # --policy auto: runtime/placement.py Plan
    hardware: object | None = None  # ... and the hardware it planned for
    output: object | None = None  # --output-json, checked writable before any work (Path)
    log_path: object | None = None  # FlexGen's log file, likewise (None: --no-log)
    stage: object | None = None  # a distributed run: this rank's engine/pipeline.py Stage

    @property
    def dtype(self) -> torch.dtype:
        """The run's compute dtype (what the summary's sizes are counted in)."""
        return self.engine.torch_dtype(self.engine.torch_device())

    @property
    def prompt_len(self) -> int:
        return max(self.pad_to, max(map(len, self.prompts)))

    def say(self, *a) -> None:
        if self.opts.verbose >= 1:
            print(*a, flush=True)


@dataclass
class Generated:
    """What the timed generation produced and measured."""

    result: GenerationResult
    bytes_moved: dict  # per link, during the timed generation
    memory: dict  # engine/memory.py PeakMemory.report()
    disk_modes: list | None
    device: str
    dtype: str
    kv_stats: dict | None = None  # the KV policy's per-step statistics, if it keeps them
    weight_format: str = ""  # what --weight-format resolved to (engine/weight_format.py describe)
    resolved: dict | None = None  # the engine's settings as resolved (api/resolved.py)


def set_up(opts: RunOptions, policy: Policy, ecfg: EngineConfig, pipeline=None) -> Setup:
    """The weight source, tokenizer and prompt ids; --policy auto's placement; every check that
    needs no weights (config/preflight.py: output paths, context, offload folder, capacity).
    pipeline: a distributed run's stage choice (cli/dist.py Pipeline): this rank's layers and,
    with --policy auto, its placement; the capacity check is then the stage's."""
    output = writable_file(opts.output_json, "--output-json") if opts.output_json else None
    is_dummy = DUMMY in opts.path
    max_seq = opts.max_seq_len or (opts.prompt_len + opts.gen_len if is_dummy else None)
    src = resolve_source(opts.model, opts.path, max_seq, opts.seed)
    tok = load_tokenizer(src.tokenizer_dir) if not is_dummy else None
    prompts = build_prompts(opts, tok, policy.batch_size, src.spec.vocab)  # --policy auto keeps the batch
    explicit = opts.prompt or opts.prompt_file or opts.prompt_ids_file
    pad_to = 0 if explicit else opts.prompt_len
    prompt_len = max(pad_to, max(map(len, prompts)))
    plan = hw = stage = cap = None
    if pipeline is not None:
        policy, ecfg, stage, plan, hw = pipeline.place(opts, policy, ecfg, src.spec)
    elif opts.policy == "auto":  # placement and batch split from the hardware file (runtime/placement.py)
        policy, ecfg, plan, hw, cap = apply_auto_policy(opts, policy, ecfg, src.spec, prompt_len)
    if plan is not None and opts.verbose >= 1:  # before the check, which would name the placement it refuses
        print(f"policy auto for {hw.name} ({hw.source}): {plan.describe(opts.gen_len)}", flush=True)
    log_path = None if opts.no_log else writable_file(
        opts.log_file if opts.log_file != "auto" else fmt.flexgen_log_name(opts, policy, src.spec, prompt_len),
        "--log-file")
    stop = preflight.stop_token(opts.stop, src.spec)
    s = Setup(opts, policy, ecfg, src, tok, prompts, pad_to, stop, plan, hw, output, log_path, stage)
    held = src.spec if stage is None else stage_spec(src.spec, stage.num_layers)  # what this process holds
    preflight.before_loading(opts, policy, ecfg, held, s.prompt_len, is_dummy, cap)  # nothing loaded yet
    return s


def generate(s: Setup, link=None) -> Generated:
    """FlexGen's run: announce the sizes, load the weights, one short warm-up generation (unless
    --warmup false), then the timed generation with peak memory and bytes moved; through the
    Python API (api/llm.py), the one path of every generation. --stream prints as it decodes.
    link: a distributed run's engine/pipeline.py StageLink for s.stage (its micro-batches, its
    neighbours)."""
    opts, spec, n, dt = s.opts, s.source.spec, len(s.prompts), s.dtype
    total = s.prompt_len + opts.gen_len
    s.say(f"model size: {spec.model_bytes(dt) / fmt.GB:.3f} GB, cache size: {spec.cache_bytes(n, total, dt) / fmt.GB:.3f} "
          f"GB, hidden size (prefill): {spec.hidden_bytes(n, total, dt) / fmt.GB:.3f} GB")
    s.say("init weight...")
    bars = bars_wanted(opts.quiet) and opts.verbose >= 1
    with LLM.loaded(opts, s.policy, s.engine, s.source, s.tokenizer, progress=bars, link=link) as llm:
        s.say(f"weight format: {llm.engine.weight_format.describe()}")
        if opts.warmup:
            s.say("warmup - generate")
            llm.generate_ids([p[:32] for p in s.prompts], Params(1), sort=False)
        s.say("benchmark - generate")
        params = Params(opts.cut_gen_len or opts.gen_len, s.stop, opts.do_sample, opts.temperature, opts.top_p,
                        opts.seed)
        printer = StreamPrinter(s.tokenizer, len(s.prompts), params) if opts.stream else None
        rows = llm.generate_ids(s.prompts, params, progress=bars and not opts.stream, pad_to=s.pad_to, sort=False,
                                on_step=printer)
        if printer is not None:
            printer.close()
        st = llm.last_stats
        formats, config = llm.engine.weight_format.describe(), resolved(llm)
    res = GenerationResult(tokens=rows, step_times=st.step_times[0], step_parts=st.step_parts[0])
    return Generated(res, st.bytes_moved, st.peak_memory, st.disk_io_mode, st.device, st.dtype, st.kv_policy_stats, formats,
                     config)


def report(s: Setup, g: Generated, extra: dict | None = None) -> dict:
    """FlexGen's summary lines and benchmark log, then the JSON (written to --output-json) with
    `extra`'s keys added (a distributed run's per-stage report)."""
    opts, spec, n, plen = s.opts, s.source.spec, len(s.prompts), s.prompt_len
    times = g.result.step_times
    prefill_lat = times[0]
    projected = bool(opts.debug_mode or opts.cut_gen_len)
    decode_lat = fmt.project_decode_latency(times, opts.gen_len) if opts.cut_gen_len else sum(times[1:])
    steps_done = opts.gen_len if opts.cut_gen_len else len(times)
    total_lat = prefill_lat + decode_lat
    # in the run's compute dtype (upstream's formula assumes float16, which it always runs in)
    cache_b, hidden_b = spec.cache_bytes(n, plen + opts.gen_len, s.dtype), spec.hidden_bytes(n, plen + opts.gen_len, s.dtype)
    tok = s.tokenizer
    texts = [tok.decode(t, skip_special_tokens=True) for t in g.result.tokens] if tok is not None else None
    if texts is not None and opts.verbose >= 2:
        show = "Outputs:\n" + 70 * "-" + "\n"
        for i in sorted({0, len(texts) - 1}):
            show += f"{i}: {texts[i]}\n" + "-" * 70 + "\n"
        print(show)
    if opts.debug_mode:
        s.say("step times (s): " + " ".join(f"{t:.4f}" for t in times))
    log = fmt.summary(spec.model_bytes(s.dtype), cache_b, hidden_b, g.memory["gpu_peak_bytes"],
                      projected, prefill_lat, n * plen / prefill_lat, decode_lat,
                      n * (steps_done - 1) / max(decode_lat, 1e-10), total_lat, n * steps_done / total_lat)
    s.say(log)
    if s.plan is not None:
        s.say(f"policy auto: predicted {s.plan.per_token_s(opts.gen_len):.4f} s/token, measured "
              f"{total_lat / opts.gen_len:.4f} s/token")
    s.say(f"peak host rss: {g.memory['host_rss_peak_bytes'] / fmt.GB:.3f} GB\t"
          f"bytes moved: " + (", ".join(f"{k} {v / fmt.GB:.3f} GB" for k, v in sorted(g.bytes_moved.items()))
                              or "none"))
    out = {
        "model": spec.name, "weights": s.source.describe(), "device": g.device, "dtype": g.dtype,
        "prompt_len": plen, "gen_len": opts.gen_len, "batch_size": n, "prompt_ids": s.prompts,
        "output_ids": g.result.tokens, "texts": texts,
        "timings": {"prefill_s": prefill_lat, "decode_s": decode_lat, "total_s": total_lat,
                    "per_token_s": times, "projected": projected,
                    "step_parts": g.result.step_parts, "decode_step_median_parts": median_parts(g.result.step_parts[1:]),
                    "decode_tokens_per_s": n * (steps_done - 1) / max(decode_lat, 1e-10)},
        "peak_memory": g.memory, "bytes_moved": g.bytes_moved, "disk_io_mode": g.disk_modes,
        "policy": dataclasses.asdict(s.policy), "engine": engine_report(s.engine), "torch": torch.__version__,
        "weight_format": g.weight_format, "resolved": g.resolved,
    }
    if s.plan is not None:
        out["auto_policy"] = {"hardware": s.hardware.name, "hardware_source": s.hardware.source,
                              **dataclasses.asdict(s.plan), "predicted_per_token_s": s.plan.per_token_s(opts.gen_len)}
    if g.kv_stats is not None:  # per-step statistics of policies that keep them (sparpr, dkv)
        out["kv_policy_stats"] = g.kv_stats
    out.update(extra or {})
    deliver(out, s.output, s.log_path, log)  # the JSON first: a failing log never loses the results
    return out


def run(argv=None, prog: str = "flexgen-sparpr run") -> dict:
    args = build_parser(prog).parse_args(argv)
    if prog == "flexgen-sparpr run":
        default_model(args)
    setup = set_up(*resolve(args))
    return report(setup, generate(setup))


def default_model(args) -> None:
    """A user's prompt with no --model, --path or --config runs the prepared SmolLM2 (resolve_source
    says in one line how to prepare it); FlexGen's benchmark (no prompt, or flex_opt) keeps opt-6.7b."""
    if args.model is None and args.path is None and args.config is None and (
            getattr(args, "prompt", None) or getattr(args, "prompt_file", None)):
        args.model = SMOLLM2


def engine_report(ecfg: EngineConfig) -> dict:
    """The engine config as JSON: each policy as its name and its fields (knobs and given costs)."""
    out = {f.name: getattr(ecfg, f.name) for f in dataclasses.fields(ecfg)}
    for key, args in (("kv_policy", "policy_args"), ("cold_codec", "codec_args")):
        p = out[key]
        if not isinstance(p, str):
            out[key], out[args] = p.name, dataclasses.asdict(p)
    return out
