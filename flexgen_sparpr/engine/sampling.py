"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# where a generation ends unless told otherwise: the model's end token, for a user's prompts in
# `run`, `batch`, `chat`, `serve` and the Python API alike (FlexGen's benchmark prompt: none, so it
# generates --gen-len tokens); "none" asks for no stop token
STOP_DEFAULT = "eos"


@dataclass
class Sampler:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature > 0) or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be a finite number > 0 and top_p in (0, 1]")
        self._gen = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] -> token ids: [B]."""
        if not self.do_sample:
            return logits.argmax(-1)
        if self._gen is None or self._gen.device != logits.device:
            self._gen = torch.Generator(device=logits.device).manual_seed(self.seed)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sp, si = probs.sort(dim=-1, descending=True, stable=True)  # ties (common in fp16) keep id order
            keep = sp.cumsum(-1) - sp < self.top_p  # always keeps the top token
            sp = sp * keep
            choice = torch.multinomial(sp / sp.sum(-1, keepdim=True), 1, generator=self._gen)
            return si.gather(-1, choice)[:, 0]
        return torch.multinomial(probs, 1, generator=self._gen)[:, 0]


class RowSampler:
    """A batch whose rows choose differently (a server's requests): row r uses samplers[r], with
    its own random stream, so a request's draws never depend on its neighbours; greedy rows share
    one argmax. top_logprobs[r] (None: not wanted) asks for row r's log-probabilities under the
    model (before temperature): `logprobs[r]` gets, per step, (the chosen token's, [(id, logprob)]
    of the top_logprobs[r] likeliest)."""

    def __init__(self, samplers: list[Sampler], top_logprobs: list[int | None] | None = None):
        self.samplers = samplers
        self.top_logprobs = top_logprobs or [None] * len(samplers)
        self.sampled = [r for r, s in enumerate(samplers) if s.do_sample]
        self.want = [r for r, n in enumerate(self.top_logprobs) if n is not None]
        self.logprobs: list[list] = [[] for _ in samplers]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] -> token ids: [B]."""
        out = logits.argmax(-1)  # out: [B]
        for r in self.sampled:  # one generator per request: its seed alone decides its draws
            out[r] = self.samplers[r](logits[r:r + 1])[0]
        if self.want:
            lp = torch.log_softmax(logits[self.want].float(), dim=-1)  # lp: [W, V]
            chosen = lp.gather(-1, out[self.want][:, None])[:, 0].tolist()  # [W]
            k = max(self.top_logprobs[r] for r in self.want)
            top_v, top_i = lp.topk(max(k, 1), dim=-1)  # [W, k]
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for j, r in enumerate(self.want):
                n = self.top_logprobs[r]
                self.logprobs[r].append((chosen[j], list(zip(top_i[j][:n], top_v[j][:n]))))
        return out
