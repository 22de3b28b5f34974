"""Skip a whole step when a gradient holds inf or NaN (what AMP's GradScaler users expect)."""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import optree
import torch

from functional_offload.base import GradientTransformation, Optimizer, StateError, Step
from functional_offload.combine import Wrapped, merge_grads, run_inner
from functional_offload.state import CONSUMED, check_usable, grads_for, params_of, terminal_counts
from functional_offload.transforms.clipping import leaf_norms
from functional_offload.tree import check_float_leaves, is_dtensor, local
from functional_offload.typing import OptState, Params, Updates

__all__ = ["ApplyIfFiniteState", "apply_if_finite", "all_finite"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`."""

    notfinite_count: torch.Tensor  # int64 scalar (CPU): consecutive skipped steps; -1 consumed
    total_notfinite: torch.Tensor  # int64 scalar (CPU): skipped steps in all
    inner_state: OptState


def all_finite(updates: Updates) -> torch.Tensor:
    """A 0-dim bool tensor: every gradient element is finite (on every rank, for DTensors).

    Each rank counts its local shards holding an inf or a NaN (max |x| is not finite exactly
    then; empty shards are finite) and, for DTensor grads, the counts are summed over each mesh:
    a NaN on one rank skips the step on all of them (a max all-reduce could drop it)."""
    leaves = [g for g in check_float_leaves(updates, "grad") if g is not None]
    by_mesh: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for g in leaves:
        mesh = g.device_mesh if is_dtensor(g) else None
        by_mesh.setdefault(id(mesh), (mesh, []))[1].append(local(g))
    bad = []
    for mesh, shards in by_mesh.values():
        maxes = leaf_norms([x for x in shards if x.numel()], float("inf"))
        count = ((~torch.isfinite(torch.stack(maxes))).sum() if maxes
                 else torch.zeros((), dtype=torch.int64, device=shards[0].device))
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Partial
            count = DTensor.from_local(count, mesh, [Partial("sum")] * mesh.ndim,
                                       run_check=False).full_tensor()
        bad.append(count.to(leaves[0].device if not is_dtensor(leaves[0]) else local(leaves[0]).device))
    return torch.stack(bad).sum() == 0 if bad else torch.ones((), dtype=torch.bool)


AnyT = Union[Optimizer, GradientTransformation]


def apply_if_finite(inner: AnyT) -> AnyT:
    r"""Run ``inner`` only when every gradient is finite; otherwise skip the step entirely.

    On a skipped step the params and ``inner``'s state are unchanged (no moment, count or
    master moves) and ``notfinite_count`` / ``total_notfinite`` grow; a finite step resets
    ``notfinite_count``. Wrap the whole chain so clipping is skipped too::

        opt = fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3)))

    Deciding costs one device→host read of a flag per step (as ``GradScaler.step`` does): the
    update cannot be applied in place until it is known. Streamed (:func:`~functional_offload.stream`),
    the step runs ahead as if the grads were finite and is dropped if they are not. The state
    passed in is consumed, whichever way the step went.

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.apply_if_finite(fo.sgd(lr=1.0))
        >>> state = opt.init({"w": torch.zeros(1)})
        >>> params, state = opt.update({"w": torch.tensor([float("nan")])}, state)
        >>> params["w"], int(state.total_notfinite)
        (tensor([0.]), 1)
    """
    if not isinstance(inner, (Optimizer, GradientTransformation)):
        raise TypeError("apply_if_finite wraps an Optimizer or a GradientTransformation")
    terminal = isinstance(inner, Optimizer)

    def init(params: Params) -> ApplyIfFiniteState:
        zero = lambda: torch.zeros((), dtype=torch.int64)  # noqa: E731
        return ApplyIfFiniteState(zero(), zero(), inner.init(params))

    def update(updates: Updates, state: ApplyIfFiniteState) -> tuple[Any, ApplyIfFiniteState]:
        _check(updates, state, terminal)
        if not bool(all_finite(updates)):  # the one host read the API promises
            return _skipped(updates, state, terminal)
        out, inner_state = run_inner(lambda: inner.update(updates, state.inner_state),
                                     state.inner_state, terminal_counts(state.inner_state),
                                     state.notfinite_count.zero_)
        return out, _finite(state, inner_state)

    if not terminal:
        return GradientTransformation(init, update)

    def begin(state: ApplyIfFiniteState, speculative: bool = False) -> Step:
        _check(None, state, terminal)
        return _Guarded(inner, state)

    return Optimizer(init, update, begin)


def _check(updates: Updates, state: Any, terminal: bool) -> None:
    if not isinstance(state, ApplyIfFiniteState):
        raise TypeError(f"apply_if_finite expects its ApplyIfFiniteState, got {type(state).__name__}")
    if int(state.notfinite_count) == CONSUMED:
        raise StateError("cannot update: this ApplyIfFiniteState was consumed by an earlier "
                         "update; use the state that update returned")
    if terminal:
        check_usable(state.inner_state, "update")
        if updates is not None:
            grads_for(updates, state.inner_state)
    elif updates is not None:
        check_float_leaves(updates, "grad")


def _finite(state: ApplyIfFiniteState, inner_state: OptState) -> ApplyIfFiniteState:
    """The state after a finite step (``state`` consumed)."""
    new = ApplyIfFiniteState(torch.zeros((), dtype=torch.int64), state.total_notfinite.clone(),
                             inner_state)
    state.notfinite_count.fill_(CONSUMED)
    return new


def _skipped(updates: Updates, state: ApplyIfFiniteState,
             terminal: bool) -> tuple[Any, ApplyIfFiniteState]:
    """A skipped step: the params (or zero grads) unchanged, the counters advanced."""
    new = ApplyIfFiniteState(state.notfinite_count + 1, state.total_notfinite + 1, state.inner_state)
    state.notfinite_count.fill_(CONSUMED)
    if terminal:
        return params_of(state.inner_state), new
    return optree.tree_map(torch.zeros_like, updates), new


class _Guarded(Wrapped):
    """``apply_if_finite``'s step: the inner step runs ahead speculatively; ``finish`` keeps it
    if every grad is finite and aborts it (the inner state as it was) otherwise."""

    def __init__(self, opt: Optimizer, state: ApplyIfFiniteState):
        self.state = state
        self.spec = optree.tree_structure(params_of(state.inner_state))
        self.fed: dict[int, torch.Tensor] = {}
        super().__init__(opt, state.inner_state, speculative=True)

    def feed(self, index: int, grad: torch.Tensor) -> None:
        self.inner.feed(index, grad)
        self.fed[index] = grad

    def finish(self, grads: Updates = None) -> tuple[Params, ApplyIfFiniteState]:
        ran_ahead = bool(self.fed)  # (_all_grads empties it)
        full, finite = self.aborting(self._all_grads, grads)
        if not finite:
            self.inner.abort()
            return _skipped(full, self.state, True)
        out = super().finish(grads)
        if self.committed is None and ran_ahead:  # (an optimizer's own step: kept whole)
            self.committed = True
        return out

    def _all_grads(self, grads: Updates) -> tuple[Updates, bool]:
        """Every grad (fed or given), and whether all are finite."""
        full = merge_grads(self.spec, self.fed, grads)
        self.fed.clear()
        return full, bool(all_finite(full))

    def wrap(self, out: Params, inner_state: OptState) -> tuple[Params, ApplyIfFiniteState]:
        return out, _finite(self.state, inner_state)

    def completed_anyway(self) -> None:
        self.state.notfinite_count.zero_()
