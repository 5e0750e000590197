"""The server's Prometheus metrics, in their own registry (GET /metrics): requests by status,
tokens, time to first token, latency, decode speed, the queue, and per batch what the engine's
stats expose (bytes moved per link, KV blocks read vs cached, peak memory per tier)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "flexgen_sparpr_"
_TIMES = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(P + "requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.cancelled = Counter(P + "requests_cancelled", "Requests whose client left before the end", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(P + "generation_tokens", "Tokens generated for requests", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token", buckets=_TIMES,
                              registry=r)
        self.latency = Histogram(P + "request_latency_seconds", "Arrival to last token", buckets=_TIMES, registry=r)
        self.decode_rate = Gauge(P + "decode_tokens_per_second", "Decode tokens per second of the last batch "
                                 "(all its requests)", registry=r)
        self.queue = Gauge(P + "queue_depth", "Requests waiting for a batch", registry=r)
        self.running = Gauge(P + "running_requests", "Requests in the batch in flight", registry=r)
        self.batches = Counter(P + "batches", "Engine batches run", registry=r)
        self.batch_rows = Histogram(P + "batch_requests", "Requests per engine batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.bytes_moved = Counter(P + "bytes_moved", "Bytes moved between tiers, per link", ["link"], registry=r)
        self.kv_blocks = Counter(P + "kv_blocks", "KV blocks over the decode cells: read by attention (selected) "
                                 "and cached (total)", ["kind"], registry=r)
        self.peak_memory = Gauge(P + "peak_memory_bytes", "Peak memory per tier over the batches so far", ["tier"],
                                 registry=r)
        self._peaks: dict[str, int] = {}
        self.loaded = Gauge(P + "model_loaded", "1 once the model is loaded", registry=r)
        self.prefix_tokens = Counter(P + "prefix_cache_tokens", "Prompt tokens of one-request batches: reused from "
                                     "a kept cache (hit) or computed (computed)", ["kind"], registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "One-request batches that went on from a kept cache",
                                   registry=r)
        self.prefix_read = Counter(P + "prefix_cache_read_bytes", "Bytes moved off the CPU and disk tiers while "
                                   "prefilling onto kept caches", registry=r)
        self.prefix_evictions = Counter(P + "prefix_cache_evictions", "Kept caches let go (least recently used "
                                        "first, past --prefix-cache-gb on a tier)", registry=r)
        self.prefix_held = Gauge(P + "prefix_cache_bytes", "Bytes the kept caches hold, per tier", ["tier"],
                                 registry=r)
        self._prefix_seen = None

    def on_batch(self, tickets, stats, info, prefix=None) -> None:
        self.batches.inc()
        self.batch_rows.observe(len(tickets))
        if info["decode_tokens_per_s"] is not None:
            self.decode_rate.set(info["decode_tokens_per_s"])
        for link, n in stats.bytes_moved.items():
            self.bytes_moved.labels(link).inc(n)
        selected, total = stats.kv_blocks_read
        self.kv_blocks.labels("selected").inc(selected)
        self.kv_blocks.labels("total").inc(total)
        for tier, key in (("host", "host_rss_peak_bytes"), ("gpu", "gpu_peak_bytes")):
            value = stats.peak_memory.get(key)
            if value is not None:
                self._peaks[tier] = max(self._peaks.get(tier, 0), value)
                self.peak_memory.labels(tier).set(self._peaks[tier])
        if prefix is not None:
            self._on_prefix(prefix)

    def _on_prefix(self, prefix) -> None:
        """The prefix cache's counts since the last batch (they only grow), and its bytes now."""
        now, seen = prefix["stats"], self._prefix_seen
        for metric, field in ((self.prefix_tokens.labels("hit"), "hit_tokens"),
                              (self.prefix_tokens.labels("computed"), "computed_tokens"),
                              (self.prefix_hits, "hits"), (self.prefix_read, "reuse_read_bytes"),
                              (self.prefix_evictions, "evictions")):
            metric.inc(getattr(now, field) - (getattr(seen, field) if seen is not None else 0))
        self._prefix_seen = now
        for tier, n in prefix["held"].items():
            self.prefix_held.labels(tier.name.lower()).set(n)

    def on_answer(self, ticket, end: float) -> None:
        """A request that ended (answered or cancelled)."""
        if ticket.cancelled:
            self.cancelled.inc()
        if ticket.answer is None:
            return
        self.prompt_tokens.inc(len(ticket.req.ids))
        self.generated_tokens.inc(len(ticket.answer.token_ids))
        if ticket.first_token_at is not None:
            self.ttft.observe(ticket.first_token_at - ticket.arrived)
        if not ticket.cancelled:
            self.latency.observe(end - ticket.arrived)

    def text(self) -> bytes:
        return generate_latest(self.registry)
