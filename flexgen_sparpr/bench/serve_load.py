"""Load on a live `flexgen-sparpr serve`: N concurrent clients, each sending streamed completions
of mixed prompt lengths back to back for a fixed time, over plain HTTP on loopback.

Every request ends in exactly one outcome (answered, refused with 429, other error), counted by
the client and checked against the server's own /metrics count of the same requests: a request
lost or answered twice shows as a difference. A 429 is followed by a short back-off."""
from __future__ import annotations

import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .texts import TEXTS

TEXT = TEXTS["alice29"].path  # the demo's text (tuning split: bench/texts.py)
BACKOFF_S = 0.5


@dataclass
class Outcome:
    status: int  # HTTP status (0: the connection failed)
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0
    response_id: str | None = None


@dataclass
class Level:
    """What one concurrency level measured."""

    clients: int
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    server_counted: int = 0  # the server's /metrics requests of this level

    def summary(self) -> dict:
        ok = [o for o in self.outcomes if o.status == 200]
        ids = [o.response_id for o in ok]
        by_status: dict[str, int] = {}
        for o in self.outcomes:
            by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
        return {"clients": self.clients, "seconds": round(self.seconds, 2), "requests": len(self.outcomes),
                "answered": len(ok), "by_status": by_status,
                "errors_other_than_429": sum(n for s, n in by_status.items() if s not in ("200", "429")),
                "req_per_s": len(ok) / self.seconds, "tokens_per_s": sum(o.tokens for o in ok) / self.seconds,
                "ttft_p50_s": pct([o.ttft_s for o in ok], 50), "ttft_p99_s": pct([o.ttft_s for o in ok], 99),
                "latency_p50_s": pct([o.latency_s for o in ok], 50),
                "latency_p99_s": pct([o.latency_s for o in ok], 99),
                "duplicate_answers": len(ids) - len(set(ids)),
                "server_counted": self.server_counted, "lost": len(self.outcomes) - self.server_counted}


def pct(values: list, q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, int(q) - 1))]


def mixed_prompts(lengths: list[int], n: int, seed: int) -> list[str]:
    """n slices of Alice in Wonderland, each of one of `lengths` characters, from random starts."""
    text = " ".join(TEXT.read_text().split())
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = lengths[i % len(lengths)]
        start = rng.randrange(0, len(text) - size)
        out.append(text[start:start + size])
    return out


def one_request(port: int, prompt: str, max_tokens: int, key: str | None) -> Outcome:
    """A streamed completion: time to its first token and to [DONE], its token count."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        r = conn.getresponse()
        if r.status != 200:
            r.read()
            return Outcome(r.status)
        out = Outcome(200)
        while True:
            line = r.readline()
            if not line:
                return Outcome(0)  # the stream ended without [DONE]
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out.latency_s = time.perf_counter() - t0
                return out
            chunk = json.loads(data)
            if "error" in chunk:
                return Outcome(chunk["error"].get("code") == "queue_full" and 429 or 500)
            out.response_id = chunk["id"]
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
            elif out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0
    except OSError:
        return Outcome(0)
    finally:
        conn.close()


def served_requests(port: int) -> int:
    """The server's count of /v1/completions requests, every status."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('flexgen_sparpr_requests_total{endpoint="/v1/completions"')))


def run_level(port: int, clients: int, seconds: float, prompts: list[str], max_tokens: int,
              key: str | None = None) -> Level:
    """`clients` threads sending back to back until `seconds` pass; the requests in flight then
    run to their end (so none is lost); level.seconds is the whole span."""
    level, lock = Level(clients, 0.0), threading.Lock()
    before = served_requests(port)
    t0 = time.perf_counter()
    end = t0 + seconds

    def client(c: int) -> None:
        n = 0
        while time.perf_counter() < end:
            o = one_request(port, prompts[(c * 7919 + n) % len(prompts)], max_tokens, key)
            n += 1
            with lock:
                level.outcomes.append(o)
            if o.status == 429:
                time.sleep(BACKOFF_S)
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.seconds = time.perf_counter() - t0
    level.server_counted = served_requests(port) - before
    return level


def server_config(port: int) -> dict | None:
    """The configuration the server's engine resolved (its /health "resolved"; api/resolved.py)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return json.loads(r.read()).get("resolved")


def start_server(flags: list[str], cwd: Path, timeout: float) -> tuple[subprocess.Popen, int]:
    """A `flexgen-sparpr serve` child on a free port, once /health says the model is loaded;
    RuntimeError (one line) when it does not start or load."""
    proc = subprocess.Popen([sys.executable, "-m", "flexgen_sparpr", "serve", "--port", "0", *flags], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line.strip() or 'no output'}")
    port = int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while loading")
    proc.kill()
    raise RuntimeError("the model did not load in time")
