"""What the ranks of a distributed run tell each other through the rendezvous store: their
options (a run whose ranks disagree stops at once), what the last one measured (for rank 0's
report), and who failed first.

When a rank fails on its own (a bad file, out of memory, a signal, a bug) it records itself in
the store before it exits, so the ranks that then lose their link to it (or to a rank that gave
up because of it) name it; a rank killed outright records nothing, and the first rank to lose its
link to it names it. Every rank that stops because another failed removes its own offload files
on the way out (the engine's clean-up) and those of ranks that died on this host
(storage/leftovers.py).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ..engine.pipeline import LinkFailed
from ..errors import ConfigError, PeerFailed
from ..storage.leftovers import sweep_dead_runs
from ..utils.guard import Interrupted, describe

FAILED = "failed"
GRACE_S = 1.0  # how long a rank that lost a link waits for the failed rank's own record


def options_digest(blob: dict) -> str:
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k} ({x!r} vs {y!r})")
    return out


def _link_failure(e: BaseException | None) -> LinkFailed | None:
    """The LinkFailed that e is, or that e interrupted (a signal arriving while one unwound)."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, LinkFailed):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


class Peers:
    """This rank's view of the others, over the rendezvous store."""

    def __init__(self, store, rank: int, world_size: int, timeout: float, store_host: str):
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.store_host = store_host  # who keeps the store (rank 0, or the launcher)

    # --- start-up ---
    def check_same_options(self, blob: dict) -> None:
        """Every rank resolved the same options (rank-specific ones left out); ConfigError naming
        the first rank that differs and how, on every rank."""
        text = json.dumps(blob, sort_keys=True, default=str)
        self.store.set(f"options/{self.rank}", text)
        blob = json.loads(text)  # compared as the others' are read back (tuples become lists)
        mine = options_digest(blob)
        for r in range(self.world_size):
            try:
                theirs = json.loads(self.store.get(f"options/{r}"))
            except RuntimeError as e:
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise  # the store's host is gone: explain() names it
                raise ConfigError(f"rank {r} did not report its options within {self.timeout:g} s (did it start? "
                                  "see its error line)") from None
            if options_digest(theirs) != mine:
                ref, other = (theirs, blob) if r < self.rank else (blob, theirs)
                lo, hi = sorted((r, self.rank))
                diff = "; ".join(_differences(ref, other)[:4])
                raise ConfigError(f"the ranks were launched with different options: rank {hi} differs from rank {lo} "
                                  f"in {diff} (give every rank the same flags)")

    def share(self, key: str, value: dict | None = None) -> dict:
        """Rank 0 publishes value under key; every rank returns it."""
        if self.rank == 0:
            self.store.set(f"share/{key}", json.dumps(value, default=str))
        return json.loads(self.store.get(f"share/{key}"))

    def gather(self, key: str, value: dict) -> list[dict] | None:
        """Every rank's value on rank 0 (in rank order); None elsewhere."""
        self.store.set(f"gather/{key}/{self.rank}", json.dumps(value, default=str))
        if self.rank != 0:
            return None
        return [json.loads(self.store.get(f"gather/{key}/{r}")) for r in range(self.world_size)]

    def ready(self, problem: str | None) -> None:
        """Say whether this rank passed its checks before loading (problem: why not, None when it
        did); when it did, wait for every other rank's word and raise ConfigError naming the first
        that did not: no rank loads weights that another's refusal would strand (ranks sharing a
        host each refuse their share of it at once)."""
        self.store.set(f"ready/{self.rank}", json.dumps({"problem": problem}))
        if problem is not None:
            return  # this rank's own error follows
        for r in range(self.world_size):
            theirs = json.loads(self.store.get(f"ready/{r}"))["problem"] if r != self.rank else None
            if theirs is not None:
                raise ConfigError(f"rank {r} cannot run ({theirs}); no rank loaded anything")

    def leave(self, failed: bool, linger: float = 3.0) -> None:
        """Say this rank is done with the store; the rank hosting it (rank 0) waits, after a failure,
        up to `linger` s for the others to be done, so they still read what it wrote (its options,
        its failure) instead of finding the store gone."""
        try:
            self.store.set(f"left/{self.rank}", "1")
            if not (failed and self.rank == 0 and self.store_host == "rank 0"):
                return
            end = time.monotonic() + min(linger, self.timeout)
            while time.monotonic() < end and not self.store.check([f"left/{r}" for r in range(self.world_size)]):
                time.sleep(0.05)
        except (RuntimeError, ValueError):
            pass

    # --- failures ---
    def _record(self, rank: int, why: str) -> dict:
        """Record (rank, why) as the run's first failure unless one is there; the first one."""
        mine = json.dumps({"rank": rank, "why": why})
        try:
            return json.loads(self.store.compare_set(FAILED, "", mine))
        except (RuntimeError, ValueError):  # the store is gone with its host
            return {"rank": rank, "why": why}

    def _silent(self, guess: int) -> int:
        """The rank that went silent: every rank that loses a link marks itself at once, so after
        the grace the one that marked nothing (and did not leave) is the dead one; `guess` (the
        peer this rank waited on) when it is among them or none can be told apart."""
        try:
            quiet = [r for r in range(self.world_size) if r != self.rank
                     and not self.store.check([f"lost/{r}"]) and not self.store.check([f"left/{r}"])]
        except (RuntimeError, ValueError):
            return guess
        return guess if guess in quiet or not quiet else quiet[0]

    def _recorded(self, wait: float) -> dict | None:
        end = time.monotonic() + wait
        while True:
            try:
                if self.store.check([FAILED]):
                    return json.loads(self.store.get(FAILED))
            except (RuntimeError, ValueError):
                return None
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def explain(self, e: BaseException, offload_dir: str | None) -> BaseException:
        """What this rank's failure e should say: its own failures are recorded for the others and
        returned as they are; a lost link (or a signal that interrupted one) becomes PeerFailed
        naming the rank that failed first."""
        lost = _link_failure(e)
        if lost is None and isinstance(e, RuntimeError) and type(e).__name__ in ("DistStoreError", "DistNetworkError"):
            lost = LinkFailed(0, "the rendezvous store", e)  # its host is gone
        if lost is None:
            if isinstance(e, Interrupted) and (rec := self._recorded(0)) and rec["rank"] != self.rank:
                return PeerFailed(f"rank {rec['rank']} failed ({rec['why']}); this rank was stopped by {e.name}, "
                                  "its offload files removed")
            self._record(self.rank, describe(e)[1])
            return e
        try:
            self.store.set(f"lost/{self.rank}", "1")  # alive, and lost a link: not the one that died
        except (RuntimeError, ValueError):
            pass
        rec = self._recorded(GRACE_S)
        if rec is None:
            timed_out = "timed out" in str(lost).lower() or "timeout" in str(lost).lower()
            why = f"no answer within {self.timeout:g} s (--dist-timeout)" if timed_out else \
                "it exited or died: its connection closed"
            if lost.what == "the rendezvous store":
                why = f"the rendezvous store on {self.store_host} stopped answering"
            rec = self._record(lost.peer if lost.what == "the rendezvous store" else self._silent(lost.peer), why)
        if offload_dir:
            sweep_dead_runs(Path(offload_dir).expanduser())
        return PeerFailed(f"rank {rec['rank']} failed ({rec['why']}); this rank stopped, its offload files removed")
