"""Host math that is not element-wise (Adafactor's row and column means): each host leaf runs
whole, one at a time (:func:`~functional_offload.executor.leaves.run_leaves`), at finish."""

from __future__ import annotations

from typing import Optional

import torch

from functional_offload.executor.leaves import LeafItem, run_leaves
from functional_offload.kernels.remainder import high, is_split, join, split_
from functional_offload.optimizers.forms.base import AtFinish, HostWork, by_device

__all__ = ["LeafGranular"]


class LeafGranular(AtFinish):
    """The leaf-granular form (see the module)."""

    def __init__(self, work: HostWork):
        super().__init__(work)
        self.begun: list[str] = []  # the leaves whose math began

    def _item(self, index: int, g: torch.Tensor) -> LeafItem:
        work = self.work
        leaf = work.leaves[index]
        hyper, spec, decay = work.hyper_of(leaf), work.t.spec, work.t.ema_decay

        def fn(grad: torch.Tensor, out: Optional[torch.Tensor]) -> None:
            split = is_split(leaf.value)  # both halves (a whole leaf's fp32 value for its math)
            value = join(leaf.value) if split else leaf.value
            spec.reference([value], [grad], [[m] for m in leaf.moments], hyper)
            if split:
                split_(leaf.value, value)
            if out is not None:
                out.copy_(high(leaf.value) if split else value)
            if leaf.ema is not None:
                leaf.ema.lerp_(value, 1 - (decay or 0.0))

        return LeafItem(leaf.path, g, leaf.param if leaf.has_master else None, fn)

    def finish(self, gs: list, rest: list[int], ready: dict) -> None:
        ex = self.work.ex
        for device, idx in by_device(rest, gs).items():
            run_leaves(ex, device, [self._item(i, gs[i]) for i in idx], ready[device], self.begun)
            ex.order_after_copies(device)

    def touched(self) -> bool:
        return bool(self.begun)
