"""Combinators: ``chain``, and the steps that combinators and wrappers build on.

- :func:`chain` and its step (``_Chained``: a step run ahead behind clipping, committed or redone).
- :class:`HeldStep`, the step of an optimizer that cannot start before every grad is known,
  and :func:`begin_step`, which begins an optimizer's own step or else a held one.
- :class:`Wrapped`, the base of a wrapper's step around an inner optimizer's step
  (``apply_if_finite``, ``inject_hyperparams``, ``MultiSteps``), and :func:`run_inner`, the one
  place an interrupt after a completed inner step is reconciled with the wrapper's state.
- :func:`fresh_leaves` and :func:`keeping`: the grads a ``fresh_updates`` transform made, handed
  to the terminal step after it to keep.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import optree
import torch

from functional_offload.base import (GradientTransformation, Optimizer, OptimizerUpdateFn, Step,
                                     StepBase, StepCache)
from functional_offload.state import (check_usable, claim, grads_for, mark_tensors, params_of,
                                      release, stepped, terminal_counts, terminal_states)
from functional_offload.tree import flatten_like, local
from functional_offload.typing import OptState, Params, Updates

__all__ = ["chain", "HeldStep", "merge_grads", "begin_step", "run_inner", "through", "Wrapped",
           "fresh_leaves", "keeping"]

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
            return through(transforms, updates, state)
        check_usable(state, "update")
        grads_for(updates, state[-1])
        counts = terminal_counts(state[-1])
        marks = [(x, int(x)) for x in mark_tensors(state[:-1])]
        try:
            caches = [s.params.cache for s in terminal_states(state[-1])
                      if s.params.cache is not None]
            given = updates
            updates, front_state = through(front, updates, state[:-1],
                                           caches if any(c.wants_scale for c in caches) else None)
            made = fresh_leaves(given, updates) if front and front[-1].fresh_updates else {}
            with keeping(state[-1], made):
                params, last_state = last.update(updates, state[-1])
            return params, (*front_state, last_state)
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
        cache = terminal_states(state[-1])[0].params.cache
        ahead = cache is None or cache.scale_was_one
        inner = last.begin(state[-1], True) if ahead else HeldStep(last.update, state[-1])
        return _Chained(inner, front, state, update)

    return Optimizer(init, update, begin)


def fresh_leaves(given: Updates, made: Updates) -> dict[int, torch.Tensor]:
    """The leaves of ``made`` (by ``id``), the output of a ``fresh_updates`` transform fed
    ``given``, that it made for one leaf each: none in the memory of one of ``given``'s or of
    another of its own (one tensor given to two leaves, or two views of one: ``g.detach()``, two
    DTensors made from one local tensor). A DTensor's leaf is its local shard, the tensor the
    steps are handed. Leaves other than dense tensors are none (the step refuses them)."""
    held = {g.untyped_storage().data_ptr() for g in _dense(given)}
    seen: dict[int, torch.Tensor] = {}
    for g in _dense(made):
        at = g.untyped_storage().data_ptr()
        if at in seen:
            held.add(at)
        seen[at] = g
    return {id(g): g for at, g in seen.items() if at not in held}


def _dense(tree: Updates) -> Iterator[torch.Tensor]:
    """The dense tensors of ``tree`` (DTensors' local shards)."""
    for g in map(local, optree.tree_leaves(tree)):
        if isinstance(g, torch.Tensor) and g.layout is torch.strided:
            yield g


@contextlib.contextmanager
def keeping(state: OptState, made: dict[int, torch.Tensor]) -> Iterator[None]:
    """While a terminal optimizer steps on ``state`` (a terminal state itself: no wrapper
    around it), its step may keep the grads of ``made`` (:func:`fresh_leaves`) rather than
    copy them (``StepCache.owned_grads``)."""
    terminals = terminal_states(state) if made else []
    cache = (terminals[0].params.cache if len(terminals) == 1 and terminals[0] is state
             else None)
    if cache is None:
        yield
        return
    cache.owned_grads = made
    try:
        yield
    finally:
        cache.owned_grads = None


def through(transforms: Sequence[AnyTransformation], updates: Updates, state: Sequence[Any],
            tell: Optional[list[StepCache]] = None) -> tuple[Any, tuple]:
    """Feed ``updates`` through ``transforms``; with ``tell``, set their ``scale_was_one`` to
    whether every global factor (clipping's) was 1 (a device synchronisation)."""
    new, factors = [], []
    for t, s in zip(transforms, state):
        if tell is not None and getattr(t, "global_scale", None) is not None:
            factors.append(t.global_scale(updates, s))
        updates, s = t.update(updates, s)
        new.append(s)
    if tell is not None:
        ones = _all_one(factors)
        for c in tell:
            c.scale_was_one = ones
    return updates, tuple(new)


def _all_one(factors: list[torch.Tensor]) -> bool:
    """Whether every factor is 1 (True for none); reads them on the host."""
    return not factors or bool(torch.stack([f.detach().float().to(factors[0].device)
                                            for f in factors]).eq(1).all())


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


def begin_step(opt: Optimizer, state: OptState, speculative: bool = False) -> Step:
    """``opt``'s step on ``state``: its own (``opt.begin``), or a :class:`HeldStep` running its
    ``update`` at ``finish`` when it has none."""
    if opt.begin is not None:
        return opt.begin(state, speculative)
    return HeldStep(opt.update, state)


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

    Whether the factors were 1 is noted in the state's ``ParamRefs.cache``: after a step whose
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
            ones = _all_one([t.global_scale(full, s) for t, s in zip(self.front, self.state)])
        except BaseException:
            self.inner.abort()
            raise
        cache = terminal_states(self.state[-1])[0].params.cache
        if cache is not None:
            cache.scale_was_one = ones
        if isinstance(self.inner, HeldStep):  # nothing ran ahead
            self.inner.abort()
            return self.update(full, self.state)
        ran = not self.inner.delayed  # a delayed step starts nothing before finish
        if ones:  # every factor is 1: the grads the step ran on are the chain's, bit for bit
            self.committed = True if ran else None
            params, s = self.inner.finish(grads)
            return params, (*self.state[:-1], s)
        self.committed = False if ran else None
        self.inner.abort()  # the state is as it was: run the chain as update would
        return self.update(full, self.state)

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()


def run_inner(run: Callable[[], tuple[Any, OptState]], inner_state: OptState, counts: list[int],
              completed: Callable[[], None]) -> tuple[Any, OptState]:
    """``run()``, a wrapper's inner update (or step's ``finish``) on ``inner_state``, whose
    terminal counts were ``counts`` before it. If it raises once the inner step completed (a
    signal's handler, run after the step's work), ``completed()`` first makes the wrapper's
    state passed in hold the step too, as a terminal optimizer's does."""
    try:
        return run()
    except BaseException:
        if stepped(inner_state, counts):
            completed()
        raise


class Wrapped(StepBase):
    """The step of a wrapper around an inner optimizer's step, with the wrapper's own state.

    It begins the inner step (:func:`begin_step`; the inner terminal counts taken first),
    forwards ``feed``, ``abort`` and ``close`` to it, and at ``finish`` hands the inner step
    ``inner_grads(grads)`` (the inner step aborted if that raises) and returns
    ``wrap(out, inner_state)`` of its result. A subclass gives its own arithmetic in two hooks:

    - ``wrap(out, inner_state) -> (out, state)``: the wrapper's new state around the inner one
      (the state passed in consumed);
    - ``completed_anyway()``: the inner step completed but its ``finish`` raised (a signal's
      handler): make the wrapper's state passed in hold the step (:func:`run_inner`).

    and may override ``feed`` and ``inner_grads`` (default: the grads as given).
    """

    def __init__(self, opt: Optimizer, inner_state: OptState, speculative: bool = False):
        self.inner_state = inner_state
        self.counts = terminal_counts(inner_state)
        self.inner = begin_step(opt, inner_state, speculative)
        # a step run ahead speculatively applies nothing before finish: it may be streamed
        self.delayed = self.inner.delayed and not speculative

    def feed(self, index: int, grad: torch.Tensor) -> None:
        self.inner.feed(index, grad)

    def finish(self, grads: Updates = None) -> tuple[Any, OptState]:
        inner_grads = self.aborting(self.inner_grads, grads)
        out, inner_state = run_inner(lambda: self.inner.finish(inner_grads), self.inner_state,
                                     self.counts, self.completed_anyway)
        self.committed = self.inner.committed
        return self.wrap(out, inner_state)

    def aborting(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, the inner step aborted if it raises (before it has changed anything)."""
        try:
            return fn(*args)
        except BaseException:
            self.inner.abort()
            raise

    def inner_grads(self, grads: Updates) -> Updates:
        return grads

    def wrap(self, out: Any, inner_state: OptState) -> tuple[Any, OptState]:
        raise NotImplementedError

    def completed_anyway(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()
