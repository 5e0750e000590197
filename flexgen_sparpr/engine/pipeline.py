"""A pipeline stage's boundary: which layers this rank runs, and what crosses to its neighbours.

Every rank runs the one generation loop (executor.py) over its contiguous slice of layers. The
GPU batches of a step are grouped into micro-batches; at a micro-batch's first cell a stage that
is not the first takes its input hidden states from `receive`, at its last cell a stage that is
not the last hands its output to `send` (asynchronous: the next micro-batch computes meanwhile),
and after the step the last stage's token ids reach every rank (`share_tokens`). The transport is
torch.distributed point to point (gloo or NCCL). Every wait is timed (a stage's idle time: the
pipeline bubble) and a failed wait names the rank it waited on (`LinkFailed`), so the caller can
say which rank failed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Stage:
    """The slice of the model one rank runs: decoder layers [first_layer, first_layer + num_layers);
    the first stage also runs the embeddings, the last the LM head."""

    index: int
    num_stages: int
    first_layer: int
    num_layers: int

    def __post_init__(self):
        if not 0 <= self.index < self.num_stages or self.num_layers < 1 or self.first_layer < 0:
            raise ValueError(f"bad stage {self}")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


def schedule(num_layers: int, num_gpu_batches: int, micro_batches: int) -> list[tuple[int, int]]:
    """The order of a step's (layer, GPU batch) cells: micro-batch after micro-batch, each in
    FlexGen's order (every GPU batch of layer j before layer j+1). One micro-batch is FlexGen's
    schedule; several let a micro-batch leave a stage while the next one computes."""
    if micro_batches < 1 or num_gpu_batches % micro_batches:
        raise ValueError(f"{micro_batches} micro-batches do not divide {num_gpu_batches} GPU batches")
    per = num_gpu_batches // micro_batches
    return [(j, k) for m in range(micro_batches) for j in range(num_layers) for k in range(m * per, (m + 1) * per)]


class LinkFailed(RuntimeError):
    """A send, receive or broadcast with another rank failed (it died, hung past the timeout, or
    stopped); `peer` is the rank this one was waiting on, `what` the message."""

    def __init__(self, peer: int, what: str, cause: BaseException):
        super().__init__(f"{what} with rank {peer} failed: {' '.join(str(cause).split())[:200]}")
        self.peer, self.what = peer, what


@dataclass
class LinkStats:
    """What one stage's boundary moved and waited for, since the last reset."""

    steps: int = 0
    wall_s: float = 0.0        # begin_step -> the token ids in hand, summed over steps
    recv_wait_s: float = 0.0   # waiting for an input micro-batch (idle: the bubble at the front)
    send_wait_s: float = 0.0   # waiting for the sends of the step to complete
    token_wait_s: float = 0.0  # waiting for the last stage's token ids (idle: the bubble at the back)
    bytes_sent: int = 0
    bytes_received: int = 0
    token_bytes: int = 0
    messages: int = 0
    step_wall_s: list = field(default_factory=list)
    step_idle_s: list = field(default_factory=list)

    @property
    def idle_s(self) -> float:
        return self.recv_wait_s + self.send_wait_s + self.token_wait_s

    def to_dict(self) -> dict:
        busy = self.wall_s - self.idle_s
        return {"steps": self.steps, "wall_s": self.wall_s, "busy_s": busy,
                "busy_fraction": busy / self.wall_s if self.wall_s > 0 else None,
                "recv_wait_s": self.recv_wait_s, "send_wait_s": self.send_wait_s, "token_wait_s": self.token_wait_s,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "token_bytes": self.token_bytes, "messages": self.messages,
                "step_wall_s": list(self.step_wall_s), "step_idle_s": list(self.step_idle_s)}


class StageLink:
    """One rank's boundary in a pipeline over torch.distributed: stage s is rank s of `group`
    (None: the default group). comm_device: where messages live (cpu for gloo, the CUDA device
    for NCCL)."""

    def __init__(self, stage: Stage, micro_batches: int, comm_device: torch.device | str = "cpu", group=None):
        self.stage, self.micro_batches = stage, micro_batches
        self.comm_device, self.group = torch.device(comm_device), group
        self.stats = LinkStats()
        self._recvs: list = []
        self._sends: list = []
        self._t0 = 0.0
        self._idle0 = 0.0

    def reset(self) -> None:
        self.stats = LinkStats()

    def _peer(self, stage: int) -> int:
        import torch.distributed as dist
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    def _wait(self, work, peer: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError (DistBackendError) on a lost peer
            raise LinkFailed(peer, what, e) from e

    def begin_step(self, rows: int, seq_len: int, hidden: int, dtype: torch.dtype) -> None:
        """Post the receives of this step's micro-batches ([rows, seq_len, hidden] each), so they
        arrive while earlier ones compute."""
        import torch.distributed as dist
        self._t0, self._idle0 = time.perf_counter(), self.stats.idle_s
        self._recvs = []
        if self.stage.is_first:
            return
        src = self._peer(self.stage.index - 1)
        for m in range(self.micro_batches):
            buf = torch.empty(rows, seq_len, hidden, dtype=dtype, device=self.comm_device)
            try:
                self._recvs.append((buf, dist.irecv(buf, src, group=self.group, tag=m)))
            except RuntimeError as e:
                raise LinkFailed(src, "receive of hidden states", e) from e

    def receive(self, m: int) -> torch.Tensor:
        """Micro-batch m's input hidden states [rows, seq_len, hidden] (on the comm device)."""
        buf, work = self._recvs[m]
        t = time.perf_counter()
        self._wait(work, self._peer(self.stage.index - 1), "receive of hidden states")
        self.stats.recv_wait_s += time.perf_counter() - t
        self.stats.bytes_received += buf.nbytes
        self.stats.messages += 1
        return buf

    def send(self, m: int, x: torch.Tensor) -> None:
        """Start sending micro-batch m's output hidden states x: [rows, seq_len, hidden] on."""
        import torch.distributed as dist
        dst = self._peer(self.stage.index + 1)
        x = x.to(self.comm_device).contiguous()
        try:
            self._sends.append((x, dist.isend(x, dst, group=self.group, tag=m)))
        except RuntimeError as e:
            raise LinkFailed(dst, "send of hidden states", e) from e
        self.stats.bytes_sent += x.nbytes
        self.stats.messages += 1

    def end_step(self) -> None:
        """Wait for this step's sends (their buffers are then free)."""
        t = time.perf_counter()
        dst = self._peer(self.stage.index + 1) if not self.stage.is_last else -1
        for _, work in self._sends:
            self._wait(work, dst, "send of hidden states")
        self._sends = []
        self.stats.send_wait_s += time.perf_counter() - t

    def share_tokens(self, tokens: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
        """The step's token ids [batch] from the last stage (which passes them) on every rank."""
        import torch.distributed as dist
        src = self._peer(self.stage.num_stages - 1)
        buf = tokens.to(self.comm_device, torch.long) if self.stage.is_last else \
            torch.empty(batch, dtype=torch.long, device=self.comm_device)
        t = time.perf_counter()
        try:
            dist.broadcast(buf, src, group=self.group)
        except RuntimeError as e:
            raise LinkFailed(src, "broadcast of token ids", e) from e
        done = time.perf_counter()
        s = self.stats
        s.token_wait_s += done - t
        s.token_bytes += buf.nbytes
        s.steps += 1
        s.wall_s += done - self._t0
        s.step_wall_s.append(done - self._t0)
        s.step_idle_s.append(s.idle_s - self._idle0)
        return buf.to(device)
