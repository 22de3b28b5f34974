"""Small host leaves packed together, so that a step's work does not grow with their number.

An LLM has hundreds of small leaves (norms, biases). Moved one by one, each costs a copy down,
a piece of a chunk and a copy up (~0.1 ms a leaf). Instead, at ``init`` the host state of small
leaves that have a master (values, moments, EMA) is laid out in shared arenas, 16-element
aligned; at each step their grads are gathered into one device buffer (one multi-tensor copy),
a run of members becomes one host leaf of the executor (one copy down, one contiguous piece,
one copy up) and the new params are scattered back with one more multi-tensor copy. Plain and
delayed steps pack (a delayed step's landing lands each member as a param of its own, with its
own next grad for a look-ahead).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["Pack", "PACK_MAX", "Buffers", "arrange", "runs", "buffers", "span"]

PACK_MAX = 1 << 16  # elements: leaves up to this size are packed
_ALIGN = 16  # elements between member starts


class Pack(NamedTuple):
    """Leaves whose host state shares arenas, in arena order."""

    members: tuple[int, ...]  # flatten indices
    offsets: tuple[int, ...]  # each member's first element in the arenas
    total: int  # elements in each arena, padding included


def arrange(candidates: Sequence[int], fields: Sequence[list[Optional[torch.Tensor]]],
            decay: Sequence[bool], params: Sequence[torch.Tensor], pin: bool) -> list[Pack]:
    """Move the state of the ``candidates`` (flatten indices) into arenas (pinned with ``pin``):
    ``fields`` are the per-leaf state lists (value, moments, EMA), rewritten in place with views
    of the arenas.
    Leaves are grouped by their ``params``' device and dtype (the pack's grads and new params
    share one buffer each, on that device), their state's dtypes and weight decay (a run of
    members shares one set of scalars)."""
    groups: dict[tuple, list[int]] = {}
    for i in candidates:
        key = (params[i].device, params[i].dtype,
               tuple(None if f[i] is None else f[i].dtype for f in fields), decay[i])
        groups.setdefault(key, []).append(i)
    packs = []
    for (_, _, dtypes, _), members in groups.items():
        if len(members) < 2:
            continue
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += -(-fields[0][i].numel() // _ALIGN) * _ALIGN
        for f, dtype in zip(fields, dtypes):
            if dtype is None:
                continue
            arena = torch.zeros(total, dtype=dtype, pin_memory=pin)
            for i, o in zip(members, offsets):
                view = arena[o: o + f[i].numel()]
                view.copy_(f[i].reshape(-1))
                f[i] = view.view(f[i].shape)
        packs.append(Pack(tuple(members), tuple(offsets), total))
    return packs


def runs(pack: Pack, with_grad: Sequence[bool], decay: Sequence[bool],
         dtypes: Sequence[torch.dtype]) -> list[tuple[int, int]]:
    """``(first, last)`` positions in ``pack.members`` of the runs of members that have a grad
    this step, the same weight decay and the same param dtype (a member without a grad is not
    updated, a run shares one set of scalars, and its grads and new params pass through one
    buffer: a member whose param changed dtype since ``init`` runs apart)."""
    out: list[tuple[int, int]] = []
    start: Optional[int] = None
    for j, i in enumerate(pack.members):
        first = pack.members[start] if start is not None else i
        if start is not None and (not with_grad[i] or decay[i] != decay[first]
                                  or dtypes[i] != dtypes[first]):
            out.append((start, j - 1))
            start = None
        if with_grad[i] and start is None:
            start = j
    if start is not None:
        out.append((start, len(pack.members) - 1))
    return out


class Buffers(NamedTuple):
    """A pack's gather and scatter buffers on one device, with each member's view (shaped as
    the member's param: grads and params copy in and out without a reshape per step)."""

    grad: torch.Tensor
    out: torch.Tensor
    grads: list[torch.Tensor]
    outs: list[torch.Tensor]


def buffers(pack: Pack, device: torch.device, grad_dtype: torch.dtype,
            shapes: Sequence[torch.Size]) -> Buffers:
    """Zeroed buffers for a pack's grads and new params (made once and kept by the caller);
    ``shapes``: the members' param shapes."""
    grad = torch.zeros(pack.total, dtype=grad_dtype, device=device)
    out = torch.zeros(pack.total, dtype=grad_dtype, device=device)

    def views(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[o: o + math.prod(s)].view(s) for o, s in zip(pack.offsets, shapes)]

    return Buffers(grad, out, views(grad), views(out))


def span(t: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` elements of ``t``'s storage from ``t``'s first one on (a run of arena members
    as one 1-D tensor)."""
    return torch.as_strided(t, (n,), (1,), t.storage_offset())
