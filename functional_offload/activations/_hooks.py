"""What :mod:`functional_offload.activations.testing` sets for tests; nothing else changes it.

The host clock that the CPU's profiling, copies and waits read, and whether objects made now
copy CPU tensors.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["now", "set_clock", "copies_cpu", "set_copies_cpu"]

_clock: Callable[[], float] = time.perf_counter
_copy_on_cpu: Optional[str] = None


def now() -> float:
    """Seconds on the host clock (``time.perf_counter`` unless a test set another)."""
    return _clock()


def set_clock(clock: Callable[[], float]) -> Callable[[], float]:
    """Read ``clock`` from now on; returns the clock it replaces."""
    global _clock
    before, _clock = _clock, clock
    return before


def copies_cpu() -> Optional[str]:
    """Whether an :class:`~functional_offload.ActivationOffload` made now copies CPU tensors,
    and when each copy runs: None (it does not), ``"waited"`` or ``"issued"``."""
    return _copy_on_cpu


def set_copies_cpu(lands: Optional[str]) -> Optional[str]:
    """Set :func:`copies_cpu`; returns what it was."""
    global _copy_on_cpu
    before, _copy_on_cpu = _copy_on_cpu, lands
    return before
