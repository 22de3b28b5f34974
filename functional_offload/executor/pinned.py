"""Host tensors moved into page-locked memory without torch's rounding.

torch's pinned allocator rounds every block up to a power of two (``CachingHostAllocator``), so
pinning a model's optimizer state tensor by tensor can take up to twice its bytes. :func:`pin_all`
lays the tensors out instead in arenas whose sizes are themselves powers of two — the binary
digits of the bytes left to place, largest first, each filled first-fit by decreasing size — so
that what is pinned exceeds the tensors' bytes by little more than the last arena's slack.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["empty_pinned", "pin_all"]

ALIGN = 64  # bytes: where each tensor starts in its arena
MIN_ARENA = 1 << 21  # bytes: the smallest arena (tiny tensors share one)


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def empty_pinned(specs: list[tuple[tuple[int, ...], torch.dtype]],
                 pin: bool = True) -> list[torch.Tensor]:
    """Empty contiguous tensors of the ``(shape, dtype)`` ``specs``, as views of pinned arenas
    (see the module); ``pin=False`` lays them out the same in pageable memory (what a machine
    without CUDA can test). Filling them in place needs no second copy of the bytes: state made
    here is never made in pageable memory first."""
    sizes = {i: -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
             for i, (shape, dtype) in enumerate(specs)}
    left = sum(sizes.values())
    arenas: list[list] = []  # [bytes, used]
    at: dict[int, tuple[int, int]] = {}  # tensor -> (arena, offset)
    for i in sorted(sizes, key=lambda i: -sizes[i]):
        n = sizes[i]
        k = next((k for k, (cap, used) in enumerate(arenas) if cap - used >= n), None)
        if k is None:  # a new arena: the largest binary digit of what is left, if it fits
            cap = max(MIN_ARENA, _floor_pow2(left))
            arenas.append([cap if cap >= n else _ceil_pow2(n), 0])
            k = len(arenas) - 1
        at[i] = (k, arenas[k][1])
        arenas[k][1] += n
        left -= n
    bufs = [torch.empty(used, dtype=torch.uint8, pin_memory=pin) for _, used in arenas]
    out = []
    for i, (shape, dtype) in enumerate(specs):
        k, offset = at[i]
        out.append(bufs[k][offset: offset + math.prod(shape) * dtype.itemsize]
                   .view(dtype).view(shape))
    return out


def pin_all(tensors: list[Optional[torch.Tensor]],
            pin: bool = True) -> list[Optional[torch.Tensor]]:
    """Copies of the CPU ``tensors`` (``None`` kept) as views of pinned arenas, each contiguous,
    of its tensor's shape and dtype (:func:`empty_pinned`)."""
    kept = [t for t in tensors if t is not None]
    views = iter(empty_pinned([(tuple(t.shape), t.dtype) for t in kept], pin))
    return [None if t is None else next(views).copy_(t) for t in tensors]
