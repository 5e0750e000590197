"""The Python API: `LLM(...)` loads a model onto its placement once; `generate` runs any number
of prompts, cut into the policy's GPU batches; `stream` hands out tokens as they are decoded.

The command line is a user of this class (cli/run.py, cli/batch.py): every generation of the
package goes through `LLM._steps`, which drives the engine's one loop. `LLM(...)` takes the
flags' names (`flexgen-sparpr run --help`; a KV policy's knobs too) with the flags' types, ranges
and one-line ConfigError messages, merged as the CLI merges them: defaults < `config` YAML <
arguments. A prompt is a text or a list of token ids; outputs come back in input order.

For the benchmarks (flexgen_sparpr/bench/), which make every engine as an LLM too: `model` may be
weights already resolved (a weights/sources.py WeightSource, e.g. resolve_source's; several LLMs
share one, read or drawn once); `policy_args` sets a KV policy's fields that have no flag
(SparPR's probe_dir), as a --config file's policy_args does; and `llm.engine`, the engine one
floor below, takes these calls where the ones here do not suffice (one prefill decoded under
several KV policies, a teacher-forcing sampler: any callable logits [B, V] -> ids [B]):
prefill(prompts, max_new, sampler=None, observers=()) -> state; decode(state, stop=None) ->
result (.tokens, .step_times, .step_parts; .logits of generate(prompts, max_new, keep_logits=True));
snapshot(state) and restore(snapshot) -> a fresh state on the prefill's cache;
set_kv_policy(policy, attach=False); it reads kv_policy, tables, devices (.compute, .counters:
bytes and requests per link), disk, dtype, weight_format, cfg; runtime/trace.py's TraceRecorder
records its steps.
"""
from __future__ import annotations

import numbers
import os
import weakref

from ..config import preflight
from ..config.options import apply_auto_policy, resolve
from ..config.prompts import is_token_ids, load_tokenizer, text_ids
from ..config.validate import typed_flag_values
from ..engine.executor import Engine
from ..engine.prefix_cache import PrefixCache
from ..engine.sampling import STOP_DEFAULT
from ..errors import ConfigError
from ..utils.progress import bars_wanted
from ..weights.resolve import DUMMY, resolve_source
from ..weights.sources import WeightSource
from . import loop
from .loop import Step  # noqa: F401  (the API's Step, re-exported)
from .outputs import Output, Stats, StreamEvent, TextStream, finish
from .params import Params, make_params

# flags of one command-line run, not of a loaded model: prompts and sampling go to generate()
_PER_CALL = {"prompt": "give prompts to generate()", "prompt_file": "give prompts to generate()",
             "prompt_ids_file": "give token-id prompts to generate()",
             "do_sample": "give it to generate()", "temperature": "give it to generate()",
             "top_p": "give it to generate()", "stop": "give it to generate()",
             "cut_gen_len": "give max_new_tokens to generate()", "debug_mode": "the CLI's benchmark setting",
             "output_json": "generate() returns the outputs; last_stats holds the measurements",
             "log_file": "the CLI's FlexGen log", "no_log": "the CLI's FlexGen log", "verbose": "the CLI's output",
             "warmup": "the CLI's benchmark setting", "stream": "use stream()"}


class LLM:
    """A model loaded on its placement, ready to generate. Close it (or use `with`) to free its
    memory and remove its offload files at once; garbage collection and interpreter exit do too."""

    def __init__(self, model: "str | WeightSource", *, path=None, percent=None, gpu_batch_size=None,
                 num_gpu_batches=None, kv_policy=None, offload_dir=None, device=None, dtype=None, config=None,
                 hardware=None, policy=None, **options):
        weights = model if isinstance(model, WeightSource) else None
        if weights is None and (isinstance(model, bool) or not isinstance(model, (str, os.PathLike))
                                or not str(model).strip()):
            raise ConfigError(f"LLM() model must be a model name or a path, e.g. LLM(\"smollm2-135m\") "
                              f"(got {model!r})")
        if weights is not None and (path is not None or options.get("max_seq_len") is not None):
            raise ConfigError("LLM() takes no path or max_seq_len with weights already resolved")
        given = dict(model=model if weights is None else weights.spec.name, path=path, percent=percent,
                     gpu_batch_size=gpu_batch_size, num_gpu_batches=num_gpu_batches, kv_policy=kv_policy,
                     offload_dir=offload_dir, device=device, dtype=dtype, config=config, hardware=hardware,
                     policy=policy, **options)
        given = {k: v for k, v in given.items() if v is not None}
        for key in sorted(set(given) & set(_PER_CALL)):
            raise ConfigError(f"LLM() takes no {key!r}: {_PER_CALL[key]}")
        keep = given.pop("prefix_cache_gb", None)
        given = typed_flag_values(given)
        opts, pol, ecfg = resolve(given)
        src = weights if weights is not None else resolve_source(opts.model, opts.path, opts.max_seq_len, opts.seed)
        cap = None
        if opts.policy == "auto":  # for the workload prompt_len + gen_len (FlexGen's 512 + 32 by default)
            pol, ecfg, _, _, cap = apply_auto_policy(opts, pol, ecfg, src.spec)
        tok = load_tokenizer(src.tokenizer_dir) if DUMMY not in opts.path else None
        preflight.ready_to_load(opts, pol, ecfg, src.spec, opts.prompt_len, cap)
        self._open(opts, pol, ecfg, src, tok, given)
        if keep is not None:
            self.keep_prefixes(keep)

    @classmethod
    def loaded(cls, opts, policy, engine_config, source, tokenizer, progress: bool | None = None,
               link=None) -> "LLM":
        """An LLM on options already resolved and checked (the command line's set_up); link: a
        pipeline rank's engine/pipeline.py StageLink (its layers, micro-batches and neighbours)."""
        self = cls.__new__(cls)
        self._open(opts, policy, engine_config, source, tokenizer, None, progress, link)
        return self

    def _open(self, opts, policy, ecfg, source, tokenizer, given: dict | None, progress: bool | None = None,
              link=None) -> None:
        self.opts, self.policy, self.engine_config, self.tokenizer = opts, policy, ecfg, tokenizer
        self.spec, self._given, self.last_stats = source.spec, given, Stats()
        self._dummy = DUMMY in opts.path
        self.engine = Engine(source, policy, ecfg, progress=self._bars(progress),
                             micro_batches=link.micro_batches if link is not None else 1, link=link)
        self.prefix_cache = PrefixCache(ecfg.block_size, 0)  # off until keep_prefixes
        # GC and exit remove the offload files
        self._finalizer = weakref.finalize(self, _close, self.prefix_cache, self.engine)

    # --- lifetime ---
    def close(self) -> None:
        """Free the weights and the KV cache, and remove the offload files (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def keep_prefixes(self, gib: float | None) -> None:
        """Prefix reuse (engine/reuse.py): keep each finished one-prompt batch's KV cache, up to
        `gib` GiB on each tier (None: no bound; 0: off, the default), so that a prompt starting as
        a kept one did (a conversation's earlier turns, a shared system prompt) computes only the
        rest. llm.prefix_cache.stats counts what was reused."""
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, numbers.Real) or not gib >= 0):
            raise ConfigError(f"prefix_cache_gb must be a number of GiB >= 0 or None (got {gib!r})")
        self.prefix_cache.limit = None if gib is None else int(gib * 2 ** 30)
        self.prefix_cache.put_bound()

    @property
    def batch_size(self) -> int:
        """Sequences per engine batch (gpu_batch_size x num_gpu_batches)."""
        return self.policy.batch_size

    # --- public calls ---
    def generate(self, prompts, max_new_tokens: int = 32, *, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, stop=STOP_DEFAULT, seed: int | None = None, progress: bool | None = None) -> list[Output]:
        """Generate for one prompt or a list (texts or token-id lists): one Output per prompt, in
        input order. Prompts are sorted by length into batches of batch_size. stop: "eos" (the
        model's end token), a token id, or None; seed: the sampler's (default: the LLM's seed);
        progress: bars on stderr (default: when it is a terminal and not quiet)."""
        ids = self.encode(prompts)
        params = self.params(max_new_tokens, do_sample, temperature, top_p, stop, seed)
        rows = self.generate_ids(ids, params, progress=self._bars(progress))
        return [self._output(i, ids[i], rows[i], params) for i in range(len(ids))]

    def stream(self, prompts, max_new_tokens: int = 32, *, do_sample: bool = False, temperature: float = 1.0,
               top_p: float = 1.0, stop=STOP_DEFAULT, seed: int | None = None, progress: bool | None = None):
        """Yield a StreamEvent per new token of every prompt as it is decoded (batch by batch; in
        a batch, step by step). Same arguments and tokens as generate(); no decode bar. The
        arguments are checked at once; the engine runs as the events are taken."""
        ids = self.encode(prompts)
        params = self.params(max_new_tokens, do_sample, temperature, top_p, stop, seed)
        self._check_lengths(ids, params)
        return self._events(ids, params, self._bars(progress))

    def _events(self, ids: list[list[int]], params: Params, progress: bool):
        texts = [TextStream(self.tokenizer) for _ in ids]
        count, ended = [0] * len(ids), [False] * len(ids)
        for step in self._steps(ids, params, progress=progress, decode_bar=False):
            if step.result is not None:
                continue
            toks = step.state.tokens[-1].tolist()
            for r, i in enumerate(step.rows):
                if ended[i]:
                    continue
                t = toks[r]
                count[i] += 1
                reason = "stop" if t == params.stop else "length" if count[i] == params.max_new else None
                ended[i] = reason is not None
                yield StreamEvent(i, t, texts[i].push(t, final=ended[i]), ended[i], reason)

    def compare(self, prompts, kv_policies: dict[str, dict], max_new_tokens: int = 32, *, stop=STOP_DEFAULT,
                progress: bool | None = None) -> dict[str, tuple[list[Output], Stats]]:
        """Decode one batch of prompts greedily under this LLM's KV policy and under each of
        kv_policies (label -> flag values, e.g. {"sparpr": {"kv_policy": "sparpr", "keep_ratio":
        0.25}}) from one shared prefill: {label: (outputs, Stats of the decode)}, own policy first."""
        from .compare import compare
        return compare(self, prompts, kv_policies, max_new_tokens, stop, self._bars(progress))

    def batch_steps(self, ids: list[list[int]], params: list[Params], *, kv_policy=None, capacity: int = 0,
                    keep=None):
        """One engine batch of 1 to batch_size token-id prompts, each with its own Params (length,
        sampling, seed, logprobs; one stop token for all): a Step after the prefill and each decode
        step (step.state.sampler.logprobs[row] holds the asked log-probabilities), then one with the
        result. Closing the iterator early ends the batch there; either way the batch's KV blocks and
        offload files are freed at its end (or kept, one prompt with keep_prefixes on). kv_policy: one
        from kv_policy_for, for this batch only. capacity: tokens a kept cache has room for; keep():
        asked at the end whether to keep it (e.g. not when its client left)."""
        if not 0 < len(ids) <= self.batch_size or len(params) != len(ids) or len({p.stop for p in params}) > 1:
            raise ConfigError(f"batch_steps runs one batch: 1 to {self.batch_size} prompts, one Params each, "
                              "one stop token")
        eng, own = self.engine, self.engine.kv_policy
        if kv_policy is not None:
            eng.set_kv_policy(kv_policy, attach=False)  # the prefill attaches it to the batch's new tables
        try:
            yield from self._steps(ids, params, sort=False, capacity=capacity, keep=keep)
        finally:
            eng.set_kv_policy(own, attach=False)
            eng.free_tables()

    def kv_policy_for(self, values: dict):
        """The KV policy of flag values ({"kv_policy": "sparpr", "keep_ratio": 0.1}) made as this
        LLM made its own, for batch_steps; ConfigError when it cannot use this LLM's cache layout."""
        from .compare import policy_for
        return policy_for(self, ", ".join(f"{k}={v}" for k, v in values.items()), values)

    # --- the one path (also the command line's) ---
    def generate_ids(self, ids: list[list[int]], params: Params, *, progress: bool = False, pad_to: int = 0,
                     sort: bool = True, on_step=None) -> list[list[int]]:
        """The engine's rows of generated ids per prompt, in input order (a finished sequence's row
        runs on with the stop token); on_step(Step) sees every step."""
        if not isinstance(params, Params) or not isinstance(ids, list) or not all(
                is_token_ids(x, self.spec.vocab) for x in ids):
            raise ConfigError(f"generate_ids takes lists of token ids in [0, {self.spec.vocab}) and a Params "
                              "(llm.params(...)); generate() takes texts")
        out: list = [None] * len(ids)
        for step in self._steps(ids, params, progress=progress, pad_to=pad_to, sort=sort):
            if on_step is not None:
                on_step(step)
            if step.result is not None:
                for r, i in enumerate(step.rows):
                    out[i] = step.result.tokens[r]
        return out

    def _steps(self, ids: list[list[int]], params: Params | list[Params], **kw):
        """The one generation loop (api/loop.py): a Step after each prefill and decode step."""
        if self.closed:
            raise ConfigError("this LLM is closed: make a new one")
        self._check_lengths(ids, params, kw.get("pad_to", 0))
        return loop.steps(self, ids, params, **kw)

    # --- arguments ---
    def encode(self, prompts) -> list[list[int]]:
        """One prompt (a text or a list of token ids) or a list of them -> token-id lists, checked."""
        if self.closed:
            raise ConfigError("this LLM is closed: make a new one")
        if isinstance(prompts, str) or _is_id_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ConfigError(f"prompts must be a text, a list of token ids, or a list of those (got "
                              f"{type(prompts).__name__})")
        out, vocab = [], self.spec.vocab
        for n, p in enumerate(prompts):
            if isinstance(p, str):
                try:
                    out.append(text_ids(self.tokenizer, p, self.opts.chat, vocab, "lists of token ids"))
                except ConfigError as e:
                    raise ConfigError(f"prompt {n}: {e}") from None
                continue
            seq = [int(t) for t in p] if _is_id_list(p) else None
            if seq is None or not is_token_ids(seq, vocab):
                raise ConfigError(f"prompt {n}: give a text or a non-empty list of token ids in [0, {vocab})")
            out.append(seq)
        return out

    def params(self, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
               stop=STOP_DEFAULT, seed: int | None = None) -> Params:
        """generate()'s settings, checked as their flags are (--gen-len, --temperature, ...)."""
        return make_params(self.spec, self.opts.seed, max_new_tokens, do_sample, temperature, top_p, stop, seed)

    def _check_lengths(self, ids: list[list[int]], params: Params | list[Params], pad_to: int = 0) -> None:
        max_new = max(p.max_new for p in params) if isinstance(params, list) else params.max_new
        if ids:
            preflight.check_context(self.spec, max(pad_to, max(map(len, ids))) + max_new, self._dummy,
                                    "max_new_tokens")

    def _output(self, index: int, prompt: list[int], row: list[int], params: Params) -> Output:
        toks, reason = finish(row, params.max_new, params.stop)
        text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else None
        return Output(index, prompt, toks, text, reason)

    def _bars(self, progress: bool | None) -> bool:
        if progress is not None and not isinstance(progress, bool):
            raise ConfigError(f"progress must be True, False or None (got {progress!r})")
        return bars_wanted(self.opts.quiet) if progress is None else progress


def _close(cache: PrefixCache, engine: Engine) -> None:
    cache.close()
    engine.close()


def _is_id_list(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p)
