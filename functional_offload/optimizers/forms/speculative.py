"""A speculative step (``begin(state, speculative=True)``): host leaves fed ahead of a factor
not known yet (a clip, a finiteness check) write their new state into spare buffers
(``StepCache.spares``, kept for later steps) and their params into device scratch. Finishing
commits: what has not begun runs in place (``Run.settle``); the spare buffers are swapped in
(``Tensor.set_``, no copy) and the params copied, so an abort leaves the state as it was."""

from __future__ import annotations

import torch

from functional_offload.executor import HostLeaf, Run
from functional_offload.optimizers.forms.base import HostWork, raise_run_errors, wait_runs
from functional_offload.optimizers.forms.in_place import InPlace
from functional_offload.optimizers.layout import flat_state
from functional_offload.quantized import write_params, writes_in_place

__all__ = ["Speculative"]


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the storages of ``a`` and ``b`` in place (both keep their identity)."""
    held = torch.empty(0, dtype=a.dtype)
    held.set_(a)
    a.set_(b)
    b.set_(held)


class Speculative(InPlace):
    """The speculative form (see the module); the leaves handed over at finish run in place."""

    def __init__(self, work: HostWork):
        super().__init__(work)
        self.spares = work.cache.spares
        self.forms: dict[int, int] = {}  # id of each host leaf handed over ahead -> its leaf
        self.scratch: dict[int, torch.Tensor] = {}  # new params awaiting commit
        self.committed = False  # the swap has begun: the state is changed

    def starts_ahead(self, index: int) -> bool:
        return super().starts_ahead(index) and self.work.leaves[index].has_master

    def _spare(self, index: int) -> tuple[torch.Tensor, ...]:
        """Host buffers like the leaf's (value, moments..., ema), kept for later steps."""
        if index not in self.spares:
            leaf = self.work.leaves[index]
            self.spares[index] = tuple(  # pinned like the leaf's: a split value is copied up
                torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_pinned())
                for x in (leaf.value, *leaf.moments) + ((leaf.ema,) if leaf.ema is not None else ()))
        return self.spares[index]

    def ahead_leaf(self, index: int, g: torch.Tensor) -> HostLeaf:
        leaf = self.work.leaf(index)
        spare = self._spare(index)
        k = 1 + len(leaf.moments)
        out = self.scratch[index] = torch.empty(leaf.param.numel(), dtype=leaf.param.dtype,
                                                device=leaf.param.device)
        if out.is_cuda:  # freed on abort while a copy out may still write it
            out.record_stream(self.work.ex.transport(out.device).stream_out)
        # once the step is known to commit: in place
        settled = self.in_place_leaf(index, g) if writes_in_place(leaf.param) else None
        form = self.work.host_leaf(index, g, out, flat_state(spare[0], spare[1:k], leaf.param),
                                   spare[k].view(-1) if leaf.ema is not None else None, settled)
        self.forms[id(form)] = index
        return form

    def settle(self) -> None:
        """What ran ahead must have succeeded before anything else changes; finishing commits:
        what has not begun runs in place."""
        if self.runs:
            for run in self.runs.values():
                run.settle()
            wait_runs(self.runs)
            raise_run_errors(self.runs)

    def finish_runs(self) -> dict:
        return self.rest_runs

    def commit(self) -> None:
        """Swap the spare buffers in, copy the new params to the device, then the in-place
        form's write-backs."""
        super().commit()
        if self.ahead:
            self._swap_in()

    def touched(self) -> bool:
        return super().touched() or self.committed

    def _swap_in(self) -> None:
        self.committed = True
        leaves = self.work.leaves
        switched = {self.forms[id(form)] for run in self.runs.values() for form in run.switched}
        for i in sorted(self.ahead):
            leaf = leaves[i]
            if i in switched:  # ran in place
                self.scratch.pop(i, None)
                continue
            mine = (leaf.value, *leaf.moments) + ((leaf.ema,) if leaf.ema is not None else ())
            for a, b in zip(mine, self.spares[i]):
                _swap(a, b)
        by_device: dict[torch.device, list[int]] = {}
        for i in self.scratch:
            by_device.setdefault(leaves[i].param.device, []).append(i)
        for device, idx in by_device.items():
            write_params([leaves[i].param for i in idx],  # strided ones too
                         [self.scratch[i].view(leaves[i].param.shape) for i in idx])
            for i in idx:
                if device.type == "cuda":
                    self.scratch[i].record_stream(torch.cuda.current_stream(device))
        self.scratch.clear()

    def in_place_runs(self) -> list[Run]:
        return [*self.rest_runs.values(), *(r for r in self.runs.values() if r.switched)]

    def handed_in_place(self) -> bool:
        return False  # what was handed over wrote spare buffers and scratch

    def release(self) -> None:
        super().release()
        self.scratch.clear()
        self.forms.clear()
