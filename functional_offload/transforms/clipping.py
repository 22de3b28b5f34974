"""Gradient clipping by global norm, on the device, without a host sync."""

from __future__ import annotations

import itertools
import operator
import threading
from typing import Any, Optional

import optree
import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from functional_offload.base import EmptyState, GradientTransformation
from functional_offload.checks import real
from functional_offload.tree import check_float_leaves
from functional_offload.typing import Params, Updates

__all__ = ["leaf_norms", "global_norm", "clip_by_global_norm"]


_DEVICE_DTYPE = operator.attrgetter("device", "dtype")
Groups = dict[tuple, list[int]]
_BUILT = "functional_offload.built"  # an optree namespace whose dicts keep insertion order
_BUILT_LOCK = threading.Lock()  # optree's dict order mode is global, not per thread


def _built(tree: Any) -> tuple[list[Optional[torch.Tensor]], optree.PyTreeSpec]:
    """The leaves of ``tree`` (``None`` kept) in the order it was built, each dict's in its
    insertion order (``named_parameters()``'s), not optree's sorted keys: the order
    ``clip_grad_norm_(model.parameters())`` sums the norms in. And the structure to rebuild
    ``tree`` from them."""
    with _BUILT_LOCK, optree.dict_insertion_ordered(True, namespace=_BUILT):
        return optree.tree_flatten(tree, none_is_leaf=True, namespace=_BUILT)


def _by_device_and_dtype(leaves: list[torch.Tensor]) -> Groups:
    """Positions in ``leaves`` per ``(device, dtype)``: what one multi-tensor launch takes. The
    groups come in the order torch's ``clip_grad_norm_`` takes them (its own grouping), which
    is the order their norms are summed in."""
    keys = list(map(_DEVICE_DTYPE, leaves))
    if keys.count(keys[0]) == len(keys):  # one group (the common case), without a loop
        return {keys[0]: list(range(len(keys)))}
    grouped = _group_tensors_by_device_and_dtype([leaves], with_indices=True)
    return {key: list(idx) for key, (_, idx) in grouped.items()}


def _members(leaves: list[torch.Tensor], idx: list[int]) -> list[torch.Tensor]:
    return leaves if len(idx) == len(leaves) else [leaves[i] for i in idx]


def _norm_groups(leaves: list[torch.Tensor], ord: float, groups: Groups,
                 dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Per group of ``leaves`` (checked, none ``None``; ``groups``: their
    :func:`_by_device_and_dtype`), their norms as one 1-D tensor on the first leaf's device:
    one multi-tensor launch and one copy per group, computed as ``clip_grad_norm_`` does (in
    the leaves' dtype; ``dtype``: in that one where it is the more precise)."""
    dev = leaves[0].device
    out = []
    for (device, kind), idx in groups.items():
        members = _members(leaves, idx)
        wider = dtype if dtype is not None and dtype.itemsize > kind.itemsize else None
        norms = (torch._foreach_norm(members, ord, dtype=wider)
                 if _has_foreach_support(members, device)
                 else [torch.linalg.vector_norm(g, ord, dtype=wider) for g in members])
        out.append(torch.stack(norms).to(dev))
    return out


def leaf_norms(updates: Updates, ord: float) -> list[torch.Tensor]:
    """The ``ord``-norm of each non-``None`` leaf, in flatten order (multi-tensor kernels, one
    launch per device and dtype), each a 0-dim tensor on the first leaf's device; empty for no
    leaves."""
    leaves = [g for g in check_float_leaves(updates, "grad") if g is not None]
    if not leaves:
        return []
    groups = _by_device_and_dtype(leaves)
    out: list[torch.Tensor] = [None] * len(leaves)  # type: ignore[list-item]
    for idx, norms in zip(groups.values(), _norm_groups(leaves, ord, groups)):
        for i, n in zip(idx, norms.unbind()):
            out[i] = n
    return out


# elements: a contiguous leaf this large is multiplied into a tensor of its own (one read, one
# write of its bytes, and memory of its own that a delayed step's landing may keep); the others
# share one buffer (one allocation, at twice the bytes: copied, then scaled)
_ONE_BUFFER_BELOW = 1 << 16


def _scaled(leaves: list[torch.Tensor], coef: torch.Tensor, groups: Groups) -> list[torch.Tensor]:
    """``leaves`` times ``coef``, as new tensors, per device and dtype by torch's multi-tensor
    multiply (as ``clip_grad_norm_`` scales grads): the large leaves each into a tensor of its
    own, the small ones of a group into one buffer, scaled in place (with hundreds of small
    leaves, one allocation per leaf dominates the cost)."""
    if len(groups) == 1:
        (device, _), = groups
        return _scaled_group(leaves, coef.to(device))
    out: list[torch.Tensor] = [coef] * len(leaves)
    for (device, _), idx in groups.items():
        for i, v in zip(idx, _scaled_group([leaves[i] for i in idx], coef.to(device))):
            out[i] = v
    return out


def _scaled_group(members: list[torch.Tensor], coef: torch.Tensor) -> list[torch.Tensor]:
    """``members`` (one device and dtype) times ``coef`` (on their device), as new tensors."""
    if set(map(type, members)) != {torch.Tensor}:  # DTensor shards (FSDP2), other subclasses:
        return list(torch._foreach_mul(members, coef))  # their own multiply, a new tensor each
    out: list[torch.Tensor] = [coef] * len(members)
    own = [g.numel() >= _ONE_BUFFER_BELOW and g.is_contiguous() for g in members]
    big = [i for i, o in enumerate(own) if o]
    if big:
        for i, v in zip(big, torch._foreach_mul([members[i] for i in big], coef)):
            out[i] = v
    small = [i for i, o in enumerate(own) if not o]  # and the non-contiguous: made contiguous
    if small:
        part = [members[i] for i in small]
        flat = torch._utils._flatten_dense_tensors(part)
        if len(part) == 1:  # flattening one contiguous tensor gives a view of it
            flat = flat.clone()
        views = torch._utils._unflatten_dense_tensors(flat, part)
        torch._foreach_mul_(views, coef)
        for i, v in zip(small, views):
            out[i] = v
    return out


def _global_norm(leaves: list[torch.Tensor], groups: Groups,
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The L2 norm of ``leaves`` (in build order), as ``clip_grad_norm_`` of them computes it:
    the leaves' norms stacked group by group, then their norm (each in ``dtype``, if given)."""
    return torch.linalg.vector_norm(torch.cat(_norm_groups(leaves, 2.0, groups, dtype)), 2.0)


def _present(updates: Updates) -> list[torch.Tensor]:
    """The grads of ``updates`` checked, in build order, without the ``None`` leaves."""
    check_float_leaves(updates, "grad")
    return [g for g in _built(updates)[0] if g is not None]


def global_norm(updates: Updates) -> torch.Tensor:
    r"""The L2 norm of all leaves together, :math:`\sqrt{\sum_i \lVert g_i \rVert^2}`, as a
    0-dim tensor on the first leaf's device (``None`` leaves are skipped).

    Bit for bit ``torch.nn.utils.get_total_norm`` of the leaves in the order the tree was built
    (each dict's insertion order, as ``named_parameters()`` gives them), which is the order
    ``clip_grad_norm_(model.parameters())`` sums their norms in."""
    leaves = _present(updates)
    return _global_norm(leaves, _by_device_and_dtype(leaves)) if leaves else torch.zeros(())


def clip_by_global_norm(max_norm: float, *,
                         norm_dtype: Optional[torch.dtype] = None) -> GradientTransformation:
    r"""Scale all gradients by one factor so that their global norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``, bit for bit (the norm sums the leaves in the order
    the tree was built, as :func:`global_norm`), with :math:`N` that norm:

    .. math:: g_i \leftarrow g_i \cdot \min\!\left(1, \frac{c}{N + 10^{-6}}\right)

    As there, each leaf's norm is computed in the leaf's dtype, and the factor is in the norms'
    dtype: for bf16 grads both are rounded to bf16, so :math:`N` and the factor may be off by a
    few tenths of a percent. ``norm_dtype=torch.float32`` (or ``torch.float64``) computes the
    norms of less precise leaves and the factor in that dtype instead, as Megatron-LM clips; the
    grads keep their dtype.

    The factor stays a device tensor (no host sync); new tensors are returned, the input
    gradients are not modified (``fresh_updates``: a delayed step after it in a chain keeps
    them for its landing, without a copy). Its ``global_scale`` is that factor: a streamed step
    (:func:`~functional_offload.stream`) runs ahead as if it were 1 and is redone when not.

    Example::

        >>> import torch, functional_offload as fo
        >>> clip = fo.clip_by_global_norm(1.0)
        >>> g, _ = clip.update({"w": torch.tensor([3.0, 4.0])}, clip.init(None))
        >>> g["w"]
        tensor([0.6000, 0.8000])
    """
    limit = real(max_norm)
    if limit is None or not limit > 0:
        raise ValueError(f"clip_by_global_norm needs max_norm > 0, got {max_norm!r}")
    if norm_dtype not in (None, torch.float32, torch.float64):
        raise ValueError(f"clip_by_global_norm: norm_dtype must be None (the grads' dtype, as "
                         f"torch), torch.float32 or torch.float64, got {norm_dtype!r}")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def of(present: list[torch.Tensor], groups: Groups) -> torch.Tensor:
        return torch.clamp(limit / (_global_norm(present, groups, norm_dtype) + 1e-6), max=1.0)

    def factor(updates: Updates, state: Any = None) -> torch.Tensor:
        present = _present(updates)
        return of(present, _by_device_and_dtype(present)) if present else torch.ones(())

    def update(updates: Updates, state: EmptyState) -> tuple[Updates, EmptyState]:
        check_float_leaves(updates, "grad")
        leaves, spec = _built(updates)  # in build order: the order the norm sums them in
        every = all(map(operator.is_not, leaves, itertools.repeat(None)))
        present = leaves if every else [g for g in leaves if g is not None]
        if not present:
            return updates, state
        groups = _by_device_and_dtype(present)
        scaled = _scaled(present, of(present, groups), groups)
        if not every:
            it = iter(scaled)
            scaled = [None if g is None else next(it) for g in leaves]
        return optree.tree_unflatten(spec, scaled), state

    return GradientTransformation(init, update, factor, fresh_updates=True)
