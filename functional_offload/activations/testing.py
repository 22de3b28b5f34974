"""Test hooks for activation offload: CPU copies that behave like a GPU's, and a clock that moves
only when told, so that tests check the bookkeeping and the plans without a GPU and without
reading wall time.

Example::

    import functional_offload as fo
    from functional_offload.activations.testing import copy_on_cpu, manual_clock

    with copy_on_cpu():
        off = fo.ActivationOffload(4, budget_bytes=1 << 20)  # copies CPU tensors for its life
    with manual_clock() as clock:
        ...  # a step whose modules call clock.advance(1e-3): profiled as 1 ms each
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

from functional_offload.activations._hooks import set_clock, set_copies_cpu
from functional_offload.checks import real

__all__ = ["copy_on_cpu", "manual_clock", "ManualClock"]


@contextlib.contextmanager
def copy_on_cpu(lands: str = "waited") -> Iterator[None]:
    """:class:`~functional_offload.ActivationOffload` objects made inside the block copy CPU
    tensors too, for their whole life (without it the CPU passes tensors through, as there is
    no faster memory to move them to): offloaded groups go through the pinned pool's
    bookkeeping, and budget mode plans with offload as it does on a GPU. ``lands``: when each
    copy runs, at either end of what a GPU's copy stream may do: ``"waited"`` (the default)
    when it is waited for, so sources stay alive, in flight; ``"issued"`` at once, so that a
    source changed in place later does not reach the copy."""
    if lands not in ("waited", "issued"):
        raise ValueError(f"lands must be 'waited' or 'issued', got {lands!r}")
    before = set_copies_cpu(lands)
    try:
        yield
    finally:
        set_copies_cpu(before)


class ManualClock:
    """A host clock that stands still until :meth:`advance` moves it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` (>= 0) ahead: what the code running now takes."""
        if real(seconds) is None or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"advance takes seconds >= 0, got {seconds!r}")
        self.seconds += seconds


@contextlib.contextmanager
def manual_clock() -> Iterator[ManualClock]:
    """Inside the block, activation offload reads the returned clock wherever it reads the host
    clock: the CPU's profiling (each group's forward and backward, the loss head), the deferred
    copies' rates and the forward's waits for copies. Code under test calls
    :meth:`ManualClock.advance` to say how long it takes. (On a GPU, times come from CUDA
    events and do not read it.)"""
    clock = ManualClock()
    before = set_clock(clock)
    try:
        yield clock
    finally:
        set_clock(before)
