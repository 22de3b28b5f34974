"""optree helpers: dotted leaf paths and flattening a tree against a reference structure."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import optree
import torch

__all__ = ["leaves_with_paths", "flatten_like", "check_tensor_leaves", "local"]


def _entry_name(entry: Any) -> str:
    for attr in ("field", "key", "name", "index"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaves_with_paths(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """``(paths, leaves, treespec)`` of ``tree`` in flatten order (``None`` is not a leaf);
    paths are dotted, e.g. ``"mu.layer.weight"``."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf)
    return list(_paths(spec)), leaves, spec


@functools.lru_cache(maxsize=256)
def _paths(spec: optree.PyTreeSpec) -> tuple[str, ...]:
    """Dotted paths of a structure's leaves (cached: an update sees the same structure)."""
    return tuple(".".join(_entry_name(e) for e in acc) or "<root>" for acc in spec.accessors())


def flatten_like(tree: Any, reference: Any, what: str) -> list[Any]:
    """Flatten ``tree`` up to the structure of the tree ``reference`` (the params).

    A ``None`` where the reference has a leaf is kept as ``None`` (no gradient for that leaf).
    Raises ``ValueError`` naming ``what`` when the structures differ.
    """
    spec = optree.tree_structure(reference, none_is_leaf=True)
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        got = optree.tree_structure(tree, none_is_leaf=True)
        raise ValueError(
            f"{what} does not match the params tree: expected structure {spec}, got {got} "
            f"({e}). Pass a tree with the same keys and nesting as the params given to init "
            "(use None for leaves without a gradient)."
        ) from None


def check_tensor_leaves(leaves: Sequence[Any], paths: Sequence[str], what: str) -> None:
    """Raise ``TypeError`` naming the first leaf of ``leaves`` that is not a tensor."""
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what} leaf {path!r} is a {type(leaf).__name__}, expected a torch.Tensor")


@functools.lru_cache(maxsize=1)
def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def local(t: Any) -> Any:
    """The local shard of a DTensor (a plain tensor sharing its storage); anything else as is.

    Under FSDP2 a param is a DTensor and each rank updates its own shard: optimizer state,
    placement and the executor all work on these local tensors.
    """
    dt = _dtensor_type()
    return t.to_local() if dt is not None and isinstance(t, dt) else t
