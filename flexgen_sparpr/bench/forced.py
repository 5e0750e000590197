"""Teacher forcing through the engine's one generation loop: a sampler that returns given tokens.

The engine asks its sampler for each step's next token (`st.sampler(logits)`), so a sampler that
answers with the text's true next token turns a decode into a teacher-forced one, with every KV
policy reading its keep of the cache at every step, and no second loop. It scores the forced
tokens as it goes (log-probability, and whether greedy would have picked them). After the forced
tokens it falls back to greedy, which lets a prompt go on past its prefill (the late question)
and then be answered.
"""
from __future__ import annotations

import torch


def greedy() -> "ForcedTokens":
    """A sampler that forces nothing: greedy from its first call (logits.argmax(-1), the engine's
    own greedy choice), what a sweep's rows without forced tokens decode with."""
    return ForcedTokens(torch.zeros(1, 0, dtype=torch.long))


class ForcedTokens:
    """forced: [B, T] token ids, forced at the first T calls; later calls are greedy.

    After a run, `nll` is [B, T'] (T' <= T calls made while forcing) float64: -log p(forced token),
    and `top1` [B, T'] bool: whether it was the argmax. `skip` first calls are forced but not
    scored (the prefill's own step, which is dense for every policy)."""

    def __init__(self, forced: torch.Tensor | list[list[int]], skip: int = 0):
        self.forced = torch.as_tensor(forced, dtype=torch.long)  # forced: [B, T]
        if self.forced.dim() != 2:
            raise ValueError("forced tokens must be [batch, steps]")
        self.skip, self.calls = skip, 0
        self._nll: list[torch.Tensor] = []
        self._top1: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] -> token ids: [B]."""
        i = self.calls
        self.calls += 1
        if i >= self.forced.shape[1]:
            return logits.argmax(-1)
        want = self.forced[:, i].to(logits.device)  # want: [B]
        if i >= self.skip:
            logp = torch.log_softmax(logits.double(), dim=-1)  # logp: [B, V]
            self._nll.append(-logp.gather(1, want[:, None])[:, 0].cpu())
            self._top1.append((logits.argmax(-1) == want).cpu())
        return want

    @property
    def nll(self) -> torch.Tensor:
        return torch.stack(self._nll, dim=1) if self._nll else torch.zeros(self.forced.shape[0], 0,
                                                                            dtype=torch.float64)

    @property
    def top1(self) -> torch.Tensor:
        return torch.stack(self._top1, dim=1) if self._top1 else torch.zeros(self.forced.shape[0], 0,
                                                                              dtype=torch.bool)
