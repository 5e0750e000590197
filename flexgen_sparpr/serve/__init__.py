"""`flexgen-sparpr serve`: the engine behind an OpenAI-compatible HTTP API (a third face beside
cli/ and api/, over the same `LLM`): request parsing, the batcher that groups requests into the
engine's batches, the OpenAI response shapes, Prometheus metrics and a small chat page."""
