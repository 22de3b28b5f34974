"""What a host kernel is handed: one chunk's pieces, cut into blocks that threads claim.

The executor (``functional_offload.executor``) builds a :class:`Work` per chunk and runs the
kernel on it from several threads at once; the kernels (``cpu``, or the torch reference through
:meth:`Work.claims`) claim its blocks until none is left.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

__all__ = ["Piece", "Work", "Kernel"]


class Piece(NamedTuple):
    """A contiguous run of one leaf inside a chunk: 1-D views the kernel updates in place."""

    grad: torch.Tensor  # in the ring (pinned), the leaf's grad dtype
    state: tuple[torch.Tensor, ...]  # (value, moments...) in host memory
    out: Optional[torch.Tensor]  # where the param in model dtype goes, or None
    hyper: Any


class Work:
    """One chunk's kernel work, shared by the ``threads`` tasks that run it.

    The pieces are cut into blocks of ``block`` elements (per piece, the last one shorter),
    numbered piece after piece. A task claims blocks until none is left: Python code through
    :meth:`claims`, native code by atomically incrementing ``counter[0]`` (the same numbering).
    One chunk uses one of the two. ``prepared`` is a slot for what a kernel derives once per
    chunk (argument lists), shared by its tasks.
    """

    __slots__ = ("pieces", "block", "counter", "prepared", "_first", "_next")

    def __init__(self, pieces: list[Piece], block: int):
        self.pieces, self.block = pieces, block
        self.counter = torch.zeros(1, dtype=torch.int64)
        self.prepared: Any = None
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


Kernel = Callable[[Work], None]
"""``kernel(work)`` claims blocks of ``work`` until none is left, updating each in place."""
