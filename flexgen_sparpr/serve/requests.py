"""An OpenAI request body, checked, as the work it asks for (`Request`): prompt ids, one `Params`,
stop strings and what the response must carry. Every refusal is an ApiError(400) naming its field;
fields this server does not know are ignored, as OpenAI's are."""
from __future__ import annotations

import numbers
import secrets
from dataclasses import dataclass, field

from ..api.llm import Params
from .errors import ApiError, bad

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass
class Request:
    """One request's work. max_new None: until the end token or the batch's context end."""

    kind: str  # "completion" | "chat"
    ids: list[int]
    max_new: int | None
    do_sample: bool
    temperature: float
    top_p: float
    seed: int
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top-N alternatives per token (0: the chosen token's only)
    kv: dict | None = None  # {"kv_policy": ..., "keep_ratio": ..., "min_keep_tokens": ...} when not the server's

    def params(self, max_new: int, stop: int | None) -> Params:
        return Params(max_new, stop, self.do_sample, self.temperature if self.do_sample else 1.0, self.top_p,
                      self.seed, self.logprobs)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _opt(body: dict, key: str, check, what: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise bad(f"'{key}' must be {what} (got {v!r:.60})", key)
    return v


def parse(body, kind: str, llm, model_name: str) -> Request:
    """The Request of a /v1/completions (kind "completion") or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{model_name}'", "model",
                       "model_not_found")
    _refuse_unsupported(body, kind)
    ids = _chat_ids(body, llm) if kind == "chat" else _prompt_ids(body, llm)
    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_new = _opt(body, max_key, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    limit, what = llm.spec.context_limit()
    if len(ids) + (max_new or 1) > limit:
        raise bad(f"the prompt's {len(ids)} tokens plus {max_key} {max_new or 1} exceed the model's {what} "
                  f"({limit} positions)", max_key)
    temperature = _opt(body, "temperature", lambda v: _is_num(v) and 0 <= v <= 2, "a number in [0, 2]", 1.0)
    top_p = _opt(body, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    seed = _opt(body, "seed", lambda v: _is_int(v) and 0 <= v < 2 ** 63, "an integer >= 0", None)
    stops = _stops(body)
    stream = _opt(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be true or false", "stream_options")
    _opt(body, "user", lambda v: isinstance(v, str), "a string")
    return Request(kind, ids, max_new, temperature > 0, float(temperature), float(top_p),
                   int(seed) if seed is not None else secrets.randbits(62), stops, stream, include_usage,
                   _logprobs(body, kind), _kv(body, llm))


def _refuse_unsupported(body: dict, kind: str) -> None:
    """Fields that would change the answer in ways this engine does not do: a clear 400, not a
    silent difference."""
    n = _opt(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise bad(f"'n' must be 1 here (one choice per request; got {n}): send n requests instead", "n")
    if kind == "completion" and body.get("echo"):
        raise bad("'echo' is not supported", "echo")
    if _opt(body, "best_of", _is_int, "an integer", 1) != 1:
        raise bad("'best_of' must be 1 here", "best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        if _opt(body, key, _is_num, "a number", 0) != 0:
            raise bad(f"'{key}' is not supported (only 0)", key)
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias")
    if body.get("tools") or body.get("functions"):
        raise bad("tools and functions are not supported", "tools")
    if kind == "completion" and body.get("suffix"):
        raise bad("'suffix' is not supported", "suffix")


def _prompt_ids(body: dict, llm) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    vocab = llm.spec.vocab
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        if not all(0 <= t < vocab for t in p):
            raise bad(f"'prompt' token ids must lie in [0, {vocab})", "prompt")
        return [int(t) for t in p]
    if isinstance(p, list) and len(p) > 1:
        raise bad("one prompt per request here (got a list of several): send one request each", "prompt")
    if not isinstance(p, str):
        raise bad("'prompt' must be a string or a list of token ids", "prompt")
    if llm.tokenizer is None:
        raise bad("this model has no tokenizer: give 'prompt' as a list of token ids", "prompt")
    ids = llm.tokenizer(p)["input_ids"]
    if not ids:
        raise bad("'prompt' is empty: it encodes to no tokens", "prompt")
    return list(ids)


def _chat_ids(body: dict, llm) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # parts: only text ones
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": m["role"], "content": content})
    tok = llm.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        out = tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # a template that refuses a role order raises its own errors
        raise bad(f"the chat template refused these messages ({type(e).__name__}: {e})", "messages") from None
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise bad("'stop' must be a non-empty string or a list of up to 16 of them", "stop")
    return stops


def _logprobs(body: dict, kind: str) -> int | None:
    if kind == "chat":
        if not _opt(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False):
            if body.get("top_logprobs") is not None:
                raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return _opt(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                    f"an integer in [0, {MAX_LOGPROBS}]", 0)
    return _opt(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                f"an integer in [0, {MAX_LOGPROBS}]")


def _kv(body: dict, llm) -> dict | None:
    """The per-request KV policy (extra body fields), or None when it is the server's own."""
    name = _opt(body, "kv_policy", lambda v: isinstance(v, str), "a policy name")
    ratio = _opt(body, "keep_ratio", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]")
    floor = _opt(body, "min_keep_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    if name is None and ratio is None and floor is None:
        return None
    own = llm.engine.kv_policy
    values = {"kv_policy": name or own.name}
    if ratio is not None:
        values["keep_ratio"] = float(ratio)
    if floor is not None:
        values["min_keep_tokens"] = int(floor)
    same = all(v is None or v == getattr(own, k, None) for k, v in (("keep_ratio", ratio), ("min_keep_tokens", floor)))
    return None if values["kv_policy"] == own.name and same else values
