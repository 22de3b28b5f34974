"""Copies between a param's device and host memory, on side streams ordered by events.

``CudaTransport`` copies grads device→host on one stream and params host→device on another;
the caller's (compute) stream is ordered against them with events only — no device-wide sync.
``LocalTransport`` plays the device side with CPU tensors: the same calls, synchronous copies,
so the pipeline's logic runs (and is tested) on a machine without a GPU.

:func:`transport_for` gives one transport per GPU for the whole process: the host executors and
activation offload copy on the same two streams of a device, instead of two each (an
executor's GPU engine copies on a pair of its own).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

__all__ = ["Transport", "CudaTransport", "LocalTransport", "transport_for"]


class Transport:
    """Interface; ``Event`` objects are opaque (``None`` for the local transport)."""

    stream_in: Optional[object] = None  # the streams the copies run on (None: synchronous)
    stream_out: Optional[object] = None

    def ready(self) -> Optional[object]:
        """An event marking the work queued so far on the calling thread's stream."""
        return None

    def wait_in(self, ready: Optional[object]) -> None:
        """Order the copies in issued from now on after ``ready``."""

    def wait_out(self, ready: Optional[object]) -> None:
        """Order the copies out issued from now on after ``ready``."""

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device→host copy of ``src`` into the staging view ``dst``."""
        dst.copy_(src)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host→device copy of the staging view ``src`` into ``dst``."""
        dst.copy_(src)

    def copy_out_all(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Copies of ``srcs`` into ``dsts`` on the device (one fused copy), in the copies out's
        order."""
        torch._foreach_copy_(dsts, srcs)

    def mark_in(self) -> Optional[object]:
        """An event completing when the copies in issued so far are done."""
        return None

    def mark_out(self) -> Optional[object]:
        return None

    def wait_host(self, event: Optional[object]) -> None:
        """Block this thread (without the GIL) until ``event`` completes."""

    def end(self) -> None:
        """Make the caller's stream wait for every copy out issued so far."""


class LocalTransport(Transport):
    """Params on the CPU: synchronous copies, no events."""


class CudaTransport(Transport):
    """Params on a CUDA device: a D2H and an H2D stream (``streams``: those two, else new
    ones), ordered by CUDA events."""

    def __init__(self, device: torch.device,
                 streams: Optional[tuple["torch.cuda.Stream", "torch.cuda.Stream"]] = None):
        self.device = device
        self.stream_in, self.stream_out = streams or (torch.cuda.Stream(device),
                                                      torch.cuda.Stream(device))

    def ready(self) -> torch.cuda.Event:
        return torch.cuda.current_stream(self.device).record_event()

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        # Host threads wait on these (wait_host): a blocking-sync event lets a waiting worker
        # sleep; the default one spins on its core, taking it from the workers that compute.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def wait_in(self, ready: Optional[torch.cuda.Event]) -> None:
        if ready is not None:
            self.stream_in.wait_event(ready)

    def wait_out(self, ready: Optional[torch.cuda.Event]) -> None:
        if ready is not None:
            self.stream_out.wait_event(ready)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream_in):
            dst.copy_(src, non_blocking=True)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream_out):
            dst.copy_(src, non_blocking=True)

    def copy_out_all(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        with torch.cuda.stream(self.stream_out):
            torch._foreach_copy_(dsts, srcs)

    def mark_in(self) -> torch.cuda.Event:
        return self._record(self.stream_in)

    def mark_out(self) -> torch.cuda.Event:
        return self._record(self.stream_out)

    def wait_host(self, event: Optional[torch.cuda.Event]) -> None:
        if event is not None:
            event.synchronize()

    def end(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream_out)


def streams_apart(device: torch.device, n: int,
                  taken: list["torch.cuda.Stream"]) -> list["torch.cuda.Stream"]:
    """``n`` streams of ``device`` that are none of ``taken`` nor one another. torch hands out
    a device's pooled streams in turn (32 a priority), so a process's 33rd
    ``torch.cuda.Stream()`` is its first again: work meant to overlap would queue on one
    stream. (Where every pooled stream is taken, the last drawn is kept: still right, not
    overlapped.)"""
    ids = {s.cuda_stream for s in taken}
    out = []
    for _ in range(n):
        for _ in range(64):
            stream = torch.cuda.Stream(device=device)
            if stream.cuda_stream not in ids:
                break
        ids.add(stream.cuda_stream)
        out.append(stream)
    return out


_transports: dict[torch.device, CudaTransport] = {}
_making = threading.Lock()


def transport_for(device: torch.device) -> Transport:
    """The transport for params on ``device``: on a GPU, the process's one (made on first use),
    so that every user of the device copies on its one pair of streams; on the CPU, a local
    one."""
    if device.type == "cpu":
        return LocalTransport()
    if device.type != "cuda":
        raise ValueError(f"host-resident state needs params on 'cpu' or 'cuda', got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _making:
        if device not in _transports:
            _transports[device] = CudaTransport(device)
        return _transports[device]
