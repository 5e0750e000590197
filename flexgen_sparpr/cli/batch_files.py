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
from ..config.preflight import check_context
from ..config.prompts import is_token_ids, text_ids

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


OUTPUT_KEYS = ("id", "token_ids", "text", "finish_reason")  # an output line's keys, in the order written
_HEAD = b'{"id": '


def is_output_record(rec) -> bool:
    """An output line as a batch job writes it: exactly its keys, each of its type."""
    return (isinstance(rec, dict) and tuple(rec) == OUTPUT_KEYS and isinstance(rec["id"], (str, int))
            and not isinstance(rec["id"], bool) and isinstance(rec["token_ids"], list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in rec["token_ids"])
            and (rec["text"] is None or isinstance(rec["text"], str)) and isinstance(rec["finish_reason"], str))


def _is_our_partial(tail: bytes, after_records: bool) -> bool:
    """A last line without its newline that a kill mid-write of an output line left: the start of
    `{"id": ID, "token_ids": [...`. Cut inside the id, it is taken as ours only after lines that are."""
    if not tail.startswith(_HEAD):
        return after_records and _HEAD.startswith(tail)
    rest = tail[len(_HEAD):].decode("utf-8", "replace")
    try:
        rid, end = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return after_records
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        return False
    after, key = rest[end:], ', "token_ids": ['
    return key.startswith(after) or after.startswith(key)


def same_file(a, b) -> bool:
    """Whether two paths name one file (through links too); False when either does not exist."""
    try:
        return os.path.samefile(Path(a).expanduser(), Path(b).expanduser())
    except OSError:
        return False


def read_done(path: Path, known: set) -> set:
    """The ids already in the output. Every line must be an output line of this job (a batch
    job's record whose id is in the input, once): anything else is a ConfigError naming it, and
    the file is left as it is. Only then is a last line that a kill cut short (no newline, the
    start of an output line) removed from the file."""
    if not path.exists():
        return set()
    if not path.is_file():  # a FIFO or a device would block, or swallow, what is read back
        raise ConfigError(f"--output {path} is not a regular file: give a file path")
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    done = set()
    for n, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            rec = None
        rid = rec["id"] if is_output_record(rec) else None
        why = ("is not an output line of a batch job" if rid is None
               else f"has id {rid!r}, which is not in --input" if rid not in known
               else f"repeats id {rid!r}" if rid in done else None)
        if why:
            raise ConfigError(f"--output {path} line {n} {why} (the file is left as it is): give another --output, "
                              "or remove the file to start over")
        done.add(rid)
    tail = data[end:]
    if tail.strip():
        if not _is_our_partial(tail, bool(done)):
            raise ConfigError(f"--output {path}: its last line (no newline) is not an output line of a batch job "
                              "(the file is left as it is): give another --output, or remove the file to start over")
        with open(path, "r+b") as f:
            f.truncate(end)
        print(f"note: removed a partly written last line from --output {path} (its prompt runs again)",
              file=sys.stderr, flush=True)
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
    synced to disk together, stop signals held off meanwhile. A file (or folder) it made and
    wrote nothing to is removed on close: a failed job leaves nothing it created."""

    def __init__(self, path: Path):
        self.path, self.made = path, []
        missing = path.parent
        while not missing.exists() and missing != missing.parent:
            self.made.append(missing)
            missing = missing.parent
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o666)
            self.made.insert(0, path)
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.f = os.fdopen(fd, "a", encoding="utf-8")
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
        if self.written == 0:
            for p in self.made:  # the file first, then the folders made for it, innermost first
                try:
                    p.unlink() if p == self.path else p.rmdir()
                except OSError:
                    break

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
