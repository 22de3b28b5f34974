"""Scaling gradients by a constant."""

from __future__ import annotations

import optree

from functional_offload.base import EmptyState, GradientTransformation
from functional_offload.checks import real
from functional_offload.typing import Params, Updates

__all__ = ["scale"]


def scale(factor: float) -> GradientTransformation:
    r"""Multiply every gradient by ``factor``: :math:`g_i \leftarrow s\, g_i`.

    Example::

        >>> import torch, functional_offload as fo
        >>> t = fo.scale(0.5)
        >>> t.update({"w": torch.ones(2)}, t.init(None))[0]["w"]
        tensor([0.5000, 0.5000])
    """
    if real(factor) is None:
        raise TypeError(f"scale needs a number, got {factor!r}")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: EmptyState) -> tuple[Updates, EmptyState]:
        return optree.tree_map(lambda g: g * factor, updates), state

    return GradientTransformation(init, update)
