"""Opt-in per-chunk timeline of the executor: Chrome-trace JSON (Perfetto) and a PNG lane plot.

Attach one to an executor (``HostExecutor(timeline=Timeline())``); each update then records
spans on lanes ``D2H`` and ``H2D`` (CUDA events with timing on the copy streams), ``D2H engine``
and ``H2D engine`` (the GPU engine's state going up and down, on its own copy streams),
``GPU update`` (the device kernels, on the stream they run on: the GPU engine's chunks on its
math streams, so their spans may overlap) and one lane per CPU worker thread (``kernel c<k>``:
a piece of chunk ``k``). The training loop may record lanes of its own with
:meth:`stamp` and :meth:`span` (e.g. the forward and backward on the compute stream); they are
drawn first. Recording costs two events or two clock reads per span; the CUDA times are
resolved only when exported (which synchronizes), against one reference event taken after a
synchronize when the first CUDA span is recorded.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Optional, Union

import torch

__all__ = ["Timeline"]

Stamp = Union[int, "torch.cuda.Event"]


class Timeline:
    """Spans recorded by the executor; export with :meth:`to_chrome` or :meth:`plot`."""

    def __init__(self) -> None:
        self._spans: list[tuple[str, str, Any, Any]] = []
        self._base: dict[torch.device, tuple[Any, int]] = {}
        self._lock = threading.Lock()

    def stamp(self, device: torch.device, stream: Optional[Any] = None) -> Stamp:
        """A point in time: a timing CUDA event on ``stream`` (the current one if None) for CUDA
        devices, else the host clock in ns."""
        if device.type != "cuda":
            return time.perf_counter_ns()
        if device not in self._base:
            # on an idle stream of its own: on a busy one (another thread may queue work between
            # the synchronize and the record) the event would run late and shift every GPU span
            torch.cuda.synchronize(device)
            base = torch.cuda.Event(enable_timing=True)
            base.record(torch.cuda.Stream(device))
            self._base[device] = (base, time.perf_counter_ns())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream(device))
        return ev

    def span(self, lane: str, name: str, start: Stamp, end: Stamp) -> None:
        with self._lock:
            self._spans.append((lane, name, start, end))

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def _ns(self, s: Stamp) -> float:
        if isinstance(s, int):
            return float(s)
        for base, base_ns in self._base.values():
            try:
                return base_ns + base.elapsed_time(s) * 1e6
            except RuntimeError:  # an event of another device
                continue
        raise RuntimeError("timeline event without a reference event")

    def events(self) -> list[dict[str, Any]]:
        """Spans as ``{"lane", "name", "start_us", "dur_us"}``, times from the first span."""
        if self._base:
            for device in self._base:
                torch.cuda.synchronize(device)
        with self._lock:
            spans = [(lane, name, self._ns(a), self._ns(b)) for lane, name, a, b in self._spans]
        t0 = min((a for _, _, a, _ in spans), default=0.0)
        return [{"lane": lane, "name": name, "start_us": (a - t0) / 1e3, "dur_us": (b - a) / 1e3}
                for lane, name, a, b in sorted(spans, key=lambda s: s[2])]

    def lanes(self, events: list[dict[str, Any]]) -> list[str]:
        """Lanes in display order: the caller's own (by name), GPU update, D2H (and the GPU
        engine's), workers (numerically), H2D (and the GPU engine's)."""
        order = {"GPU update": 1, "D2H": 2, "D2H engine": 2, "H2D": 4, "H2D engine": 4}

        def key(lane: str) -> tuple:
            head, _, num = lane.rpartition("_")
            rank = order.get(lane, 3 if head == "fo-host" else 0)
            return (rank, head, int(num) if num.isdigit() else -1, lane)

        return sorted({e["lane"] for e in events}, key=key)

    def to_chrome(self, path: Union[str, os.PathLike]) -> None:
        """Write Chrome-trace JSON (open it in Perfetto or chrome://tracing)."""
        events = self.events()
        tid = {lane: i for i, lane in enumerate(self.lanes(events))}
        trace = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": lane}}
                 for lane, i in tid.items()]
        trace += [{"ph": "X", "name": e["name"], "pid": 0, "tid": tid[e["lane"]],
                   "ts": e["start_us"], "dur": e["dur_us"]} for e in events]
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)

    def plot(self, path: Union[str, os.PathLike], title: str = "") -> None:
        """Write a PNG with one lane per stream / worker thread (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        events = self.events()
        lanes = self.lanes(events)
        colors = {"GPU update": "tab:green", "D2H": "tab:blue", "H2D": "tab:orange",
                  "D2H engine": "tab:cyan", "H2D engine": "gold",
                  "forward": "tab:purple", "backward": "plum"}  # by lane, or by span name
        fig, ax = plt.subplots(figsize=(12, 0.35 * len(lanes) + 1.2))
        for i, lane in enumerate(lanes):
            mine = [e for e in events if e["lane"] == lane]
            ax.broken_barh([(e["start_us"] / 1e3, e["dur_us"] / 1e3) for e in mine], (i - 0.4, 0.8),
                           facecolors=["gainsboro" if e["name"].startswith("wait")  # a worker waiting
                                       else colors.get(e["name"], colors.get(lane, "tab:gray"))
                                       for e in mine])
        ax.set_yticks(range(len(lanes)), lanes)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
