"""How shards move around the ring: torch.distributed, or in memory for the twin.

A transport knows its ``rank`` and ``world_size`` and does two things:

- ``exchange(send, recv)``: post sends of ``send`` to the next rank
  ``(rank + 1) % W`` and receives into the buffers ``recv`` from the previous
  rank ``(rank - 1) % W``; returns at once with a handle whose ``wait()``
  returns the filled buffers (so the caller computes while the shards travel);
- ``all_gather_ints(values)``: every rank's list of ints, on every rank (used
  once per call to agree on the sequence lengths and check the shapes).

Messages between one pair of ranks arrive in the order they were posted.
``DistTransport`` uses ``torch.distributed`` point-to-point operations (gloo
on CPU, nccl on GPU; the device follows the tensors). ``LocalTransport`` lets
``W`` threads of one process play the ranks, with queues for wires; it copies
every message, as a wire would.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DistTransport", "LocalHub", "LocalTransport", "RingAborted", "Transport"]


class Pending(ABC):
    """Messages in flight; ``wait()`` returns the receive buffers once they are filled."""

    @abstractmethod
    def wait(self) -> list[torch.Tensor]: ...


class Transport(ABC):
    """One rank's end of the ring."""

    rank: int
    world_size: int

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world_size

    @abstractmethod
    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> Pending:
        """Send ``send`` to the next rank and receive ``recv`` from the previous one."""

    @abstractmethod
    def all_gather_ints(self, values: Sequence[int], *, device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), indexed by rank."""


# ----------------------------------------------------------------------------------------
# torch.distributed
# ----------------------------------------------------------------------------------------
def _wait(work: Any, timeout: float | None, what: str) -> None:
    """``work.wait()`` within ``timeout`` seconds; a timeout or a lost peer raises naming
    ``what`` was awaited."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        text = str(exc)
        if "imed out" in text or "timeout" in text.lower():
            within = (
                f"within {timeout:g} s (timeout={timeout:g})"
                if timeout is not None
                else "within the process group's timeout (timeout=None)"
            )
            raise TimeoutError(
                f"ring attention: {what} did not arrive {within}: that rank failed, stopped, or "
                "is far behind; the process group cannot be used after this (for very long "
                "shards pass a larger timeout)"
            ) from None
        raise RuntimeError(f"ring attention: waiting for {what} failed: {text}") from exc


class _DistPending(Pending):
    def __init__(
        self, reqs: list[Any], recv: list[torch.Tensor], timeout: float | None, what: str
    ) -> None:
        self.reqs, self.recv, self.timeout, self.what = reqs, recv, timeout, what

    def wait(self) -> list[torch.Tensor]:
        for req in self.reqs:
            _wait(req, self.timeout, self.what)
        return self.recv


class DistTransport(Transport):
    """Point-to-point sends and receives on a ``torch.distributed`` process group.

    Every wait gives up after ``timeout`` seconds with a ``TimeoutError`` (``None``: the
    process group's own timeout).
    """

    def __init__(self, group: Any = None, *, timeout: float | None = None) -> None:
        self.timeout = timeout
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ring_attention needs an initialised torch.distributed process group (start "
                "with torchrun and call torch.distributed.init_process_group); to run every "
                "rank in this process, use simulate_ring"
            )
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("ring_attention: this process is not a member of the given group")
        self.world_size = dist.get_world_size(group)
        g: Any = group if group is not None else dist.group.WORLD
        self._next_global = dist.get_global_rank(g, self.next)
        self._prev_global = dist.get_global_rank(g, self.prev)

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> Pending:
        dist = self.dist
        ops = [dist.P2POp(dist.isend, t, self._next_global, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, b, self._prev_global, self.group) for b in recv]
        what = f"rank {self.rank}'s exchange with ranks {self.prev} and {self.next}"
        return _DistPending(dist.batch_isend_irecv(ops), list(recv), self.timeout, what)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (any length), indexed by rank, within the timeout."""
        device = torch.device("cpu")
        if self.dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        lengths = [row[0] for row in self.all_gather_ints([len(data)], device=device)]
        mine = torch.zeros(max(1, *lengths), dtype=torch.uint8, device=device)  # (n,)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = self.dist.all_gather(every, mine, group=self.group, async_op=True)
        _wait(work, self.timeout, f"every rank's part of an all-gather (rank {self.rank} waiting)")
        return [t[:n].cpu().numpy().tobytes() for t, n in zip(every, lengths)]

    def _gather(self, mine: torch.Tensor) -> list[list[int]]:
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = self.dist.all_gather(every, mine, group=self.group, async_op=True)
        _wait(work, self.timeout, f"every rank's part of an all-gather (rank {self.rank} waiting)")
        return [t.tolist() for t in every]

    def all_gather_ints(self, values: Sequence[int], *, device: torch.device) -> list[list[int]]:
        # first how many: an all-gather of unequal sizes aborts the process inside gloo
        # (a rank that skipped a backward is at the next call's agreement meanwhile)
        sizes = [row[0] for row in self._gather(torch.tensor([len(values)], device=device))]
        if len(set(sizes)) > 1:
            raise RuntimeError(
                f"ring attention: the ranks are at different ring collectives (values gathered "
                f"per rank: {sizes}; rank {self.rank} is this one): every rank must make the same "
                "ring_attention calls and run their backwards in the same order; a rank that "
                "skipped a backward, or a call, is out of step"
            )
        return self._gather(torch.tensor(list(values), dtype=torch.int64, device=device))


# ----------------------------------------------------------------------------------------
# in memory (the twin)
# ----------------------------------------------------------------------------------------
class RingAborted(RuntimeError):
    """Raised in a simulated rank when another simulated rank failed first."""


class LocalHub:
    """The wires between ``W`` simulated ranks: one FIFO queue per (sender, receiver) pair."""

    def __init__(self, world_size: int, *, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.wires: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
            (s, r): queue.Queue() for s in range(world_size) for r in range(world_size)
        }
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[list[int]] = [[] for _ in range(world_size)]
        self.failed = threading.Event()

    def abort(self) -> None:
        """Wake every rank waiting on a wire or the barrier: they raise ``RingAborted``."""
        self.failed.set()
        self.barrier.abort()

    def take(self, sender: int, receiver: int) -> torch.Tensor:
        wire = self.wires[(sender, receiver)]
        deadline = time.monotonic() + self.timeout
        while True:
            if self.failed.is_set():
                raise RingAborted(f"rank {receiver}: another simulated rank failed")
            try:
                return wire.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"simulated rank {receiver} waited {self.timeout:g} s for a message "
                        f"from rank {sender}"
                    ) from None

    def sync(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise RingAborted("another simulated rank failed") from None


class _LocalPending(Pending):
    def __init__(self, hub: LocalHub, sender: int, receiver: int, recv: list[torch.Tensor]):
        self.hub, self.sender, self.receiver, self.recv = hub, sender, receiver, recv

    def wait(self) -> list[torch.Tensor]:
        for buf in self.recv:
            msg = self.hub.take(self.sender, self.receiver)
            if msg.shape != buf.shape or msg.dtype != buf.dtype:
                raise RuntimeError(
                    f"rank {self.receiver} expected a {buf.dtype} tensor of shape "
                    f"{tuple(buf.shape)} from rank {self.sender}, got {msg.dtype} "
                    f"{tuple(msg.shape)}"
                )
            buf.copy_(msg)
        return self.recv


class LocalTransport(Transport):
    """Rank ``rank`` of a ring simulated in one process (one thread per rank)."""

    def __init__(self, hub: LocalHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> Pending:
        wire = self.hub.wires[(self.rank, self.next)]
        for t in send:
            wire.put(t.detach().clone())
        return _LocalPending(self.hub, self.prev, self.rank, list(recv))

    def all_gather_ints(self, values: Sequence[int], *, device: torch.device) -> list[list[int]]:
        self.hub.slots[self.rank] = list(values)
        self.hub.sync()  # every slot written
        out = [list(s) for s in self.hub.slots]
        self.hub.sync()  # every slot read before any rank writes again
        return out
