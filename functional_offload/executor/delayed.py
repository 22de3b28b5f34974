"""The delayed parameter update's step in flight: a run in the background, landed later.

:class:`Landing` first copies the grads into a buffer of its own on their device (one fused
copy on the caller's stream), so the caller may free, zero or accumulate into its grads at once.
The run then copies each chunk of grads down from that buffer, and each chunk's new params up
into the same bytes as soon as the chunk's kernel is done — during the caller's next forward and
backward. The step lands when :meth:`Landing.land` is called (by the next update, or ``flush``):
one device-side copy of the new params over the params, after the work the caller queued
meanwhile (which read the old params). Landing is idempotent and runs to its end even when the
caller's thread is interrupted (the caller runs it through
:func:`~functional_offload.executor.shield.shielded`).
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import torch

from functional_offload.executor.host import HostExecutor
from functional_offload.executor.chunking import ALIGN, HostLeaf, Segment
from functional_offload.kernels.work import Kernel

__all__ = ["Landing"]


def _regions(leaves: Sequence[HostLeaf], targets: Sequence[Optional[torch.Tensor]],
             device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], list[Optional[torch.Tensor]]]:
    """One buffer on ``device``: per leaf a region for its grad and one for its new param; the
    two share their bytes when the dtypes have one size (chunk ``k``'s params are copied up only
    after its grads were copied down)."""
    spans, size = [], 0
    for leaf, target in zip(leaves, targets):
        g_bytes = leaf.grad.numel() * leaf.grad.element_size()
        shared = target is None or target.element_size() == leaf.grad.element_size()
        g_at = size
        size += -(-g_bytes // ALIGN) * ALIGN
        p_at = g_at
        if not shared:
            p_at = size
            size += -(-target.numel() * target.element_size() // ALIGN) * ALIGN
        spans.append((g_at, p_at))
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    grads, params = [], []
    for (g_at, p_at), leaf, target in zip(spans, leaves, targets):
        n = leaf.grad.numel()
        grads.append(buf[g_at: g_at + n * leaf.grad.element_size()].view(leaf.grad.dtype))
        params.append(None if target is None else
                      buf[p_at: p_at + n * target.element_size()].view(target.dtype))
    return buf, grads, params


class Landing:
    """A delayed host step of ``leaves`` (their ``param`` ignored): ``targets[i]`` is leaf
    ``i``'s param (1-D), or None when its value is the param itself."""

    def __init__(self, executor: HostExecutor, leaves: Sequence[HostLeaf], kernel: Kernel,
                 targets: Sequence[Optional[torch.Tensor]], threads: Optional[int] = None):
        self.ex, self.targets = executor, list(targets)
        self.device = leaves[0].grad.device
        buf, grads, self._up = _regions(leaves, self.targets, self.device)
        torch._foreach_copy_(grads, [leaf.grad for leaf in leaves])  # the caller's grads are free now
        t = executor.transport(self.device)
        for stream in (t.stream_in, t.stream_out):
            if stream is not None:  # the run reads and writes ``buf`` on the copy streams
                buf.record_stream(stream)
        self._done: list[Segment] = []  # segments whose new params are copied up (or in place)
        self._lock = threading.Lock()
        self._landed = False
        ready = executor.ready(self.device)  # the copies above are complete here
        done = self._done  # (not self: no cycle through the run keeps the buffer past its step)
        self.run = executor.open(self.device, kernel, threads,
                                 chunk_done=lambda _, segs: done.extend(segs or ()))
        self.run.add_all([leaf._replace(grad=g, out=p) for leaf, g, p in zip(leaves, grads, self._up)],
                         ready)
        self.run.close()

    @property
    def error(self) -> Optional[BaseException]:
        """The host step's error once the run ended (None while it runs or when it succeeded)."""
        return self.run.error if self.run.done else None

    def land(self, ready: Any) -> None:
        """Wait for the run, then copy the new params of its finished chunks over the params
        (after ``ready``, the caller's stream's mark) and raise the run's error. Idempotent;
        call from shielded work."""
        with self._lock:
            if not self._landed:
                self._land(ready)
                self._landed = True
        if self.run.error is not None:
            raise self.run.error

    @torch.no_grad()
    def _land(self, ready: Any) -> None:
        self.run.wait()
        t, tl = self.ex.transport(self.device), self.ex.timeline
        if self.run.error is None:  # every chunk is done: whole leaves, no slice per segment
            pairs = [(d, s) for d, s in zip(self.targets, self._up) if d is not None]
        else:
            pairs = [(self.targets[s.leaf][s.start:s.stop], self._up[s.leaf][s.start:s.stop])
                     for s in self._done if self.targets[s.leaf] is not None]
        if pairs:
            t.wait_out(ready)  # the caller's reads of the old params come first
            s0 = tl.stamp(self.device, t.stream_out) if tl else None
            t.copy_out_all([d for d, _ in pairs], [s for _, s in pairs])
            if tl:
                tl.span("H2D", "land params", s0, tl.stamp(self.device, t.stream_out))
        self._up = []  # the buffer goes (once the copies above ran: it is recorded on the stream)
