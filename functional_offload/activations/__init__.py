"""Activation memory: keep, offload to pinned host memory, or recompute, per layer group.

The forward marks layer groups. Tensors autograd saves in an offloaded group are copied
device→host into pinned buffers from a reused pool and come back during backward,
``prefetch`` groups ahead, on the device's two copy streams (the ones the host executors use);
a recomputed group runs under ``torch.utils.checkpoint`` (non-reentrant) and saves only its
inputs. The bytes whose copy has not landed are bounded
(their sources stay alive until then), so offloading ``k`` groups lowers the peak by close to
their share. With ``budget_bytes`` the first steps of each input shape are measured (one, or
two when keeping everything does not fit and a group can be recomputed) and a plan chooses, per
group, what meets the budget in the least time (:func:`plan`, :class:`ActivationPlan`).

Functional loops use :meth:`ActivationOffload.value_and_grad` (``torch.func.grad`` refuses
saved-tensor hooks); module loops wrap the forward in :meth:`ActivationOffload.record` and call
``.backward()``. Saved tensors are checked for in-place changes as autograd checks them.

Example::

    import torch, functional_offload as fo

    def block(w, x):                        # one layer group: a function of its params and input
        return x + torch.tanh(x @ w)

    params = [torch.randn(64, 64) * 0.1 for _ in range(4)]
    x = torch.randn(32, 64)
    off = fo.activations.ActivationOffload(len(params), budget_bytes=8 << 30)

    def loss_fn(params, x):
        for i, w in enumerate(params):
            x = off.run(i, block, w, x)
        return x.square().mean()

    loss, grads = off.value_and_grad(loss_fn)(params, x)  # profiles; keeping everything fits
    print(off.plan)                         # per group: bytes, keep / offload / recompute, +ms
"""

from functional_offload.activations.offload import ActivationOffload
from functional_offload.activations.cost_model import (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD,
                                                       Profile, simulate)
from functional_offload.activations.planner import ActivationPlan, plan

__all__ = ["ActivationOffload", "ActivationPlan", "Profile", "plan", "simulate", "KEEP",
           "OFFLOAD", "RECOMPUTE", "RECOMPUTE_OFFLOAD"]
