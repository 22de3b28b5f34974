"""Plain steps of an executor with ``engine="both"``: the host-resident leaves are divided
between the GPU engine (:mod:`~functional_offload.optimizers.forms.gpu_engine`) and the CPU
kernel (:mod:`~functional_offload.optimizers.forms.in_place`), which run at once. The engine's
part is prepared first (chunks, device buffers: what can fail before anything is written); the
CPU kernel's leaves are then handed to runs of their own threads (one worker fewer than the
executor's, the step's thread issuing the engine's copies and math), the GPU engine steps its
leaves in the step's thread, and the step ends when both have. An error in the engine cancels
the CPU kernel's runs and is the one raised.

The engine is bound by PCIe (24 bytes per fp32-state param up and down), the kernel by host
DRAM, which the engine's copies also use. Which leaves go where: leaves in order go to the
GPU engine while it has less than ``share`` of the elements with a grad it can step (a leaf
that would take it past by more than half its size stops it), the rest to the CPU kernel,
which also takes the small packed leaves and those the engine does not step (quantized params,
leaves of a length not divisible by 4 with a split master or 8-bit moments over a chunk). ``share`` is the executor's ``gpu_share`` if set, else planned
from the rates known (the :class:`~functional_offload.executor.SplitStep` of the step before):
halfway from the last share to the one at which both would take as long; 0.5 at the first
step, and a quarter towards an engine whose rate is not known yet. Leaves the CPU kernel takes
start as soon as they are fed (grad streaming), the engine's at ``finish``.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from functional_offload.executor import SplitStep
from functional_offload.optimizers.forms.base import HostWork
from functional_offload.optimizers.forms.gpu_engine import GpuEngine, steppable
from functional_offload.optimizers.forms.in_place import InPlace
from functional_offload.quantized import is_quantized

__all__ = ["Split", "engine_steps", "plan"]


def engine_steps(work: HostWork, index: int) -> bool:
    """Whether the GPU engine can step host leaf ``index`` (not packed, a plain param, formats
    it can cut: :func:`~functional_offload.optimizers.forms.gpu_engine.steppable`)."""
    leaf = work.leaves[index]
    return (leaf.on_host and index not in work.static.packed and not is_quantized(leaf.param)
            and steppable(leaf, work.ex.chunk_bytes))


def plan(sizes: list[int], cpu_only: int, last: Optional[SplitStep],
         fixed: Optional[float]) -> tuple[float, Optional[float], Optional[float]]:
    """The GPU engine's share of ``sizes`` (the elements of the leaves it can step; the CPU
    kernel has ``cpu_only`` more besides), and the times the rates known from ``last`` predict
    for the GPU and the CPU part at that share (None without both rates)."""
    total = sum(sizes)
    rg, rc = (last.gpu_rate, last.cpu_rate) if last is not None else (0.0, 0.0)
    if fixed is not None:
        share = fixed
    elif rg > 0 and rc > 0 and total:
        # the GPU's elements g where g / rg == (total + cpu_only - g) / rc
        balanced = min(1.0, rg * (total + cpu_only) / (rg + rc) / total)
        share = (last.share + balanced) / 2
    elif last is not None and total:  # an engine not measured yet: a quarter towards it
        share = min(1.0, last.share + 0.25) if rc > 0 else max(0.0, last.share - 0.25)
    else:
        share = 0.5
    if rg > 0 and rc > 0:
        g = share * total
        return share, g / rg, (total + cpu_only - g) / rc
    return share, None, None


class Split:
    """The split form (see the module)."""

    def __init__(self, work: HostWork):
        self.work = work
        self.cpu = InPlace(work)
        self.gpu = GpuEngine(work)
        self.ahead = self.cpu.ahead
        host = [i for i, leaf in enumerate(work.leaves) if leaf.on_host]
        able = [i for i in host if engine_steps(work, i)]
        sizes = [work.leaves[i].param.numel() for i in able]
        rest = sum(work.leaves[i].param.numel() for i in host) - sum(sizes)
        self.share, self.predicted_gpu, self.predicted_cpu = plan(
            sizes, rest, work.cache.split, work.ex.gpu_share)
        self.able = able
        self.on_gpu: set[int] = set()
        goal, taken = self.share * sum(sizes), 0
        for i, n in zip(able, sizes):  # in order, while the share is not reached
            if taken + n / 2 > goal:
                break
            self.on_gpu.add(i)
            taken += n

    def starts_ahead(self, index: int) -> bool:
        return index not in self.on_gpu and self.cpu.starts_ahead(index)

    def start(self, index: int, grad: torch.Tensor) -> None:
        self.cpu.start(index, grad)

    def close(self) -> None:
        self.cpu.close()

    def settle(self) -> None:
        pass

    def finish(self, gs: list, rest: list[int], ready: dict) -> None:
        gpu = [i for i in rest if i in self.on_gpu]
        prepared = self.gpu.prepare(gs, gpu)  # nothing handed over yet if this fails
        self.cpu.hand_over(gs, [i for i in rest if i not in self.on_gpu], ready, threaded=True)
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
        self._record(gs, gpu, begun, gpu_end)

    def _record(self, gs: list, gpu: list[int], begun: float, gpu_end: float) -> None:
        """This step's :class:`SplitStep`, kept for the next step's plan and the executor."""
        leaves, last = self.work.leaves, self.work.cache.split
        size = lambda i: leaves[i].param.numel()  # noqa: E731
        g_n = sum(map(size, gpu))
        c_n = sum(size(i) for i, leaf in enumerate(leaves)
                  if leaf.on_host and gs[i] is not None and i not in self.on_gpu)
        able_n = sum(size(i) for i in self.able if gs[i] is not None)
        ended = [r.ended_at for r in self.cpu.all_runs() if r.ended_at is not None]
        gpu_s, cpu_s = gpu_end - begun, max(0.0, max(ended) - begun) if ended else 0.0
        rg = g_n / gpu_s if g_n and gpu_s > 0 else (last.gpu_rate if last else 0.0)
        rc = c_n / cpu_s if c_n and cpu_s > 0 else (last.cpu_rate if last else 0.0)
        step = SplitStep(g_n / able_n if able_n else self.share, tuple(leaves[i].path for i in gpu),
                         g_n, c_n, self.predicted_gpu, self.predicted_cpu, gpu_s, cpu_s, rg, rc)
        self.work.cache.split = step
        self.work.ex.last_split = step

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
