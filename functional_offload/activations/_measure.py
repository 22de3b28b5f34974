"""The profiling steps: per-group bytes, memory and times, turned into a :class:`Profile`.

Up to two steps per input shape. The first offloads every group but the last: every saved byte
passes the hooks, the copy rates are measured, and the memory stays low. Its times are not the
groups' own: the forward waits for copies and for new pinned host buffers (pinning gigabytes
stalls the host for seconds). The second recomputes every group that can be recomputed (and
keeps the last): nothing moves, so each group's forward time is its compute, and each group's
backward span (from the start of its recompute to the start of the previous group's) less its
recompute gives the backward's ratio to the forward.

On a GPU, times come from CUDA events on the compute and copy streams (read once, when the
step's backward ends: one synchronization per profiling step) and memory from the caching
allocator's counters. A host wait for copies puts an event before and after itself; nothing is
queued on the compute stream between the two, so their distance is time the compute stood idle,
and it is taken out of the group's forward time. On the CPU, the host clock gives the times
and the memory model counts saved bytes only.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Optional, Sequence

import torch

from functional_offload.activations._hooks import now
from functional_offload.activations.cost_model import KEEP, OFFLOAD, RECOMPUTE, Profile


class Measure:
    """Records one step; :meth:`profile` turns it into a :class:`Profile` after backward."""

    def __init__(self, num_groups: int, device: torch.device, start_bytes: int, can_move: bool,
                 timing: bool = False):
        n = num_groups
        self.timing = timing  # the second profiling step (recompute): times only
        if timing:  # checkpoint's first call imports torch._dynamo (seconds): not a group's time
            importlib.import_module("torch._dynamo")
        self.cuda = device.type == "cuda"
        self.device, self.start_bytes, self.can_move = device, start_bytes, can_move
        self.enter: list[Any] = [None] * n
        self.exit: list[Any] = [None] * n
        self.bwd: list[Any] = [None] * n  # first unpack of each group in backward
        self.fwd_end: Any = None  # the recorded forward's end (the loss head computed)
        self.bwd_start: Any = None  # the backward's first unpack
        self.gaps: list[tuple[Optional[int], Any, Any]] = []  # (group, before, after)
        self.copies: dict[str, list] = {"d2h": [], "h2d": []}
        self.inputs = [0] * n
        self.recomputable = [False] * n
        self.group: Optional[int] = None  # the forward's open group
        # memory minus the plan's bytes, per phase: ("fwd", i), ("head", None), ("bwd", i)
        self.other: dict[tuple, int] = {}
        self.top: tuple[int, tuple] = (-1, ("head", None))  # highest raw sample and its phase
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return now()

    copy_begin = mark

    def gap_begin(self) -> tuple:
        return (self.group, self.mark())

    def gap_end(self, token: tuple) -> None:
        self.gaps.append((token[0], token[1], self.mark()))

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def sample(self, phase: tuple, plan_bytes: int) -> None:
        """Memory now, less ``plan_bytes`` (what the decisions hold), is the phase's other."""
        if not self.cuda:
            return
        raw = torch.cuda.memory_allocated(self.device) - self.start_bytes
        self.other[phase] = max(self.other.get(phase, raw - plan_bytes), raw - plan_bytes)
        if raw > self.top[0]:
            self.top = (raw, phase)

    def _forward(self) -> tuple[list[float], float]:
        """Each group's forward time and the loss head's (the forward after the last group and
        the backward before the last group's, not what ran in between, such as another
        micro-batch's forward), less the time the compute stood idle in host waits."""
        n = len(self.enter)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        gap = [0.0] * (n + 1)  # per group; the last slot: outside the groups
        for g, a, b in self.gaps:
            gap[n if g is None else g] += self._seconds(a, b)
        fwd = [max(self._seconds(self.enter[i], self.exit[i]) - gap[i], 1e-9) for i in range(n)]
        if self.bwd[n - 1] is None:
            return fwd, 0.0
        if self.fwd_end is not None and self.bwd_start is not None:  # not what ran in between
            head = (self._seconds(self.exit[n - 1], self.fwd_end)
                    + self._seconds(self.bwd_start, self.bwd[n - 1]))
        else:
            head = self._seconds(self.exit[n - 1], self.bwd[n - 1])
        return fwd, max(head - gap[n], 0.0)

    def missing(self) -> list[int]:
        """The groups that did not run (enter and exit) in the profiled step."""
        return [i for i, (a, b) in enumerate(zip(self.enter, self.exit)) if a is None or b is None]

    def complete(self) -> bool:
        return not self.missing()

    def profile(self, saved: Sequence[int], small: Sequence[int], outside_before: int,
                outside: int) -> Optional[Profile]:
        """The first step's :class:`Profile` (None when a group did not run); its times are
        replaced by the second step's (:meth:`times`) where that step runs."""
        n = len(saved)
        if not self.complete():
            return None
        fwd, outside_s = self._forward()
        beta = 2.0
        if n > 1 and self.bwd[n - 1] is not None and self.bwd[n - 2] is not None:
            beta = min(max(self._seconds(self.bwd[n - 1], self.bwd[n - 2]) / fwd[n - 1], 0.5), 4.0)
        rates = []
        for kind in ("d2h", "h2d"):
            log = self.copies[kind]
            secs = sum(x[1] if len(x) == 2 else self._seconds(x[1], x[2]) for x in log)
            rates.append(sum(x[0] for x in log) / secs if secs > 0 else 10e9)
        d2h, h2d = rates if self.can_move else (0.0, 0.0)
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) - self.start_bytes
            other_fwd = [self.other.get(("fwd", i), 0) for i in range(n)]
            other_bwd = [self.other.get(("bwd", i), 0) for i in range(n)]
            head = self.other.get(("head", None), 0)
            unseen = max(peak - self.top[0], 0)  # above every sample: put it where the top was
            kind, i = self.top[1]
            if kind == "head":
                head += unseen
            else:
                (other_fwd if kind == "fwd" else other_bwd)[i] += unseen
        else:
            peak, other_fwd, other_bwd, head = None, [outside_before] * n, [outside_before] * n, outside
        return Profile(list(saved), list(small), list(self.inputs), fwd, list(self.recomputable),
                       other_fwd, other_bwd, head, beta, outside_s, d2h, h2d, peak)

    def times(self, profile: Profile, decisions: Sequence[str]) -> Optional[Profile]:
        """``profile`` with the second step's times: each group's forward, the backward's ratio
        (over the groups that did not offload: backward spans less recompute, over forward
        time), and the loss head's. None when a group did not run."""
        n = len(decisions)
        if not self.complete():
            return None
        fwd, outside_s = self._forward()
        spans = forwards = 0.0
        for i in range(1, n):
            if decisions[i] != OFFLOAD and self.bwd[i] is not None and self.bwd[i - 1] is not None:
                span = self._seconds(self.bwd[i], self.bwd[i - 1])
                spans += span - (fwd[i] if decisions[i] == RECOMPUTE else 0.0)
                forwards += fwd[i]
        beta = min(max(spans / forwards, 0.5), 4.0) if forwards > 0 else profile.backward_ratio
        forward_s = [fwd[i] if decisions[i] != OFFLOAD else profile.forward_s[i] for i in range(n)]
        return dataclasses.replace(profile, forward_s=forward_s, backward_ratio=beta,
                                   outside_s=outside_s)


def profiling_decisions(num_groups: int, can_move: bool) -> list[str]:
    """The profiling step offloads every group but the last (memory stays low; every saved byte
    is seen by the hooks), or keeps everything where nothing can move."""
    return [OFFLOAD if can_move and i < num_groups - 1 else KEEP for i in range(num_groups)]


def timing_decisions(recomputable: Sequence[bool], can_move: bool) -> list[str]:
    """The second profiling step recomputes every group it can but the last; a group marked
    with ``group()`` is offloaded (kept where nothing can move) as in the first step."""
    n = len(recomputable)
    return [RECOMPUTE if recomputable[i] and i < n - 1 else
            OFFLOAD if can_move and i < n - 1 else KEEP for i in range(n)]
