"""What a host kernel is handed: chunks of pieces, cut into blocks that worker threads claim.

The executor (``functional_offload.executor``) builds a :class:`Work` per chunk and adds it to
the run's :class:`Queue`; worker threads stay in the queue's ``work`` loop for the whole run,
taking the chunks in order and claiming each one's blocks until none is left. The native
kernels (``cpu``) bring their own queue, whose workers are native threads of its own
(:class:`OwnWorkers`) that never enter Python; :class:`PyQueue` runs a Python kernel (the torch
reference, tests) the same way on the executor's threads.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol, Sequence, Union

import torch

__all__ = ["Piece", "Work", "Kernel", "Queue", "OwnWorkers", "QueueMaker", "PyQueue", "queue_for"]


class Piece(NamedTuple):
    """A contiguous run of one leaf inside a chunk: 1-D views the kernel reads and writes."""

    grad: torch.Tensor  # in the ring (pinned) or the grad itself (CPU grads), the grad's dtype
    state: tuple[torch.Tensor, ...]  # (value fp32, moments...) in host memory
    out: Optional[torch.Tensor]  # where the param in the grad's dtype goes, or None
    hyper: Any  # the optimizer's per-step hyperparameters for this leaf
    targets: tuple[torch.Tensor, ...] = ()  # new (value, moments...) go here; () = in place
    ema: Optional[torch.Tensor] = None  # fp32 EMA of the value, updated after it
    ema_decay: float = 0.0
    ema_target: Optional[torch.Tensor] = None  # the new EMA goes here; None = in place
    ahead: Optional[torch.Tensor] = None  # a look-ahead's rate (``out`` then gets its base)
    ahead_hyper: Any = None  # the next step's hyperparameters, for the look-ahead
    residual: Optional[torch.Tensor] = None  # int8: the byte below a bf16 base (remainder.py)


class Work:
    """One chunk's kernel work, shared by the worker threads that run it.

    The pieces are cut into blocks of ``block`` elements (per piece, the last one shorter),
    numbered piece after piece. A Python kernel claims blocks through :meth:`claims`; a native
    queue numbers them the same way and claims them with its own atomic counter.
    """

    __slots__ = ("pieces", "block", "_first", "_next")

    def __init__(self, pieces: list[Piece], block: int):
        self.pieces, self.block = pieces, block
        self._first = [0]
        for p in pieces:
            self._first.append(self._first[-1] + -(-p.grad.numel() // block))
        self._next = itertools.count()  # next(): atomic under the GIL

    def claims(self) -> Iterator[tuple[Piece, int, int]]:
        """Yield ``(piece, start, stop)`` for each block this task claims."""
        while (j := next(self._next)) < self._first[-1]:
            i = bisect.bisect_right(self._first, j) - 1
            a = (j - self._first[i]) * self.block
            yield self.pieces[i], a, min(a + self.block, self.pieces[i].grad.numel())


class QueueMaker(Protocol):
    def queue(self, threads: int, record: bool = False) -> "Queue":
        """A fresh queue for one run."""


Kernel = Union[Callable[[Work], None], QueueMaker]
"""A Python kernel, ``kernel(work)``, which claims blocks of ``work`` until none is left,
updating each in place; or a kernel with its own queue (``kernel.queue(threads, record)``)."""


class Queue(Protocol):
    """One executor run's chunks, in order, for worker threads that stay in :meth:`work`."""

    def add(self, work: Work) -> int:
        """Append a chunk; returns its index (0, 1, ...)."""

    def ready(self, k: int) -> None:
        """Chunk ``k``'s inputs are in place: workers may start on it."""

    def wait(self, k: int) -> Optional[BaseException]:
        """Block until chunk ``k`` is done; its error, if any."""

    def close(self) -> None:
        """No more chunks: workers return once they passed the last one added."""

    def cancel(self) -> None:
        """Workers return without starting another chunk."""

    def work(self, worker: int) -> None:
        """The loop of worker ``worker``: chunks in order, each once ready, until closed."""

    def spans(self) -> list[tuple[int, int, bool, int, int]]:
        """With ``record``: ``(worker, chunk, is_wait, start_ns, end_ns)`` per span so far."""


class OwnWorkers(Protocol):
    """A :class:`Queue` that runs its loop on threads of its own (a native queue's pool, kept
    across runs), not on the executor's Python threads."""

    def start(self, workers: int, cpus: Sequence[int]) -> None:
        """Put ``workers`` threads in :meth:`Queue.work` (worker ``i`` pinned to
        ``cpus[i % len(cpus)]``; empty: unpinned)."""

    def join(self) -> None:
        """Block until every thread :meth:`start` put in the loop has left it."""


class PyQueue:
    """:class:`Queue` for a Python :data:`Kernel`: each of ``threads`` workers calls
    ``kernel(work)`` on each chunk (which claims blocks until none is left); a chunk is done
    when every worker has left it."""

    def __init__(self, kernel: Callable[[Work], None], threads: int, record: bool = False):
        self._kernel, self._threads, self._record = kernel, threads, record
        self._cv = threading.Condition()
        self._works: list[Work] = []
        self._ready: list[bool] = []
        self._left: list[int] = []
        self._errors: list[Optional[BaseException]] = []
        self._closed = self._cancelled = False
        self._log: list[tuple[int, int, bool, int, int]] = []

    def add(self, work: Work) -> int:
        with self._cv:
            self._works.append(work)
            self._ready.append(False)
            self._left.append(0)
            self._errors.append(None)
            return len(self._works) - 1

    def ready(self, k: int) -> None:
        with self._cv:
            self._ready[k] = True
            self._cv.notify_all()

    def wait(self, k: int) -> Optional[BaseException]:
        with self._cv:
            self._cv.wait_for(lambda: self._left[k] == self._threads or self._cancelled)
            if self._left[k] < self._threads:
                return RuntimeError("cancelled")
            return self._errors[k]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def cancel(self) -> None:
        with self._cv:
            self._closed = self._cancelled = True
            self._cv.notify_all()

    @torch.no_grad()  # grad mode is per thread: the caller's no_grad does not reach here
    def work(self, worker: int) -> None:
        k = 0
        while True:
            with self._cv:
                t0 = time.perf_counter_ns()
                self._cv.wait_for(lambda: self._cancelled or (k < len(self._works) and self._ready[k])
                                  or (self._closed and k >= len(self._works)))
                if self._cancelled or k >= len(self._works):
                    return
                work, t1 = self._works[k], time.perf_counter_ns()
            error: Optional[BaseException] = None
            try:
                self._kernel(work)
            except BaseException as e:  # noqa: BLE001 - handed to the executor by wait()
                error = e
            with self._cv:
                self._errors[k] = self._errors[k] or error
                if self._record:
                    if t1 - t0 > 100_000:
                        self._log.append((worker, k, True, t0, t1))
                    self._log.append((worker, k, False, t1, time.perf_counter_ns()))
                self._left[k] += 1
                if self._left[k] == self._threads:
                    self._cv.notify_all()
            k += 1

    def spans(self) -> list[tuple[int, int, bool, int, int]]:
        with self._cv:
            out, self._log = self._log, []
            return out


def queue_for(kernel: Kernel, threads: int, record: bool = False) -> Queue:
    """The run's queue: the kernel's own (``kernel.queue(threads, record)``, a native kernel)
    or a :class:`PyQueue` around a Python kernel."""
    make = getattr(kernel, "queue", None)
    return make(threads, record) if make is not None else PyQueue(kernel, threads, record)
