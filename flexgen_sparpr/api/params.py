"""One generate() call's settings: its arguments checked as the flags they stand for are (their
types and ranges), each named as the argument it is (max_new_tokens, not --gen-len)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..config import preflight
from ..config.validate import check_range, check_stop, typed_flag_values
from ..engine.sampling import Sampler
from ..errors import ConfigError

# generate()'s arguments, by the flag each is checked as
ARGS = {"gen_len": "max_new_tokens", "do_sample": "do_sample", "temperature": "temperature", "top_p": "top_p",
        "seed": "seed", "stop": "stop"}


@dataclass(frozen=True)
class Params:
    """One call's generation settings, checked (the flags' ranges and messages)."""

    max_new: int
    stop: int | None = None  # a token id
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    logprobs: int | None = None  # LLM.batch_steps: also the top-N log-probabilities of each step (0: the chosen's)

    def sampler(self) -> Sampler:
        return Sampler(self.do_sample, self.temperature, self.top_p, self.seed)


def make_params(spec, default_seed: int, max_new_tokens, do_sample, temperature, top_p, stop, seed) -> Params:
    """Params for the model `spec` (its vocabulary, its end token); ConfigError naming the argument."""
    seed = default_seed if seed is None else seed
    if isinstance(stop, bool) or not (stop is None or isinstance(stop, (str, numbers.Integral))):
        raise ConfigError(f"stop takes a token id, 'eos' or None (got {stop!r})")
    v = typed_flag_values({"gen_len": max_new_tokens, "do_sample": do_sample, "temperature": temperature,
                           "top_p": top_p, "seed": seed, "stop": None if stop is None else str(stop)},
                          names=ARGS)
    for key in ("gen_len", "temperature", "top_p", "seed"):
        check_range(key, v[key], ARGS[key])
    if not isinstance(v["do_sample"], bool):
        raise ConfigError(f"do_sample must be True or False (got {do_sample!r})")
    check_stop(v["stop"], "stop")
    return Params(v["gen_len"], preflight.stop_token(v["stop"], spec, "stop"), v["do_sample"],
                  v["temperature"], v["top_p"], v["seed"])

