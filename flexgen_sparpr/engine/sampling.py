"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
