"""The optimizers' math with torch (foreach) ops, mirroring ``torch.optim`` op for op.

All functions update lists of tensors in place. ``params`` hold the values being optimized in
their compute dtype (fp32 masters, or the params themselves); grads and moments of another dtype
are upcast for the computation and moments are written back in their own dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

__all__ = ["AdamHyper", "SGDHyper", "adam_", "sgd_"]


class AdamHyper(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1 for the first update
    decoupled: bool  # AdamW (True) or Adam with L2 (False)


class SGDHyper(NamedTuple):
    lr: float
    momentum: float
    weight_decay: float
    nesterov: bool


def _as(xs: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x if x.dtype == p.dtype else x.to(p.dtype) for x, p in zip(xs, like)]


def _store(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        if d is not s:
            d.copy_(s)


def adam_(params: list[torch.Tensor], grads: list[torch.Tensor], mus: list[torch.Tensor],
          nus: list[torch.Tensor], h: AdamHyper) -> None:
    """One Adam/AdamW step in place (see :func:`functional_offload.adamw` for the math)."""
    if not params:
        return
    grads = _as(grads, params)
    m, v = _as(mus, params), _as(nus, params)
    if h.weight_decay != 0:
        if h.decoupled:
            torch._foreach_mul_(params, 1 - h.lr * h.weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=h.weight_decay)
    torch._foreach_lerp_(m, grads, 1 - h.beta1)
    torch._foreach_mul_(v, h.beta2)
    torch._foreach_addcmul_(v, grads, grads, 1 - h.beta2)
    bias_correction1 = 1 - h.beta1 ** h.step
    bias_correction2 = 1 - h.beta2 ** h.step
    step_size = h.lr / bias_correction1
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias_correction2 ** 0.5)
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(params, m, denom, -step_size)
    _store(mus, m)
    _store(nus, v)


def sgd_(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor],
         h: SGDHyper) -> None:
    """One SGD step in place (see :func:`functional_offload.sgd`); ``bufs`` empty without momentum."""
    if not params:
        return
    grads = _as(grads, params)
    if h.weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=h.weight_decay)
    if h.momentum != 0:
        b = _as(bufs, params)
        torch._foreach_mul_(b, h.momentum)
        torch._foreach_add_(b, grads)
        grads = torch._foreach_add(grads, b, alpha=h.momentum) if h.nesterov else b
        _store(bufs, b)
    torch._foreach_add_(params, grads, alpha=-h.lr)
