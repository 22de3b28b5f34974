"""Apply a gradient transformation to part of the tree."""

from __future__ import annotations

from typing import Any, Callable, Union

import optree

from functional_offload.base import GradientTransformation
from functional_offload.tree import flatten_like
from functional_offload.typing import OptState, Params, Updates

__all__ = ["masked"]

Mask = Union[Any, Callable[[Params], Any]]


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    r"""Apply ``inner`` to the leaves where ``mask`` is True; pass the others through unchanged.

    ``mask`` is a pytree of bools mirroring the params, or a callable ``params -> mask``.
    ``inner`` sees the masked leaves only (the others are ``None`` for it), so a norm it computes
    is over those leaves.

    Example — clip only the weight matrices::

        >>> import torch, functional_offload as fo
        >>> t = fo.masked(fo.clip_by_global_norm(1.0), lambda p: {k: v.ndim > 1 for k, v in p.items()})
        >>> params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> g, _ = t.update({"w": torch.full((2, 2), 2.0), "b": torch.full((2,), 2.0)}, t.init(params))
        >>> g["b"]
        tensor([2., 2.])
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError("masked() wraps a GradientTransformation; for terminal optimizers use "
                        "their weight_decay_mask or a placement")

    def resolve(tree: Any) -> tuple[list[Any], optree.PyTreeSpec, list[bool]]:
        """The leaves of ``tree`` (params or updates; ``None`` for a leaf without a grad), its
        structure and the mask's flag of each."""
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        m = mask(tree) if callable(mask) else mask
        return leaves, spec, [bool(f) for f in flatten_like(m, tree, "mask", spec)]

    def init(params: Params) -> OptState:
        leaves, spec, flags = resolve(params)
        return inner.init(optree.tree_unflatten(spec, [x if f else None for x, f in zip(leaves, flags)]))

    def update(updates: Updates, state: OptState) -> tuple[Updates, OptState]:
        leaves, spec, flags = resolve(updates)
        sub = optree.tree_unflatten(spec, [x if f else None for x, f in zip(leaves, flags)])
        new_sub, state = inner.update(sub, state)
        new = optree.tree_flatten(new_sub, none_is_leaf=True)[0]
        return optree.tree_unflatten(spec, [n if f else x for x, n, f in zip(leaves, new, flags)]), state

    return GradientTransformation(init, update)
