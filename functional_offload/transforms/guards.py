"""Skip a whole step when a gradient holds inf or NaN (what AMP's GradScaler users expect)."""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import optree
import torch

from functional_offload.base import GradientTransformation, Optimizer, params_of
from functional_offload.transforms.clipping import leaf_norms
from functional_offload.typing import OptState, Params, Updates

__all__ = ["ApplyIfFiniteState", "apply_if_finite", "all_finite"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`."""

    notfinite_count: torch.Tensor  # int64 scalar (CPU): consecutive skipped steps
    total_notfinite: torch.Tensor  # int64 scalar (CPU): skipped steps in all
    inner_state: OptState


def all_finite(updates: Updates) -> torch.Tensor:
    """A 0-dim bool tensor (on the first leaf's device): every gradient element is finite."""
    # max |x| per tensor is inf or NaN exactly when the tensor holds an inf or a NaN.
    maxes = leaf_norms(updates, float("inf"))
    return torch.isfinite(torch.stack(maxes)).all() if maxes else torch.ones((), dtype=torch.bool)


AnyT = Union[Optimizer, GradientTransformation]


def apply_if_finite(inner: AnyT) -> AnyT:
    r"""Run ``inner`` only when every gradient is finite; otherwise skip the step entirely.

    On a skipped step the params and ``inner``'s state are unchanged (no moment, count or
    master moves) and ``notfinite_count`` / ``total_notfinite`` grow; a finite step resets
    ``notfinite_count``. Wrap the whole chain so clipping is skipped too::

        opt = fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3)))

    Deciding costs one device→host read of a flag per step (as ``GradScaler.step`` does): the
    update cannot be applied in place until it is known.

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

    def init(params: Params) -> ApplyIfFiniteState:
        zero = lambda: torch.zeros((), dtype=torch.int64)  # noqa: E731
        return ApplyIfFiniteState(zero(), zero(), inner.init(params))

    def update(updates: Updates, state: ApplyIfFiniteState) -> tuple[Any, ApplyIfFiniteState]:
        if bool(all_finite(updates)):  # the one host read the API promises
            out, inner_state = inner.update(updates, state.inner_state)
            return out, ApplyIfFiniteState(torch.zeros((), dtype=torch.int64),
                                           state.total_notfinite.clone(), inner_state)
        skipped = ApplyIfFiniteState(state.notfinite_count + 1, state.total_notfinite + 1,
                                     state.inner_state)
        if isinstance(inner, Optimizer):
            return params_of(state.inner_state), skipped
        return optree.tree_map(torch.zeros_like, updates), skipped

    return type(inner)(init, update)
