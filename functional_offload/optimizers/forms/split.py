"""Plain steps of an executor with ``engine="both"``: the host-resident leaves are divided
between the GPU engine (:mod:`~functional_offload.optimizers.forms.gpu_engine`) and the CPU
kernel (:mod:`~functional_offload.optimizers.forms.in_place`), which run at once. The engine's
part is prepared first (chunks, device buffers: what can fail before anything is written); the
CPU kernel's leaves are then handed to runs of their own threads (one worker fewer than the
executor's, the step's thread issuing the engine's copies and math; with no leaf on the engine,
to runs as ``engine="cpu"`` makes them), the GPU engine steps its leaves in the step's thread,
and the step ends when both have. An error in the engine cancels
the CPU kernel's runs and is the one raised.

The engine is bound by PCIe (24 bytes per fp32-state param up and down), the kernel by host
DRAM, which the engine's copies also use, and the CPU kernel's grads and params cross the same
link as the engine's state: each engine's rate depends on how much the other has. Which leaves
go where: leaves in order go to the GPU engine while it has less than ``share`` of the elements
with a grad it can step (a leaf that would take it past by more than half its size stops it),
the rest to the CPU kernel, which also takes the small packed leaves and those the engine does
not step (quantized params, leaves of a length not divisible by 4 with a split master or 8-bit
moments over a chunk). ``share`` is the executor's ``gpu_share`` if set, else searched for over
the first steps (:func:`next_share`): the first step warms both engines up (not counted), then
each step measures the host step's time per element at one share (the CPU kernel alone first,
then a golden-section search of [0, 1]), about ten steps in all, after which the share of the
least time stays. Leaves the CPU kernel takes start as soon as they are fed (grad streaming),
the engine's at ``finish``.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import torch

from functional_offload.executor import SplitStep
from functional_offload.optimizers.forms.base import HostWork
from functional_offload.optimizers.forms.gpu_engine import GpuEngine, steppable
from functional_offload.optimizers.forms.in_place import InPlace
from functional_offload.optimizers.forms.speculative import Speculative
from functional_offload.quantized import is_quantized

__all__ = ["Division", "Split", "SplitPlan", "divide", "engine_steps", "next_share", "plan",
           "record", "remember"]


def engine_steps(work: HostWork, index: int) -> bool:
    """Whether the GPU engine can step host leaf ``index`` (not packed, a plain param, formats
    it can cut: :func:`~functional_offload.optimizers.forms.gpu_engine.steppable`)."""
    leaf = work.leaves[index]
    return (leaf.on_host and index not in work.static.packed and not is_quantized(leaf.param)
            and steppable(leaf, work.ex.engine_chunk_bytes))


PHI = (5 ** 0.5 - 1) / 2  # the golden section
TOL = 0.06  # the search ends when the bracket of the share is this narrow
WARM = 0.5  # the share of the first split step, which warms both engines up and is not counted


class SplitPlan(NamedTuple):
    """What the steps of one state's split measured: the host step's seconds per element at
    each share tried (the least of its steps, and the engines' rates then), the last step, and
    how many split steps ran."""

    tried: tuple[tuple[float, float, float, float], ...] = ()  # (share, s/elem, gpu, cpu rate)
    last: Optional[SplitStep] = None
    steps: int = 0


def _key(share: float) -> float:
    return round(share, 6)


def next_share(tried: dict[float, float]) -> tuple[float, str]:
    """The share to take next, from the seconds per element measured at each share tried, and
    the phase: ``"search"``, then ``"settled"``. The CPU kernel alone (0) is measured first;
    then a golden-section search of [0, 1] brackets the least time (the engines share host DRAM
    and the PCIe link, so their rates depend on the share: the time is measured, not modelled);
    once the bracket is narrower than ``TOL`` the share of the least time tried is kept (0: the
    CPU kernel alone, where running both is slower)."""
    if 0.0 not in tried:
        return 0.0, "search"
    lo, hi = 0.0, 1.0
    while hi - lo > TOL:
        x1, x2 = _key(hi - PHI * (hi - lo)), _key(lo + PHI * (hi - lo))
        for x in (x1, x2):
            if x not in tried:
                return x, "search"
        if tried[x1] <= tried[x2]:
            hi = x2
        else:
            lo = x1
    return min(tried, key=lambda x: (tried[x], x)), "settled"


def plan(sizes: list[int], cpu_only: int, memory: SplitPlan, fixed: Optional[float]
         ) -> tuple[float, str, Optional[float], Optional[float]]:
    """The GPU engine's share of ``sizes`` (the elements of the leaves it can step; the CPU
    kernel has ``cpu_only`` more besides), the phase (``"fixed"``: the executor's
    ``gpu_share``; ``"warm-up"``: the first split step, at ``WARM`` so that both engines run
    once, not counted, as their first copies, allocations and kernels' loading would weigh;
    then :func:`next_share`'s), and the times the rates predict for the GPU and the CPU part at
    that share: the rates measured at that share, else the last step's (None without both)."""
    if fixed is not None:
        share, phase = fixed, "fixed"
    elif memory.steps == 0:
        share, phase = WARM, "warm-up"
    else:
        share, phase = next_share({x: t for x, t, _, _ in memory.tried})
    at = {x: (rg, rc) for x, _, rg, rc in memory.tried}
    last = memory.last
    rg, rc = at.get(_key(share), (last.gpu_rate, last.cpu_rate) if last else (0.0, 0.0))
    total = sum(sizes)
    g = share * total
    pg = g / rg if rg > 0 else (0.0 if g == 0 else None)
    pc = (total + cpu_only - g) / rc if rc > 0 else None
    return share, phase, pg, pc


def remember(memory: SplitPlan, share: float, per: Optional[float], step: SplitStep) -> SplitPlan:
    """``memory`` with one more split step, ``step``, taken at the planned ``share``, whose
    host step took ``per`` seconds an element (None: it stepped none). A step of the search or
    settled counts (the least time of the steps at a share is kept); warm-up and fixed ones
    do not."""
    tried = memory.tried
    if step.phase in ("search", "settled") and per is not None:
        key = _key(share)
        old = {x: t for x, t, _, _ in tried}
        if key not in old or per < old[key]:
            tried = tuple(e for e in tried if e[0] != key) + (
                (key, per, step.gpu_rate, step.cpu_rate),)
    return SplitPlan(tried, step, memory.steps + 1)


class Division(NamedTuple):
    """A step's leaves divided between the engines: the share planned (:func:`plan`), the
    phase, the times predicted, the leaves the GPU engine can step and those it steps, and
    what the steps before measured."""

    share: float
    phase: str
    predicted_gpu: Optional[float]
    predicted_cpu: Optional[float]
    able: list[int]
    on_gpu: set[int]
    memory: SplitPlan


def divide(work: HostWork, able: list[int]) -> Division:
    """Leaves ``able`` (host leaves the GPU engine can step) in order to the GPU engine while it
    has less than the planned share of their elements (a leaf that would take it past by more
    than half its size stops it); the CPU kernel has the other host leaves."""
    host = [i for i, leaf in enumerate(work.leaves) if leaf.on_host]
    sizes = [work.leaves[i].param.numel() for i in able]
    rest = sum(work.leaves[i].param.numel() for i in host) - sum(sizes)
    memory = work.cache.split or SplitPlan()
    share, phase, pg, pc = plan(sizes, rest, memory, work.ex.gpu_share)
    on_gpu: set[int] = set()
    goal, taken = share * sum(sizes), 0
    for i, n in zip(able, sizes):  # in order, while the share is not reached
        if taken + n / 2 > goal:
            break
        on_gpu.add(i)
        taken += n
    return Division(share, phase, pg, pc, able, on_gpu, memory)


def record(work: HostWork, d: Division, gs: list, begun: float, gpu_end: Optional[float],
           cpu_end: Optional[float]) -> None:
    """The step's :class:`SplitStep` (the engines' times from ``begun`` to their ends, None
    where one stepped nothing), kept with what the steps before measured (the next step's
    plan) and on the executor. ``gs``: per leaf, not None where it had a grad."""
    leaves, memory = work.leaves, d.memory
    last = memory.last
    size = lambda i: leaves[i].param.numel()  # noqa: E731
    stepped = tuple((leaf.path, "gpu" if i in d.on_gpu else "cpu", size(i))
                    for i, leaf in enumerate(leaves) if leaf.on_host and gs[i] is not None)
    g_n = sum(n for _, engine, n in stepped if engine == "gpu")
    c_n = sum(n for _, engine, n in stepped if engine == "cpu")
    able_n = sum(size(i) for i in d.able if gs[i] is not None)
    gpu_s = max(0.0, gpu_end - begun) if gpu_end is not None else 0.0
    cpu_s = max(0.0, cpu_end - begun) if cpu_end is not None else 0.0
    rg = g_n / gpu_s if g_n and gpu_s > 0 else (last.gpu_rate if last else 0.0)
    rc = c_n / cpu_s if c_n and cpu_s > 0 else (last.cpu_rate if last else 0.0)
    step = SplitStep(g_n / able_n if able_n else d.share,
                     tuple(path for path, engine, _ in stepped if engine == "gpu"),
                     g_n, c_n, d.predicted_gpu, d.predicted_cpu, gpu_s, cpu_s, rg, rc,
                     d.phase, stepped)
    per = max(gpu_s, cpu_s) / (g_n + c_n) if g_n + c_n else None
    work.cache.split = remember(memory, d.share, per, step)
    work.ex.last_split = step


class Split:
    """The split form (see the module)."""

    def __init__(self, work: HostWork, speculative: bool = False):
        self.work = work
        # a speculative step's CPU part runs ahead into spare buffers, committed at finish
        self.cpu = Speculative(work) if speculative else InPlace(work)
        self.gpu = GpuEngine(work)
        self.ahead = self.cpu.ahead
        host = [i for i, leaf in enumerate(work.leaves) if leaf.on_host]
        self.division = divide(work, [i for i in host if engine_steps(work, i)])
        self.on_gpu = self.division.on_gpu

    def starts_ahead(self, index: int) -> bool:
        return index not in self.on_gpu and self.cpu.starts_ahead(index)

    def start(self, index: int, grad: torch.Tensor) -> None:
        self.cpu.start(index, grad)

    def close(self) -> None:
        self.cpu.close()

    def settle(self) -> None:
        self.cpu.settle()

    def finish(self, gs: list, rest: list[int], ready: dict) -> None:
        gpu = [i for i in rest if i in self.on_gpu]
        prepared = self.gpu.prepare(gs, gpu)  # nothing handed over yet if this fails
        # (with no leaf on the GPU engine, the CPU kernel runs as engine="cpu" runs it, with
        # every worker: a share of 0 is measured as the CPU kernel alone)
        self.cpu.hand_over(gs, [i for i in rest if i not in self.on_gpu], ready,
                           threaded=bool(gpu))
        self.cpu.end_hand_over()  # its runs end when done: the CPU kernel's time is its own
        begun = time.perf_counter()
        try:
            self.gpu.run_prepared(prepared)
        except BaseException:
            self.cpu.cancel()
            try:
                self.cpu.wait_all()
            except BaseException:  # noqa: BLE001 - the engine's error is the one raised
                pass
            raise
        gpu_end = time.perf_counter()
        self.cpu.wait_all()
        ended = [r.ended_at for r in self.cpu.all_runs() if r.ended_at is not None]
        record(self.work, self.division, gs, begun, gpu_end, max(ended) if ended else None)

    def commit(self) -> None:
        self.gpu.commit()
        self.cpu.commit()

    def cancel(self) -> None:
        self.cpu.cancel()

    def touched(self) -> bool:
        return self.gpu.touched() or self.cpu.touched()

    def handed_in_place(self) -> bool:
        return self.cpu.handed_in_place()

    def release(self) -> None:
        self.gpu.release()
        self.cpu.release()
