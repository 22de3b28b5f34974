"""Device-resident state: torch's fused multi-tensor kernels where they apply, else the reference.

On CUDA with fp32 values and moments, ``torch._fused_adamw_`` / ``_fused_adam_`` / ``_fused_sgd_``
update a whole group in a few launches (grads of another dtype are cast to fp32 first, on the
device). Anything else (other devices, low-precision moments) takes the reference foreach path.
"""

from __future__ import annotations

import torch

from functional_offload.kernels import reference
from functional_offload.kernels.reference import AdamHyper, SGDHyper

__all__ = ["adam_", "sgd_"]


def _fusable(*groups: list[torch.Tensor]) -> bool:
    return all(t.is_cuda and t.dtype == torch.float32 for g in groups for t in g)


def _fp32(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g if g.dtype == torch.float32 else g.float() for g in grads]


def adam_(params: list[torch.Tensor], grads: list[torch.Tensor], mus: list[torch.Tensor],
          nus: list[torch.Tensor], h: AdamHyper) -> None:
    if not params:
        return
    if not _fusable(params, mus, nus):
        reference.adam_(params, grads, mus, nus, h)
        return
    step = torch.full((), float(h.step), dtype=torch.float32, device=params[0].device)
    fn = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    fn(params, _fp32(grads), mus, nus, [], [step] * len(params), lr=h.lr, beta1=h.beta1,
       beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)


def sgd_(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor],
         h: SGDHyper) -> None:
    if not params:
        return
    if not _fusable(params, bufs):
        reference.sgd_(params, grads, bufs, h)
        return
    torch._fused_sgd_(params, _fp32(grads), bufs, weight_decay=h.weight_decay,
                      momentum=h.momentum, lr=h.lr, dampening=0.0, nesterov=h.nesterov,
                      maximize=False, is_first_step=False)
