"""Lion (Chen et al., 2023): the spec and the constructor."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Union

import torch

from functional_offload.base import Optimizer, ParamRefs
from functional_offload.executor import HostExecutor
from functional_offload.optimizers.delay import Delay
from functional_offload.optimizers.spec import (Moment, OptimizerSpec, as_dtypes_of, check_beta,
                                                check_nonneg, check_schedule)
from functional_offload.optimizers.terminal import terminal
from functional_offload.placement import Placement
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["LionState", "LionHyper", "lion", "LION"]


class LionState(NamedTuple):
    """State of :func:`lion`."""

    count: torch.Tensor  # int64 scalar on the CPU: updates applied so far (or a mark, see fo.base)
    mu: Params  # the momentum, mirrors params; mu_dtype; on the device the placement chose
    master: Params  # as in AdamState: master values, None where the param is its own master
    ema: Params  # fp32 EMA of the values (ema_decay), mirrors params; () without
    params: ParamRefs  # the live params, updated in place (not checkpointed)


class LionHyper(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    weight_decay: float


def reference(params: list, grads: list, moments: list, h: LionHyper) -> None:
    """One Lion step in place; each product rounds once, as the native op does."""
    if not params:
        return
    (mus,) = moments
    grads, m = as_dtypes_of(grads, params), as_dtypes_of(mus, params)
    if h.weight_decay != 0:
        torch._foreach_mul_(params, 1 - h.lr * h.weight_decay)
    c = torch._foreach_add(torch._foreach_mul(m, h.beta1), torch._foreach_mul(grads, 1 - h.beta1))
    torch._foreach_add_(params, torch._foreach_sign(c), alpha=-h.lr)
    new_m = torch._foreach_add(torch._foreach_mul(m, h.beta2), torch._foreach_mul(grads, 1 - h.beta2))
    for d, s in zip(mus, new_m):
        d.copy_(s)


def ahead(params: list, moments: list, h: LionHyper, h2: LionHyper) -> tuple[list, list]:
    r"""The look-ahead of the step after ``h``'s (``h2``'s, primed): the decayed values
    :math:`\theta_t (1 - \eta'\lambda')` and :math:`\beta_1' m_t`, from which
    :func:`land_ahead` makes that step for its grads exactly as the step does (but for the
    rounding of the momentum term to the params' dtype and of the base to within
    :math:`2^{-8}` of a bf16 step: :func:`~functional_offload.kernels.remainder.split_base`).
    Op for op as the native op's ``ahead``."""
    (mus,) = moments
    m = as_dtypes_of(mus, params)
    return torch._foreach_mul(params, 1 - h2.lr * h2.weight_decay), torch._foreach_mul(m, h2.beta1)


def land_ahead(params: list, bases: list, moms: list, grads: list, h: LionHyper,
               h2: LionHyper) -> None:
    r"""The device side of :func:`ahead`: each base (fp32) made :math:`\text{base} - \eta'\,
    \mathrm{sign}(\beta_1' m_t + (1-\beta_1')\, g)` for the grads :math:`g`."""
    c = torch._foreach_mul(grads, 1 - h2.beta1)
    torch._foreach_add_(c, moms)
    torch._foreach_sign_(c)
    torch._foreach_add_(bases, c, alpha=-h2.lr)


def _hyper(v: Mapping[str, float], step: int) -> LionHyper:
    return LionHyper(v["lr"], v["beta1"], v["beta2"], v["weight_decay"])


LION = OptimizerSpec(
    name="lion", state=LionState, moments=(Moment("mu", "exp_avg", "mu_dtype"),),
    hyperparameters={"lr": check_nonneg, "beta1": check_beta, "beta2": check_beta,
                     "weight_decay": check_nonneg},
    hyper=_hyper, reference=reference, native="lion",
    scalars=lambda h: [1 - h.lr * h.weight_decay, h.beta1, 1 - h.beta1, h.beta2, 1 - h.beta2, -h.lr],
    ahead=ahead, ahead_scalars=lambda h, h2: [1 - h2.lr * h2.weight_decay, h2.beta1],
    land_ahead=land_ahead,
).check()


def lion(lr: ScalarOrSchedule = 1e-4, betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.99),
         weight_decay: ScalarOrSchedule = 0.0, *, placement: Optional[Placement] = None,
         master_dtype: torch.dtype = torch.float32, mu_dtype: Optional[torch.dtype] = None,
         weight_decay_mask: Any = None, ema_decay: Optional[float] = None,
         executor: Optional[HostExecutor] = None, cpu_kernel: str = "auto",
         delayed: Union[bool, Delay] = False, store_param_remainders: bool = False) -> Optimizer:
    r"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

    .. math::

        \theta &\leftarrow \theta\,(1 - \eta\lambda) \\
        c_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t \\
        \theta_t &= \theta - \eta\, \operatorname{sign}(c_t) \\
        m_t &= \beta_2 m_{t-1} + (1 - \beta_2)\, g_t

    One moment, so the cheapest host step of all: with fp32 master and momentum a host-resident
    bf16 param costs 8 bytes of state, and the host kernel reads and writes 20 bytes per element
    (AdamW: 12 and 28). Lion wants a smaller ``lr`` than AdamW (3-10x) and a larger
    ``weight_decay`` (decoupled, as here).

    Args:
      lr: learning rate :math:`\eta`, a float or a schedule of the step count.
      betas: :math:`(\beta_1, \beta_2)`, each in [0, 1).
      weight_decay: :math:`\lambda`, decoupled.
      placement, master_dtype, weight_decay_mask, ema_decay, executor, cpu_kernel, delayed,
        store_param_remainders: as in :func:`~functional_offload.adamw`.
      mu_dtype: dtype of the momentum (default fp32 for low-precision params).

    Returns:
      An :class:`~functional_offload.Optimizer` whose state is a :class:`LionState`.

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.lion(lr=0.1)
        >>> params, state = opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init({"w": torch.zeros(2)}))
        >>> params["w"]
        tensor([-0.1000,  0.1000])
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_schedule(f"betas[{i}]", b, check_beta)
    return terminal(LION, {"lr": lr, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay},
                    moment_dtypes={"mu": mu_dtype}, placement=placement, master_dtype=master_dtype,
                    weight_decay_mask=weight_decay_mask, ema_decay=ema_decay, executor=executor,
                    cpu_kernel=cpu_kernel, delayed=delayed,
                    store_param_remainders=store_param_remainders)
