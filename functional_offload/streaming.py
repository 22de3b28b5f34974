"""Grad streaming: start the host step while backward still runs."""

from __future__ import annotations

import queue as queue_mod
import threading
from typing import Any, Optional

import optree
import torch

from functional_offload.base import Optimizer, params_of
from functional_offload.optimizers._terminal import Terminal
from functional_offload.typing import Params

__all__ = ["GradStream", "stream"]


class GradStream:
    """One streamed step; made by :func:`stream`, used as a context manager around backward.

    For a terminal optimizer, inside the ``with`` block a hook on each host-resident param (a
    leaf tensor that requires grad) takes its ``.grad`` as soon as autograd has accumulated it
    and feeds it to one executor run (copy down, CPU kernel, copy up), which cuts chunks from
    the leaves that have arrived as ring slots free. :meth:`finish` waits for the tail, updates
    the other leaves and returns ``(params, state)`` — bit for bit what ``opt.update`` returns
    for the grads ``{path: p.grad}``. With transforms in front of the optimizer nothing starts
    during backward, and :meth:`finish` is that ``opt.update``.
    """

    def __init__(self, opt: Optimizer, state: Any, terminal: Optional[Terminal]):
        self.opt, self.state, self.terminal = opt, state, terminal
        self.leaves: list = []
        self.hooked: list[int] = []
        if terminal is not None:
            n = terminal._begin(state)
            self.leaves = terminal._leaves(state)
            self.decay = terminal._decay_flags(state.params.tree)
            self.hyper, self.hyper0 = terminal._hypers(n)
            self.hooked = [i for i, leaf in enumerate(self.leaves)
                           if leaf.on_host and leaf.param.is_leaf and leaf.param.requires_grad]
        self.arrived: set[int] = set()  # leaves handed to the executor during backward
        self.queues: dict[torch.device, "queue_mod.Queue"] = {}  # per device: one run's arrivals
        self.errors: list[BaseException] = []
        self.handles: list[Any] = []
        self.drivers: list[threading.Thread] = []
        self.finished = False

    def __enter__(self) -> "GradStream":
        if not self.hooked:
            return self
        for i in self.hooked:
            self.handles.append(self.leaves[i].param.register_post_accumulate_grad_hook(
                lambda p, i=i: self._arrive(i, p.grad)))
        kernel = self.terminal._host_kernel(any(self.leaves[i].param.is_cuda for i in self.hooked),
                                            [(self.leaves[i].value, *self.leaves[i].moments)
                                             for i in self.hooked])
        for device in dict.fromkeys(self.leaves[i].param.device for i in self.hooked):
            q = self.queues[device] = queue_mod.Queue()
            self.drivers.append(threading.Thread(target=self._drive, args=(q, kernel),
                                                 name="fo-stream", daemon=True))
            self.drivers[-1].start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for q in self.queues.values():
            q.put(None)  # no more leaves: each run ends after the queued ones

    def _arrive(self, i: int, g: Optional[torch.Tensor]) -> None:
        leaf = self.leaves[i]
        if i in self.arrived:
            self.errors.append(RuntimeError(
                f"param {leaf.path!r} got a second gradient in one streamed step; "
                "stream only the last backward of an accumulation"))
            return
        if g is None:
            return
        try:
            self.terminal._check_grads({0: g}, {0: leaf.param}, [leaf])
        except (TypeError, ValueError) as e:
            self.errors.append(e)
            return
        self.arrived.add(i)
        h = self.hyper if self.decay[i] else self.hyper0
        with torch.no_grad():
            host_leaf = self.terminal._host_leaf(leaf, g, leaf.param.detach().view(-1), h)
        # its copies wait for this event: the grad is complete on the stream that made it
        self.queues[leaf.param.device].put((host_leaf, self.terminal.executor.ready(g.device)))

    def _drive(self, arrivals: "queue_mod.Queue", kernel: Any) -> None:
        """One executor run for the leaves of one device, fed as they arrive."""
        try:
            self.terminal.executor.run_stream(arrivals, kernel)
        except BaseException as e:
            self.errors.append(e)

    def finish(self) -> tuple[Params, Any]:
        """Wait for the streamed leaves, update the rest; return ``(params, new state)``."""
        if self.finished:
            raise RuntimeError("this GradStream already finished; start a new one per step")
        self.finished = True
        self.__exit__()
        for driver in self.drivers:
            driver.join()
        if self.errors:
            raise RuntimeError(f"streamed update failed: {type(self.errors[0]).__name__}: "
                               f"{self.errors[0]}") from self.errors[0]
        t = self.terminal
        if t is None:  # transforms in front: every grad was needed first
            grads = optree.tree_map(lambda p: p.grad, params_of(self.state))
            return self.opt.update(grads, self.state)
        for device in self.queues:
            t.executor.order_after_copies(device)
        gs = [None if i in self.arrived else leaf.param.grad for i, leaf in enumerate(self.leaves)]
        gs = t._check_grads(gs, [leaf.param for leaf in self.leaves], self.leaves)
        return self.state.params.tree, t._apply(self.state, self.leaves, gs, self.decay,
                                                self.hyper, self.hyper0)


def stream(opt: Optimizer, state: Any) -> GradStream:
    r"""Stream the next backward's grads into the update of ``opt``.

    The host step can only start once grads exist; streaming starts each host-resident leaf's
    step as soon as autograd has accumulated its grad, so the copies and the CPU kernel of the
    last layers run while backward computes the first ones, and :meth:`GradStream.finish` waits
    only for the tail. The result equals ``opt.update({path: p.grad}, state)`` bit for bit.

    Usage (params are leaf tensors that require grad, e.g. a module's parameters)::

        with fo.stream(opt, state) as s:
            loss.backward()
        params, state = s.finish()

    ``opt`` is a terminal optimizer (adamw, adam, sgd) or any chain ending in one, e.g.
    ``apply_if_finite(chain(clip_by_global_norm(1.0), adamw(...)))``. A transform in front
    needs every grad before any moment may move (the global norm, the non-finite flag), so
    then nothing starts during backward: ``finish`` runs ``opt.update`` on the grads, whose host
    step still overlaps its own copies with the CPU kernel; ``delayed=True`` hides the step
    behind the next forward and backward instead, clipping included.

    Stream one backward per step (the last micro-batch of an accumulation).
    """
    if not isinstance(opt, Optimizer):
        raise TypeError(f"fo.stream takes an Optimizer (adamw, adam, sgd, or a chain ending in "
                        f"one), got a {type(opt).__name__}")
    terminal = getattr(opt.update, "__self__", None)
    if not isinstance(terminal, Terminal):
        params_of(state)  # raises for a state that references no params
        return GradStream(opt, state, None)
    if terminal.delayed:
        raise ValueError("grad streaming and delayed=True are two ways to hide the host step; "
                         "build the optimizer with one of them")
    return GradStream(opt, state, terminal)
