"""The batch job's files: the input (JSONL prompts, every line checked before any work) and the
output it appends to, read back on a restart (the ids already done; a last line a kill cut short
is removed), and written a whole batch at a time."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .preflight import check_context
from .prompts import is_token_ids, text_ids

_KEYS = {"id", "prompt", "prompt_ids", "max_new_tokens"}


@dataclass(frozen=True)
class Job:
    """One input line: its id, its prompt as token ids, and how many tokens to generate."""

    line: int
    id: str | int
    ids: list[int]
    max_new: int


def read_input(path: str, tokenizer, spec, chat: bool, max_new: int, skip_bad: bool, dummy: bool) -> list[Job]:
    """Every prompt of the input file, checked: one ConfigError naming the first bad line, or with
    skip_bad a `note:` line per bad line on stderr and the good ones. Blank lines are allowed."""
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"--input {path}: {e.strerror}") from None
    jobs, first_line = [], {}
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            job = _job(n, raw, tokenizer, spec, chat, max_new, dummy)
            if job.id in first_line:
                raise ConfigError(f"duplicate id {job.id!r} (first on line {first_line[job.id]})")
        except ConfigError as e:
            msg = f"--input {path} line {n}: {e}"
            if not skip_bad:
                raise ConfigError(msg + " (or --skip-bad to leave such lines out)") from None
            print(f"note: skipped {msg}", file=sys.stderr, flush=True)
            continue
        first_line[job.id] = n
        jobs.append(job)
    if not jobs:
        raise ConfigError(f"--input {path} holds no prompts")
    return jobs


def _job(n: int, raw: bytes, tokenizer, spec, chat: bool, max_new: int, dummy: bool) -> Job:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise ConfigError('expected an object like {"id": "a", "prompt": "text"}')
    if "id" not in rec:
        raise ConfigError('no "id"')
    if not isinstance(rec["id"], (str, int)) or isinstance(rec["id"], bool):
        raise ConfigError(f'"id" must be a string or an integer (got {rec["id"]!r})')
    unknown = set(rec) - _KEYS
    if unknown:
        raise ConfigError(f"unknown keys {', '.join(sorted(unknown))} (known: {', '.join(sorted(_KEYS))})")
    if ("prompt" in rec) == ("prompt_ids" in rec):
        raise ConfigError('give "prompt" (a text) or "prompt_ids" (token ids), one of them')
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ConfigError('"prompt" must be a text')
        ids = text_ids(tokenizer, rec["prompt"], chat, spec.vocab, '"prompt_ids"')
    else:
        ids = rec["prompt_ids"]
        if not is_token_ids(ids, spec.vocab):
            raise ConfigError(f'"prompt_ids" must be a non-empty list of token ids in [0, {spec.vocab})')
    m = rec.get("max_new_tokens", max_new)
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ConfigError(f'"max_new_tokens" must be an integer >= 1 (got {m!r})')
    check_context(spec, len(ids) + m, dummy)
    return Job(n, rec["id"], list(ids), m)


def read_done(path: Path, known: set) -> set:
    """The ids already in the output. A last line without its newline (a kill mid-write) is cut
    off the file; a line that is not this job's (bad JSON, no id, an id not in the input, an id
    twice) is a ConfigError naming it."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
        print(f"note: removed a partly written last line from --output {path} (its prompt runs again)",
              file=sys.stderr, flush=True)
    done = set()
    for n, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            rid = json.loads(raw.decode("utf-8"))["id"]
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError):
            rid = None
        why = ("is not an output line of this job" if rid is None or isinstance(rid, (list, dict))
               else f"has id {rid!r}, which is not in --input" if rid not in known
               else f"repeats id {rid!r}" if rid in done else None)
        if why:
            raise ConfigError(f"--output {path} line {n} {why}: give another --output, or remove the file to start over")
        done.add(rid)
    return done


@contextmanager
def _signals_held():
    """Stop signals wait until the block is done, then arrive, so a batch's lines land whole.
    Python runs signal handlers in the main thread whichever thread the OS picked, so holding
    them there works where a signal mask (per thread) would not."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    sigs = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)]
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            handler = old[got[0]]
            if callable(handler):
                handler(got[0], None)
            else:  # the default action (or ignored): as if it came now
                os.kill(os.getpid(), got[0])


class Appender:
    """The output file, appended to a batch at a time: each batch's lines written, flushed and
    synced to disk together, stop signals held off meanwhile."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", encoding="utf-8")
        self.written = 0  # lines this run wrote

    def write(self, records: list[dict]) -> None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with _signals_held():
            self.f.write(text)
            self.f.flush()
            os.fsync(self.f.fileno())
            self.written += len(records)

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
