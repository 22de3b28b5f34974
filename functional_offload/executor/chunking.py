"""Chunking: host leaves laid end to end, cut into chunks of at most ``chunk_bytes``.

A chunk takes what has arrived (all leaves at once for a plain update; leaf by leaf with grad
streaming) up to ``chunk_bytes`` of grads, segment offsets aligned to 64 bytes; it waits for an
arrival only while it holds nothing, so a chunk never waits for leaves to fill it. A leaf with
block-wise 8-bit moments is cut on their blocks.
"""

from __future__ import annotations

import math
import queue as queue_mod
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import torch

from functional_offload.kernels.blockwise import BLOCK as QBLOCK
from functional_offload.kernels.blockwise import is_blockwise

__all__ = ["HostLeaf", "Segment", "cut", "arrived", "block_size", "ALIGN", "RAMP_MIN"]

ALIGN = 64  # bytes; segment offsets in a slot are aligned to this
_MIN_BLOCK = 1 << 14  # elements: smaller blocks cost more to claim than they compute
_BLOCKS_PER_THREAD = 4
RAMP_MIN = 1 << 20  # bytes: a ramped run's first chunk at least (many 8-bit blocks of grads)


class HostLeaf(NamedTuple):
    """One host-resident leaf of a run, flattened to 1-D views."""

    path: str
    grad: torch.Tensor  # 1-D, on the device the copies come from (a GPU, or the CPU)
    out: Optional[torch.Tensor]  # 1-D: where the new param goes (the param, a delayed step's
    #                               buffer or device scratch); None: the value is the param
    state: tuple[torch.Tensor, ...]  # host tensors, 1-D: (value fp32, moments...)
    hyper: Any  # per-leaf scalars handed to the kernel
    targets: tuple[torch.Tensor, ...] = ()  # new (value, moments...) go here; () = in place
    ema: Optional[torch.Tensor] = None  # fp32 EMA of the value (1-D), or None
    ema_decay: float = 0.0
    ema_target: Optional[torch.Tensor] = None  # the new EMA goes here; None = in place
    settled: Optional["HostLeaf"] = None  # the leaf writing in place: used instead of this one
    #                                       when its run is settled before the leaf begins
    high: Optional[torch.Tensor] = None  # 1-D, pinned: where the kernel writes the new param's
    #   bits (a split master's high half); a device ``out`` is copied up from here, not the slot
    ahead: Optional[torch.Tensor] = None  # 1-D, like ``out``: a look-ahead's rate (``out`` then
    #   gets its base; kernels/host.py); its run is opened with ``ahead=True``
    ahead_hyper: Any = None  # the next step's hyperparameters, for the look-ahead
    residual: Optional[torch.Tensor] = None  # 1-D int8, with ``ahead`` for bf16 grads: the byte
    #   of each base's fp32 bits below its bf16 (kernels/remainder.py, ``split_base``)
    param_high: bool = False  # ``state[0]`` is the param's own bits on its device (the high half
    #   of a remainder-only split master, kernels/remainder.py): copied down into the slot's
    #   new-params half with the grad, stepped there in place, and copied up from there to ``out``
    members: tuple[str, ...] = ()  # the paths of the params tree's leaves it holds, where more
    #   than one (a packed run of small leaves); () for one leaf, ``path``


class Segment(NamedTuple):
    leaf: int
    start: int
    stop: int
    offset: int  # byte offset in the slot half


def cut(arrivals: "queue_mod.Queue", chunk_bytes: int, leaves: list[HostLeaf],
        ready: list[Any], ramp: bool = False) -> Iterator[list[Segment]]:
    """Chunks of the leaves coming from ``arrivals`` (``(leaf, ready event)`` items, or
    iterables of them that arrive together, taken as they are cut; ``None`` at the end),
    appending each leaf to ``leaves`` and its event to ``ready`` as it arrives. ``ramp``: the
    first chunks are smaller, from ``chunk_bytes / 16`` (at least :data:`RAMP_MIN` bytes)
    doubling up to ``chunk_bytes``, so that the kernel starts on the first while the rest are
    cut and handed to it."""
    pos: Optional[tuple[int, int]] = None  # (leaf, first element) of the leaf being cut
    ended = False
    batch: Iterator[tuple[HostLeaf, Any]] = iter(())  # the rest of a list that arrived together
    budget = chunk_bytes  # the next chunk's
    if ramp:
        budget = min(chunk_bytes, max(RAMP_MIN, chunk_bytes // 16 // ALIGN * ALIGN))
    while True:
        cur: list[Segment] = []
        used = 0
        room_bytes, budget = budget, min(chunk_bytes, 2 * budget)
        while True:
            if pos is None:
                item = next(batch, None)
                if item is None:
                    if ended:
                        break
                    try:
                        item = arrivals.get(block=not cur)
                    except queue_mod.Empty:
                        break
                    if item is None:
                        ended = True
                        break
                    if not isinstance(item, tuple):  # several that arrived together
                        batch = iter(item)
                        continue
                leaves.append(item[0])
                ready.append(item[1])
                pos = (len(leaves) - 1, 0)
            i, start = pos
            n, size = leaves[i].grad.numel(), leaves[i].grad.element_size()
            room = (room_bytes - used) // size
            if start + room >= n:  # the rest fits (whatever the unit): the leaf ends here
                stop = n
            else:
                unit = QBLOCK if any(is_blockwise(x) for x in leaves[i].state) else ALIGN  # cut
                if start < n and room < min(n - start, unit):  # slot full  # on 8-bit blocks
                    break
                stop = start + room // unit * unit
            if stop > start:
                cur.append(Segment(i, start, stop, used))
                used += -(-(stop - start) * size // ALIGN) * ALIGN
            pos = None if stop == n else (i, stop)
        if not cur:
            return
        yield cur


def arrived(leaves: Sequence[HostLeaf], ready: Any) -> "queue_mod.Queue":
    """``leaves`` as arrivals that have all come, each with the event ``ready``."""
    q: "queue_mod.Queue" = queue_mod.Queue()
    q.put([(leaf, ready) for leaf in leaves])
    q.put(None)
    return q


def block_size(chunk: Sequence[Segment], threads: int) -> int:
    """Elements per claimed block: about ``1 / (4·threads)`` of the chunk, a multiple of the
    8-bit moments' blocks (so that a claimed block starts on one)."""
    size = max(_MIN_BLOCK, math.ceil(sum(s.stop - s.start for s in chunk) / (threads * _BLOCKS_PER_THREAD)))
    return -(-size // QBLOCK) * QBLOCK
