"""SGD with momentum and Nesterov (torch's names and semantics), with masters and placement."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from functional_offload.base import Optimizer, ParamRefs
from functional_offload.executor import HostExecutor
from functional_offload.kernels import cpu, gpu, reference
from functional_offload.kernels.reference import SGDHyper
from functional_offload.optimizers._terminal import Terminal, check_nonneg
from functional_offload.placement import Placement
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of :func:`sgd`."""

    count: torch.Tensor  # int64 scalar on the CPU: updates applied so far (-1 once consumed)
    momentum: Params  # momentum buffers mirroring params (empty tuple without momentum)
    master: Params  # as in AdamState: master values, None where the param is its own master
    params: ParamRefs  # the live params, updated in place (not checkpointed)


def _host_math(value: torch.Tensor, g: torch.Tensor, moments: tuple, out: Optional[torch.Tensor],
               h: SGDHyper) -> None:
    buf = moments[0] if moments else None
    reference.sgd_([value], [g], [buf] if buf is not None else [], h)
    if out is not None:
        out.copy_(value)


def sgd(lr: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: ScalarOrSchedule = 0.0, *, placement: Optional[Placement] = None,
        master_dtype: torch.dtype = torch.float32, momentum_dtype: Optional[torch.dtype] = None,
        weight_decay_mask: Any = None, executor: Optional[HostExecutor] = None,
        cpu_kernel: str = "auto", delayed: bool = False) -> Optimizer:
    r"""Stochastic gradient descent, as ``torch.optim.SGD`` (no dampening).

    With :math:`\mu` the momentum, :math:`\lambda` the weight decay and :math:`b_0 = 0`:

    .. math::

        g_t &\leftarrow g_t + \lambda\,\theta \\
        b_t &= \mu\, b_{t-1} + g_t \\
        d_t &= g_t + \mu\, b_t \ \text{(Nesterov)} \quad\text{or}\quad b_t \\
        \theta_t &= \theta - \eta_t\, d_t

    Without momentum, :math:`d_t = g_t` and the state holds no buffers. A zero buffer makes
    the first step's :math:`b_1 = g_1`, exactly torch's first-step copy.

    Args:
      lr: learning rate, or a schedule of the number of updates already applied.
      momentum: :math:`\mu \ge 0`.
      nesterov: Nesterov momentum (needs ``momentum > 0``).
      weight_decay: :math:`\lambda`, coupled as L2; a float or a schedule.
      placement, master_dtype, weight_decay_mask, executor, cpu_kernel, delayed: as in
        :func:`adamw` (delayed plain SGD: :math:`\theta_{t+1} = \theta_t - \eta\nabla L(\theta_{t-1})`).
      momentum_dtype: dtype of the buffers (default fp32 for low-precision params).

    Returns:
      An :class:`~functional_offload.Optimizer` whose state is an :class:`SGDState`.

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.sgd(lr=0.5, momentum=0.9)
        >>> params, state = opt.update({"w": torch.ones(2)}, opt.init({"w": torch.zeros(2)}))
        >>> params["w"]
        tensor([-0.5000, -0.5000])
    """
    mom = check_nonneg("momentum", momentum)
    if nesterov and mom == 0:
        raise ValueError("nesterov=True needs momentum > 0 (as in torch.optim.SGD)")
    t = Terminal(
        "sgd", SGDState, [("momentum", momentum_dtype)] if mom else [], lr, weight_decay,
        lambda lr_t, wd_t, step: SGDHyper(lr_t, mom, wd_t, bool(nesterov)),
        lambda values, grads, moms, h: gpu.sgd_(values, grads, moms[0] if moms else [], h),
        _host_math, cpu.add_sgd, placement=placement, master_dtype=master_dtype,
        weight_decay_mask=weight_decay_mask, executor=executor, cpu_kernel=cpu_kernel,
        delayed=delayed)
    return Optimizer(t.init, t.update)
