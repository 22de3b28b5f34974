"""Leaf-granular host work: optimizers whose math is not element-wise (row and column
reductions, norms of a whole leaf: Adafactor) run one whole leaf at a time.

Each leaf's whole grad is copied to host memory (for GPU grads, into a pinned arena the
executor keeps per device: the grads of all such leaves, copied down at once on the D2H
stream), the optimizer's function runs on it with torch ops (which spread over torch's
intra-op threads), writes the new param over the grad's bytes, and the param is copied back
on the H2D stream as soon as its leaf is done, while the next leaf computes.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

import functional_offload.executor.faults as faults
from functional_offload.executor.run import HostStepError

__all__ = ["LeafItem", "run_leaves"]


class LeafItem(NamedTuple):
    """One leaf: its grad where it is, the param to write (None: the function updates the param
    itself, host params), and ``fn(grad_on_host, out_on_host_or_None)``."""

    path: str
    grad: torch.Tensor
    param: Optional[torch.Tensor]
    fn: Callable[[torch.Tensor, Optional[torch.Tensor]], None]


@torch.no_grad()
def run_leaves(executor: Any, device: torch.device, items: Sequence[LeafItem], ready: Any,
               begun: list[str]) -> None:
    """Run ``items`` (grads on ``device``, complete once ``ready``) one leaf at a time; errors
    name the leaf. Each leaf's path is appended to ``begun`` as its function starts (what a
    failure may have changed). The caller orders its stream after the copies out
    (``executor.order_after_copies``)."""
    if not items:
        return
    if device.type == "cpu":
        for item in items:
            _call(item, item.grad, item.param, begun)
        return
    t = executor.transport(device)
    with executor.holding(device):  # the arena serves one run at a time
        sizes = [i.grad.numel() * i.grad.element_size() for i in items]
        arena = executor.leaf_arena(device, sum(-(-s // 64) * 64 for s in sizes))
        t.wait_in(ready)
        t.wait_in(executor.leaf_arena_free(device))  # the last run's copies out read it
        views, offset = [], 0
        for item, size in zip(items, sizes):
            view = arena[offset: offset + size].view(item.grad.dtype).view(item.grad.shape)
            t.copy_in(view, item.grad)
            views.append((view, t.mark_in()))
            offset += -(-size // 64) * 64
        last = None
        for item, (view, event) in zip(items, views):
            t.wait_host(event)
            _call(item, view, view if item.param is not None else None, begun)
            if item.param is not None:
                t.copy_out(item.param, view)
                last = t.mark_out()
        executor.set_leaf_arena_free(device, last)


def _call(item: LeafItem, grad: torch.Tensor, out: Optional[torch.Tensor], begun: list[str]) -> None:
    try:
        if faults.active():  # fault injection treats each leaf as a chunk
            faults.before_chunk(0, [item.path])
        begun.append(item.path)
        item.fn(grad, out)
    except Exception as e:  # an interrupt goes through as itself
        raise HostStepError((item.path,), e) from e
