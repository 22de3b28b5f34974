"""Combinators: ``chain``, and the steps that combinators and wrappers build on.

- :func:`chain` and its step (``_Chained``: a step run ahead behind clipping, committed or redone).
- :class:`HeldStep`, the step of an optimizer that cannot start before every grad is known.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import optree
import torch

from functional_offload.base import (GradientTransformation, Optimizer, OptimizerUpdateFn, Step,
                                     StepBase)
from functional_offload.state import (check_usable, claim, grads_for, mark_tensors, params_of,
                                      release, stepped, terminal_counts, terminal_states)
from functional_offload.tree import flatten_like
from functional_offload.typing import OptState, Params, Updates

__all__ = ["chain", "HeldStep", "merge_grads"]

AnyTransformation = Union[GradientTransformation, Optimizer]


def chain(*transforms: AnyTransformation) -> AnyTransformation:
    """Apply transformations in sequence; the last one may be a terminal :class:`Optimizer`.

    ``chain(t1, ..., tn)`` feeds the gradients through ``t1 ... tn``. Its state is the tuple
    ``(s1, ..., sn)`` of the parts' states. It is an :class:`Optimizer` when ``tn`` is one (its
    ``update`` returns params), else a :class:`GradientTransformation`.

    A chain ending in an optimizer can be streamed (``begin``): when every transform in front
    has a ``global_scale`` (clipping), the step runs ahead as if every factor were 1 and is
    committed if they are (bit for bit what ``update`` gives) or redone with the true factors;
    otherwise the grads are held until ``finish`` runs ``update``.

    Example::

        opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=1e-3))
        state = opt.init(params)
        params, state = opt.update(grads, state)
    """
    if not transforms:
        raise ValueError("chain() needs at least one transformation")
    for i, t in enumerate(transforms):
        if not isinstance(t, (GradientTransformation, Optimizer)):
            raise TypeError(f"chain argument {i} is a {type(t).__name__}, expected a "
                            "GradientTransformation or an Optimizer")
        if isinstance(t, Optimizer) and i != len(transforms) - 1:
            raise TypeError(f"chain argument {i} is a terminal Optimizer (it returns params); "
                            "only the last element of a chain may be one")
    *front, last = transforms

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def check_state(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain state must be a tuple of {len(transforms)} states (the one "
                             f"init returned); got {type(state).__name__}")

    def update(updates: Updates, state: tuple) -> tuple[Any, tuple]:
        check_state(state)
        if isinstance(last, GradientTransformation):
            return _through(transforms, updates, state)
        check_usable(state, "update")
        grads_for(updates, state[-1])
        counts = terminal_counts(state[-1])
        marks = [(x, int(x)) for x in mark_tensors(state[:-1])]
        try:
            return _through(transforms, updates, state)
        except BaseException:
            # the front's transforms are pure: their states are as they were but for their
            # marks, so a terminal step that did not happen leaves the whole chain usable
            if not stepped(state[-1], counts):
                release(marks)
            raise

    if isinstance(last, GradientTransformation):
        return GradientTransformation(init, update)

    def begin(state: tuple, speculative: bool = False) -> Step:
        check_state(state)
        if last.begin is None or not all(t.global_scale is not None for t in front):
            return HeldStep(update, state)
        if not front:
            return _Chained(last.begin(state[-1], speculative), None, state, update)
        notes = terminal_states(state[-1])[0].params.notes
        ahead = notes is None or notes.get("scale_was_one", True)
        inner = last.begin(state[-1], True) if ahead else HeldStep(last.update, state[-1])
        return _Chained(inner, front, state, update)

    return Optimizer(init, update, begin)


def _through(transforms: tuple, updates: Updates, state: tuple) -> tuple[Any, tuple]:
    new = []
    for t, s in zip(transforms, state):
        updates, s = t.update(updates, s)
        new.append(s)
    return updates, tuple(new)


class HeldStep(StepBase):
    """A :class:`Step` for optimizers that cannot start before every grad is known: ``feed``
    holds the grads, ``finish`` runs ``update`` on them. The state is marked busy meanwhile."""

    def __init__(self, update: OptimizerUpdateFn, state: OptState):
        self.update, self.state = update, state
        self.params = params_of(state)
        self.spec = optree.tree_structure(self.params)
        self.fed: dict[int, torch.Tensor] = {}
        self.finished = False
        self.marks = claim(state, "update")

    def _unmark(self) -> None:
        release(self.marks)
        self.marks = []

    def feed(self, index: int, grad: torch.Tensor) -> None:
        if index in self.fed:
            raise RuntimeError(f"leaf {index} got a second gradient in one step")
        self.fed[index] = grad

    def finish(self, grads: Updates = None) -> tuple[Params, OptState]:
        if self.finished:
            raise RuntimeError("this step already finished; begin a new one for each update")
        self.finished = True
        self._unmark()
        full = merge_grads(self.spec, self.fed, grads)
        self.fed.clear()
        return self.update(full, self.state)

    def abort(self) -> None:
        self.finished = True
        self._unmark()

    def close(self) -> None:
        """Nothing was started: nothing to close."""


def merge_grads(spec: optree.PyTreeSpec, fed: dict[int, torch.Tensor], grads: Updates) -> Updates:
    """A grads tree of structure ``spec``: the fed grads by leaf index, the rest from ``grads``."""
    if grads is None:
        rest = [None] * spec.num_leaves
    else:
        rest = flatten_like(grads, optree.tree_unflatten(spec, [0] * spec.num_leaves), "grads")
    return optree.tree_unflatten(spec, [fed.get(i, g) for i, g in enumerate(rest)])


class _Chained(StepBase):
    """A chain's step: the terminal's step fed the raw grads; the front's factors (if any)
    decide at ``finish`` between committing it and redoing the step through ``update``.

    Whether the factors were 1 is noted in the state's ``ParamRefs.notes``: after a step whose
    factor was not 1 (clipping on) the next step holds its grads instead of running ahead (a
    step run ahead would be redone), until a factor of 1 is seen again."""

    def __init__(self, inner: Step, front: Optional[list], state: tuple, update: OptimizerUpdateFn):
        self.inner, self.front, self.state, self.update = inner, front, state, update
        self.spec = optree.tree_structure(params_of(state[-1]))
        self.fed: dict[int, torch.Tensor] = {}
        self.delayed = front is None and inner.delayed

    def feed(self, index: int, grad: torch.Tensor) -> None:
        self.inner.feed(index, grad)
        self.fed[index] = grad

    def finish(self, grads: Updates = None) -> tuple[Params, OptState]:
        if self.front is None:
            params, s = self.inner.finish(grads)
            return params, (s,)
        try:
            full = merge_grads(self.spec, self.fed, grads)
            self.fed.clear()
            factors = [t.global_scale(full, s) for t, s in zip(self.front, self.state)]
            dev = factors[0].device
            ones = bool(torch.stack([f.detach().float().to(dev) for f in factors]).eq(1).all())
        except BaseException:
            self.inner.abort()
            raise
        notes = terminal_states(self.state[-1])[0].params.notes
        if notes is not None:
            notes["scale_was_one"] = ones
        if isinstance(self.inner, HeldStep):  # nothing ran ahead
            self.inner.abort()
            return self.update(full, self.state)
        if ones:  # every factor is 1: the grads the step ran on are the chain's, bit for bit
            self.committed = True
            params, s = self.inner.finish(grads)
            return params, (*self.state[:-1], s)
        self.committed = False
        self.inner.abort()  # the state is as it was: run the chain as update would
        return self.update(full, self.state)

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()
