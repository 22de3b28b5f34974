"""What every host form shares: the protocol, and the step's host work (:class:`HostWork`):
the leaves' kernel, the executor runs it opens, the host leaves it hands them."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from functional_offload.executor import HostLeaf, Run
from functional_offload.kernels.remainder import is_lean, is_split
from functional_offload.kernels.host import host_kernel
from functional_offload.kernels.work import Kernel
from functional_offload.base import StepCache
from functional_offload.optimizers.layout import Leaf, Static, TerminalLike, viewed, with_flat_views

__all__ = ["AtFinish", "HostForm", "HostWork", "by_device", "raise_run_errors", "wait_runs"]


class HostForm(Protocol):
    """How a step's host-resident leaves run (one form per step, chosen by
    :func:`~functional_offload.optimizers.forms.form_for`).

    ``feed`` hands a leaf over at once where ``starts_ahead`` says so (grad streaming); at
    the step's ``finish``, ``settle`` runs before the device math and ``finish`` after it,
    handing over the rest and waiting for them; ``commit`` writes what waits for every run's success; on an error, ``cancel`` stops
    the runs and ``touched`` says whether anything may have been written in place
    (``handed_in_place`` is the same question at ``abort``, before ``finish``)."""

    ahead: set[int]  # leaves handed over by feed

    def starts_ahead(self, index: int) -> bool: ...

    def start(self, index: int, grad: torch.Tensor) -> None: ...

    def close(self) -> None: ...

    def settle(self) -> None: ...

    def finish(self, gs: list, rest: list[int], ready: dict) -> Optional[Any]:
        """Hand over ``rest`` (leaves with a grad not handed over yet) and wait for all; what
        lands later (a delayed step's landing), or None."""

    def commit(self) -> None: ...

    def cancel(self) -> None: ...

    def touched(self) -> bool: ...

    def handed_in_place(self) -> bool: ...

    def release(self) -> None: ...


class AtFinish:
    """The defaults of a form whose leaves all start at ``finish`` and write nothing that waits
    for success: nothing is handed over ahead, so nothing to close, settle, commit or cancel."""

    def __init__(self, work: "HostWork"):
        self.work = work
        self.ahead: set[int] = set()

    def starts_ahead(self, index: int) -> bool:
        return False

    def start(self, index: int, grad: torch.Tensor) -> None:
        raise AssertionError(f"{type(self).__name__} starts nothing ahead")

    def close(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    def handed_in_place(self) -> bool:
        return False

    def release(self) -> None:
        pass


def wait_runs(runs: dict) -> None:
    for run in runs.values():
        run.close()
    for run in runs.values():
        run.wait()


def raise_run_errors(runs: dict) -> None:
    for run in runs.values():
        if run.error is not None:
            raise run.error


def by_device(idx: list[int], gs: list) -> dict[torch.device, list[int]]:
    """``idx`` by the device of their grads."""
    out: dict[torch.device, list[int]] = {}
    for i in idx:
        out.setdefault(gs[i].device, []).append(i)
    return out


class HostWork:
    """A step's host leaves and what runs them: the leaves' kernel (kept in the state's cache
    with their layout), executor runs opened per device, the host leaves handed to them.
    ``ahead``: the next step's ``(hyper, hyper_no_decay)`` where the leaves are to leave
    look-aheads (a delayed step, :class:`~functional_offload.Delay`), else None; ``held_ahead``:
    the leaves whose params the device holds are a look-ahead's, landed by this update."""

    def __init__(self, t: TerminalLike, leaves: list[Leaf], cache: StepCache,
                 hyper: Any, hyper_no_decay: Any):
        self.t, self.leaves, self.cache = t, leaves, cache
        self.hyper, self.hyper_no_decay = hyper, hyper_no_decay
        self.ahead: Optional[tuple[Any, Any]] = None
        self.held_ahead: set[int] = set()
        self.ex = t.executor
        self._kernel: Optional[Kernel] = None
        self._views_checked = False

    @property
    def static(self) -> Static:
        return self.cache.static

    def hyper_of(self, leaf: Leaf) -> Any:
        return self.hyper if leaf.decay else self.hyper_no_decay

    def check_views(self) -> bool:
        """Once per step, before a host leaf is handed over: remake the 1-D views of the host
        leaves whose tensors' storages were replaced since (a committed speculative step swaps
        them; ``param.data = ...`` or ``state.mu[k].data = ...`` replace them). True if any was."""
        if self._views_checked:
            return False
        self._views_checked = True
        st = self.cache.static
        if [x.data_ptr() for _, x in st.viewed] == st.view_ptrs:
            return False
        for i in sorted({i for (i, x), ptr in zip(st.viewed, st.view_ptrs) if x.data_ptr() != ptr}):
            self.leaves[i] = with_flat_views(self.leaves[i])  # the layout's list: kept for later steps
        st.viewed[:], st.view_ptrs[:] = viewed(self.leaves)
        return True

    def kernel(self) -> Kernel:
        """The host kernel of these leaves, kept in the state's cache with their layout while
        the leaves' tensors and ``cpu_kernel`` stay the same."""
        if self._kernel is None:
            cache = self.cache
            if self.check_views():
                cache.invalidate("views")
            if cache.kernel is None or cache.kernel[0] != self.t.cpu_kernel:
                spec = self.t.spec
                cache.kernel = (self.t.cpu_kernel, host_kernel(
                    spec.native, spec.scalars, spec.reference, [m.signed for m in spec.moments],
                    [lf.flat for lf in self.leaves if lf.on_host], self.t.cpu_kernel,
                    spec.ahead, spec.ahead_scalars))
            self._kernel = cache.kernel[1]
        return self._kernel

    def leaf(self, index: int) -> Leaf:
        """Leaf ``index``, once the kernel is picked (which remakes stale views first)."""
        self.kernel()
        return self.leaves[index]

    def run(self, device: torch.device, runs: dict,
            elements: Optional[dict[torch.device, int]] = None, threaded: bool = False) -> Run:
        """The run of ``device`` in ``runs``, opened if needed; ``elements``: per device, the
        total of a run whose leaves are all handed over now; ``threaded``: it runs in a thread
        of its own even then (:meth:`~functional_offload.executor.HostExecutor.open`), with one
        worker fewer."""
        if device not in runs:
            threads = self.t.threads or self.ex.threads
            if threaded:  # one worker fewer: the step's thread has work of its own meanwhile
                threads = max(1, threads - 1)
            runs[device] = self.ex.open(device, self.kernel(), threads,
                                        elements=None if elements is None else elements[device],
                                        threaded=threaded)
        return runs[device]

    def host_leaf(self, index: int, g: torch.Tensor, out: Optional[torch.Tensor],
                  targets: tuple[torch.Tensor, ...] = (), ema_target: Optional[torch.Tensor] = None,
                  settled: Optional[HostLeaf] = None) -> HostLeaf:
        """Leaf ``index`` for a run: its new param to ``out`` (None: the value is the param, or
        a delayed landing gives it a buffer), its new state to ``targets`` (() in place)."""
        if self._kernel is None:  # (:meth:`leaf`, inlined: this runs once per leaf and step)
            self.kernel()
        leaf = self.leaves[index]
        grad = (g.detach() if g.requires_grad else g).reshape(-1)
        if grad.device.type == "cpu" and not grad.is_contiguous():
            grad = grad.contiguous()  # read where it is by the kernel, which takes dense grads
        split = is_split(leaf.value)
        lean = split and is_lean(leaf.value)  # the high half is the param's: stepped in the
        #                                        ring's slot
        split = split and not lean  # the new param: the high half, copied up
        ahead = None if self.ahead is None else self.ahead[0 if leaf.decay else 1]
        return HostLeaf(leaf.path, grad, out, leaf.flat, self.hyper_of(leaf), targets,
                        leaf.ema_flat, self.t.ema_decay or 0.0, ema_target, settled,
                        (targets or leaf.flat)[0] if split else None, ahead_hyper=ahead,
                        param_high=lean)
