"""Host tensors moved into page-locked memory without torch's rounding.

torch's pinned allocator rounds every block up to a power of two (``CachingHostAllocator``), so
pinning a model's optimizer state tensor by tensor can take up to twice its bytes. :func:`pin_all`
lays the tensors out instead in arenas whose sizes are themselves powers of two — the binary
digits of the bytes left to place, largest first, each filled first-fit by decreasing size — so
that what is pinned exceeds the tensors' bytes by little more than the last arena's slack.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["pin_all"]

ALIGN = 64  # bytes: where each tensor starts in its arena
MIN_ARENA = 1 << 21  # bytes: the smallest arena (tiny tensors share one)


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pin_all(tensors: list[Optional[torch.Tensor]],
            pin: bool = True) -> list[Optional[torch.Tensor]]:
    """Copies of the CPU ``tensors`` (``None`` kept) as views of pinned arenas, each contiguous,
    of its tensor's shape and dtype; ``pin=False`` lays them out the same in pageable memory
    (what a machine without CUDA can test)."""
    sizes = {i: -(-t.numel() * t.element_size() // ALIGN) * ALIGN
             for i, t in enumerate(tensors) if t is not None}
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
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for i, (k, offset) in at.items():
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        view = bufs[k][offset: offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[i] = view
    return out
