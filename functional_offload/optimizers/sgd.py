"""SGD with momentum and Nesterov (torch's names and semantics): the specs and the constructor."""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple, Optional, Union

import torch

from functional_offload.base import Optimizer, ParamRefs
from functional_offload.executor import HostExecutor
from functional_offload.optimizers.delay import Delay
from functional_offload.optimizers.spec import Moment, OptimizerSpec, as_dtypes_of, check_nonneg
from functional_offload.optimizers.terminal import terminal
from functional_offload.placement import Placement
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["SGDState", "SGDHyper", "sgd", "spec"]


class SGDState(NamedTuple):
    """State of :func:`sgd`."""

    count: torch.Tensor  # int64 scalar on the CPU: updates applied so far (or a mark, see fo.base)
    momentum: Params  # momentum buffers mirroring params (empty tuple without momentum)
    master: Params  # as in AdamState: master values, None where the param is its own master
    ema: Params  # fp32 EMA of the values (ema_decay), mirrors params; () without
    params: ParamRefs  # the live params, updated in place (not checkpointed)


class SGDHyper(NamedTuple):
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool


def reference(params: list, grads: list, moments: list, h: SGDHyper) -> None:
    """One SGD step in place, op for op as ``torch.optim.SGD``'s single-tensor code."""
    if not params:
        return
    grads = as_dtypes_of(grads, params)
    if h.weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=h.weight_decay)
    if moments:
        bufs = moments[0]
        b = as_dtypes_of(bufs, params)
        torch._foreach_mul_(b, h.momentum)
        torch._foreach_add_(b, grads)
        grads = torch._foreach_add(grads, b, alpha=h.momentum) if h.nesterov else b
        for d, s in zip(bufs, b):
            if d is not s:
                d.copy_(s)
    torch._foreach_add_(params, grads, alpha=-h.lr)


def fused(params: list, grads: list, moments: list, h: SGDHyper) -> None:
    """torch's fused CUDA kernel for fp32 values and buffers; the reference otherwise (each
    list shares one device and dtype: its first tensor says which)."""
    bufs = moments[0] if moments else []
    if not params or not all(x[0].is_cuda and x[0].dtype == torch.float32 for x in (params, bufs) if x):
        reference(params, grads, moments, h)
        return
    torch._fused_sgd_(params, grads, bufs,
                      weight_decay=h.weight_decay, momentum=h.momentum, lr=h.lr, dampening=0.0,
                      nesterov=h.nesterov, maximize=False, is_first_step=False)


def ahead_scalars(h: SGDHyper, h2: SGDHyper, momentum: bool) -> list[float]:
    """The native ops' look-ahead scalars (math.cpp): ``-lr'``, the factors of the momentum
    (with ``momentum``) and of the value in the next step's change for a zero grad, the rate
    of its grad."""
    mu, wd, k = h2.momentum, h2.weight_decay, 1 + h2.momentum if h2.nesterov else 1.0
    factors = [mu * mu if h2.nesterov else mu, k * wd] if momentum else [wd]
    return [-h2.lr, *factors, k * h2.lr]


def ahead(params: list, moments: list, h: SGDHyper, h2: SGDHyper) -> tuple[list, list]:
    r"""The look-ahead of the step after ``h``'s (``h2``'s, primed), from the values and
    momentum buffers ``h``'s step left: that step gives :math:`\text{base} - \text{rate}\cdot g`
    for its grad :math:`g`, with (:math:`k = 1 + \mu'` with Nesterov, else 1)

    .. math::

        \text{base} = \theta_t - \eta'\,(\mu' b_t + k\lambda'\theta_t) \;(\text{Nesterov: }
        \mu'^2 b_t), \qquad \text{rate} = k\,\eta'

    Op for op as the native ops' ``ahead``."""
    scalars = ahead_scalars(h, h2, bool(moments))
    if moments:
        step, mu, wd, rate = scalars
        change = torch._foreach_mul(as_dtypes_of(moments[0], params), mu)
        if wd != 0:  # (0 * inf would make an infinite param's base NaN)
            change = torch._foreach_add(change, torch._foreach_mul(params, wd))
    else:
        step, wd, rate = scalars
        change = torch._foreach_mul(params, wd) if wd != 0 else None
    bases = (torch._foreach_add(params, torch._foreach_mul(change, step)) if change is not None
             else [p.clone() for p in params])
    return bases, [torch.full_like(b, rate) for b in bases]


def land_ahead(params: list, bases: list, rates: list, grads: list, h: SGDHyper,
               h2: SGDHyper) -> None:
    """The device side of :func:`ahead`: each base (fp32) made ``base - rate * g`` for its
    grad ``g``, the rate taken from ``h2`` in double: the same for every element, where the
    ``rates`` that went up hold it rounded to the params' dtype (its error, a bf16 rounding
    of the whole step, would move the landed params of a large step off the exact ones)."""
    torch._foreach_add_(bases, grads, alpha=-ahead_scalars(h, h2, False)[-1])


@functools.lru_cache(maxsize=None)
def spec(momentum: bool, nesterov: bool = False) -> OptimizerSpec:
    """The spec of SGD without momentum, with momentum, or with Nesterov momentum."""
    def hyper(v: Mapping[str, float], step: int) -> SGDHyper:
        return SGDHyper(v["lr"], v["weight_decay"], v.get("momentum", 0.0), nesterov)

    checks = {"lr": check_nonneg, "weight_decay": check_nonneg}
    if momentum:
        checks["momentum"] = check_nonneg
    return OptimizerSpec(
        name="sgd", state=SGDState,
        moments=(Moment("momentum", "momentum_buffer", "momentum_dtype"),) if momentum else (),
        hyperparameters=checks, hyper=hyper, reference=reference, device=fused,
        native="sgd_momentum" if momentum else "sgd",
        scalars=(lambda h: [-h.lr, h.weight_decay, h.momentum, float(h.nesterov)]) if momentum
        else (lambda h: [-h.lr, h.weight_decay]),
        ahead=ahead, ahead_scalars=functools.partial(ahead_scalars, momentum=momentum),
        land_ahead=land_ahead,
    ).check()


def sgd(lr: ScalarOrSchedule = 1e-3, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: ScalarOrSchedule = 0.0, *, placement: Optional[Placement] = None,
        master_dtype: torch.dtype = torch.float32, momentum_dtype: Optional[torch.dtype] = None,
        weight_decay_mask: Any = None, ema_decay: Optional[float] = None,
        executor: Optional[HostExecutor] = None, cpu_kernel: str = "auto",
        delayed: Union[bool, Delay] = False, store_param_remainders: bool = False) -> Optimizer:
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
      lr: learning rate, or a schedule of the number of updates already applied (default
        1e-3, as torch).
      momentum: :math:`\mu \ge 0` (a float or a schedule when it is not 0).
      nesterov: Nesterov momentum (needs ``momentum > 0``).
      weight_decay: :math:`\lambda`, coupled as L2; a float or a schedule.
      placement, master_dtype, weight_decay_mask, ema_decay, executor, cpu_kernel, delayed,
        store_param_remainders: as in :func:`adamw` (delayed plain SGD without the look-ahead:
        :math:`\theta_{t+1} = \theta_t - \eta\nabla L(\theta_{t-1})`; with it, the forwards
        read the run without delay's params but for rounding).
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
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be True or False, got {nesterov!r}")
    has_momentum = callable(momentum) or check_nonneg("momentum", momentum) > 0
    if nesterov and not has_momentum:
        raise ValueError("nesterov=True needs momentum > 0 (as in torch.optim.SGD)")
    hypers: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if has_momentum:
        hypers["momentum"] = momentum
    return terminal(spec(has_momentum, nesterov), hypers,
                    moment_dtypes={"momentum": momentum_dtype}, placement=placement,
                    master_dtype=master_dtype, weight_decay_mask=weight_decay_mask,
                    ema_decay=ema_decay, executor=executor, cpu_kernel=cpu_kernel, delayed=delayed,
                    store_param_remainders=store_param_remainders)
