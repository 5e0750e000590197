"""A long conversation against a live `flexgen-sparpr serve`: a document of about N tokens in the
first user turn, then short questions, each request carrying the whole conversation so far (as an
OpenAI client does), streamed, greedy. Per turn: prompt tokens, time to first token, total time,
the prompt tokens the server's prefix cache reused (its /metrics), and the answer."""
from __future__ import annotations

import http.client
import json
import time
from dataclasses import asdict, dataclass

QUESTIONS = ("What is this document about?", "Who does it protect?", "What may a user do with a copy?",
             "What must a distributor give along with the program?", "What does it say about warranty?",
             "Can the terms be changed later?", "What happens if the terms are broken?",
             "Name one obligation it puts on people who modify the work.", "Summarise it in one sentence.",
             "Thank you. Anything else to know?")


@dataclass
class TurnResult:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float
    latency_s: float
    answer_tokens: int
    answer: str


def metric(port: int, name: str) -> float:
    """The sum of a metric's samples named exactly `name`, from /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def chat_turn(port: int, messages: list[dict], max_tokens: int) -> tuple[str, int, int, float, float]:
    """One streamed greedy chat completion: (answer, prompt tokens, answer tokens, ttft s, latency s)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"chat turn got HTTP {r.status}: {r.read()[:300]!r}")
    ttft, pieces, usage = None, [], {}
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices", []):
            if c["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                pieces.append(c["delta"]["content"])
    latency = time.perf_counter() - t0
    conn.close()
    return "".join(pieces), usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), ttft or latency, latency


def converse(port: int, document: str, turns: int, max_tokens: int) -> list[TurnResult]:
    """`turns` turns (the document with the first question, then one question each)."""
    messages, out = [], []
    for i in range(turns):
        q = QUESTIONS[i % len(QUESTIONS)]
        messages.append({"role": "user", "content": f"Read this document.\n\n{document}\n\n{q}" if i == 0 else q})
        hit0 = metric(port, 'flexgen_sparpr_prefix_cache_tokens_total{kind="hit"}')
        answer, ptok, atok, ttft, latency = chat_turn(port, messages, max_tokens)
        end = time.monotonic() + 30  # the server counts a batch just after its answer went out
        while metric(port, "flexgen_sparpr_batches_total") < i + 1 and time.monotonic() < end:
            time.sleep(0.05)
        reused = int(metric(port, 'flexgen_sparpr_prefix_cache_tokens_total{kind="hit"}') - hit0)
        out.append(TurnResult(i + 1, ptok, reused, ttft, latency, atok, answer))
        messages.append({"role": "assistant", "content": answer})
    return out


def as_rows(turns: list[TurnResult]) -> list[dict]:
    return [asdict(t) for t in turns]
