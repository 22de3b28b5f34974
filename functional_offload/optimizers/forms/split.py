"""Plain steps of an executor with ``engine="both"``: the host-resident leaves are divided
between the GPU engine (:mod:`~functional_offload.optimizers.forms.gpu_engine`) and the CPU
kernel (:mod:`~functional_offload.optimizers.forms.in_place`), which run at once. The CPU
kernel's leaves are handed to runs of their own threads first; the GPU engine then steps its
leaves in the step's thread; the step ends when both have.

The two are bound by different resources (the engine by PCIe, 24 bytes per fp32-state param up
and down; the kernel by host DRAM), so together they finish sooner than either alone. Which
leaves go where: leaves in order go to the GPU engine until ``share`` of the elements it can
step are its, the rest to the CPU kernel, which also takes the small packed leaves and those the
engine does not step (quantized params, split masters, 8-bit moments). ``share`` is the
executor's ``gpu_share`` if set, else planned from the step before (its
:class:`~functional_offload.executor.SplitStep`): from each engine's rate in it, the share at
which both would take as long, halfway from the last one (half at the first step). Leaves the
CPU kernel takes start as soon as they are fed (grad streaming), the engine's at ``finish``.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from functional_offload.executor import SplitStep
from functional_offload.kernels.remainder import is_split
from functional_offload.optimizers.forms.base import HostWork
from functional_offload.optimizers.forms.gpu_engine import GpuEngine
from functional_offload.optimizers.forms.in_place import InPlace
from functional_offload.quantized import is_quantized

__all__ = ["Split", "engine_steps", "plan"]


def engine_steps(work: HostWork, index: int) -> bool:
    """Whether the GPU engine can step host leaf ``index`` (not packed, a plain param, a whole
    master, no 8-bit moment)."""
    leaf = work.leaves[index]
    return (leaf.on_host and index not in work.static.packed and not is_quantized(leaf.param)
            and not is_split(leaf.value)
            and not any(m is not None and m.dtype == torch.uint8 for m in leaf.moments))


def plan(sizes: list[int], cpu_only: int, last: Optional[SplitStep],
         fixed: Optional[float]) -> tuple[float, Optional[float], Optional[float]]:
    """The GPU engine's share of ``sizes`` (the elements of the leaves it can step; the CPU
    kernel has ``cpu_only`` more besides), and the times the rates of ``last`` predict for the
    GPU and the CPU part at that share (None without rates)."""
    total = sum(sizes)
    rg, rc = last.rates() if last is not None else (0.0, 0.0)
    if fixed is not None:
        share = fixed
    elif rg > 0 and rc > 0 and total:
        # the GPU's elements g where g / rg == (total + cpu_only - g) / rc
        balanced = min(1.0, rg * (total + cpu_only) / (rg + rc) / total)
        share = (last.share + balanced) / 2
    elif last is not None and total:  # one engine stepped nothing: move towards it
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
        begun = time.perf_counter()
        self.cpu.hand_over(gs, [i for i in rest if i not in self.on_gpu], ready, threaded=True)
        try:
            self.gpu.finish(gs, gpu, ready)
        finally:  # the CPU kernel's runs end before anything else happens to the state
            gpu_end = time.perf_counter()
            self.cpu.wait_all()
        ended = [r.ended_at for r in self.cpu.all_runs() if r.ended_at is not None]
        leaves = self.work.leaves
        step = SplitStep(
            self.share, tuple(leaves[i].path for i in gpu),
            sum(leaves[i].param.numel() for i in gpu),
            sum(leaves[i].param.numel() for i in range(len(leaves))
                if leaves[i].on_host and gs[i] is not None and i not in self.on_gpu),
            self.predicted_gpu, self.predicted_cpu, gpu_end - begun,
            (max(ended) - begun) if ended else 0.0)
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
