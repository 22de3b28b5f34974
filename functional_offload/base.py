"""Core types: transformations, optimizers, ``chain`` (optax's ``_src/base.py``, on optree)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol, Union

import optree

from functional_offload.typing import OptState, Params, Updates

__all__ = [
    "TransformInitFn",
    "TransformUpdateFn",
    "OptimizerUpdateFn",
    "GradientTransformation",
    "Optimizer",
    "EmptyState",
    "ParamRefs",
    "chain",
    "params_of",
    "flush",
]


class TransformInitFn(Protocol):
    """``init(params) -> state``: allocate the state for a params tree."""

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """``update(grads, state) -> (grads, state)``: transform a gradient tree."""

    def __call__(self, updates: Updates, state: OptState) -> tuple[Updates, OptState]: ...


class OptimizerUpdateFn(Protocol):
    """``update(grads, state) -> (params, state)``: apply one step and return the new params."""

    def __call__(self, updates: Updates, state: OptState) -> tuple[Params, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure pair ``(init, update)`` mapping gradients to gradients (clipping, scaling, masks)."""

    init: TransformInitFn
    update: TransformUpdateFn


class Optimizer(NamedTuple):
    """A terminal transformation: ``update(grads, state)`` returns the updated params.

    The state holds references to the params (a :class:`ParamRefs` node) and is *donated*:
    ``update`` reuses its buffers in place and marks it consumed, so it must not be used again.
    """

    init: TransformInitFn
    update: OptimizerUpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class ParamRefs(NamedTuple):
    """The live side of a terminal optimizer's state: the params it updates in place, and
    (with ``delayed=True``) the host staging of the new params and the step still in flight.

    Part of the state tree so that the state is self-contained, but not saved by checkpoints:
    the params are the model's, saved with the model.
    """

    tree: Params
    staging: Any = None  # delayed mode: host buffers the new params land in (None leaves else)
    pending: Optional[Callable[[], None]] = None  # delayed mode: finishes the in-flight step


def flush(state: OptState) -> OptState:
    """Finish any update still in flight in ``state`` (delayed mode) and apply it to the params.

    The host step started by the last ``update`` is waited for, its params are copied to the
    device, and the caller's stream is ordered after the copies. A no-op for states with nothing
    in flight; :func:`~functional_offload.save` and :func:`~functional_offload.state_dict` call
    it. Returns ``state``.
    """
    for node in optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ParamRefs)):
        if isinstance(node, ParamRefs) and node.pending is not None:
            node.pending()
    return state


AnyTransformation = Union[GradientTransformation, Optimizer]


def chain(*transforms: AnyTransformation) -> AnyTransformation:
    """Apply transformations in sequence; the last one may be a terminal :class:`Optimizer`.

    ``chain(t1, ..., tn)`` feeds the gradients through ``t1 ... tn``. Its state is the tuple
    ``(s1, ..., sn)`` of the parts' states. It is an :class:`Optimizer` when ``tn`` is one (its
    ``update`` returns params), else a :class:`GradientTransformation`.

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

    def update(updates: Updates, state: tuple) -> tuple[Any, tuple]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain state must be a tuple of {len(transforms)} states (the one "
                             f"init returned); got {type(state).__name__}")
        new = []
        for t, s in zip(front, state):
            updates, s = t.update(updates, s)
            new.append(s)
        out, s = last.update(updates, state[-1])
        return out, (*new, s)

    return type(last)(init, update)


def params_of(state: OptState) -> Params:
    """The params tree referenced by a terminal optimizer's state (the first :class:`ParamRefs`)."""
    nodes = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ParamRefs))
    for node in nodes:
        if isinstance(node, ParamRefs):
            return node.tree
    raise ValueError("this state holds no params: it is not the state of a terminal Optimizer")
