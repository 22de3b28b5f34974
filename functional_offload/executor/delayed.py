"""The delayed parameter update's step in flight: a run in the background, landed later.

:class:`Landing` starts a run whose leaves write their new params into host staging; the step
lands when :meth:`Landing.land` is called (by the next update, or ``flush``): each finished
chunk's staged params are copied to their targets on the H2D stream, after the work the caller
queued meanwhile (which read the old params). Landing is idempotent and runs to its end even
when the caller's thread is interrupted (the caller runs it through
:func:`~functional_offload.executor.shield.shielded`).
"""

from __future__ import annotations

import queue as queue_mod
import threading
from typing import Any, Optional, Sequence

import torch

from functional_offload.executor.host import HostExecutor
from functional_offload.executor.plan import HostLeaf, Segment
from functional_offload.kernels.work import Kernel

__all__ = ["Landing"]


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class Landing:
    """A delayed host step: ``leaves[i].param`` is host staging, ``targets[i]`` the param."""

    def __init__(self, executor: HostExecutor, leaves: Sequence[HostLeaf], kernel: Kernel,
                 targets: Sequence[Optional[torch.Tensor]], threads: Optional[int] = None):
        self.ex, self.targets = executor, list(targets)
        self.device = leaves[0].grad.device
        self._chunks: "queue_mod.Queue" = queue_mod.Queue()  # segments per finished chunk; None: end
        self._lock = threading.Lock()
        self._landed = False
        ready = executor.ready(self.device)  # grads are complete here, on the caller's stream
        self.run = executor.open(self.device, kernel, threads,
                                 chunk_done=lambda _, segs: self._chunks.put(segs))
        self.run.add_all(list(leaves), ready)
        self.run.close()
        self._staged = [leaf.param for leaf in leaves]  # not the leaves: they hold the grads

    @property
    def error(self) -> Optional[BaseException]:
        """The host step's error once the run ended (None while it runs or when it succeeded)."""
        return self.run.error if self.run.done else None

    def land(self, ready: Any) -> None:
        """Copy the staged params out as chunks finish (after ``ready``, the caller's stream's
        mark), wait for the run, and raise its error. Idempotent; call from a helper thread."""
        with self._lock:
            if not self._landed:
                self._land(ready)
                self._landed = True
        if self.run.error is not None:
            raise self.run.error

    @torch.no_grad()
    def _land(self, ready: Any) -> None:
        t, tl = self.ex.transport(self.device), self.ex.timeline
        t.wait_out(ready)  # the caller's reads of the old params come first
        copies = []  # the next step rewrites each staging range only after its copy ran
        segments: Optional[list[Segment]]
        while (segments := self._chunks.get()) is not None:
            s0 = tl.stamp(self.device, t.stream_out) if tl else None
            ranges = []
            for seg in segments:
                staged, target = self._staged[seg.leaf], self.targets[seg.leaf]
                if target is not None and staged is not None:
                    src = staged[seg.start:seg.stop]
                    t.copy_out(target[seg.start:seg.stop], src)
                    ranges.append(_byte_range(src))
            event = t.mark_out()
            copies += [(a, b, event) for a, b in ranges]
            if tl:
                tl.span("H2D", "staged params", s0, tl.stamp(self.device, t.stream_out))
        self.run.wait()
        self.ex.record_staged_copies(self.device, copies)
