"""Adam and AdamW (torch's names and semantics), with fp32 masters and placement."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from functional_offload.base import Optimizer, ParamRefs
from functional_offload.executor import HostExecutor
from functional_offload.kernels import cpu, gpu, reference
from functional_offload.kernels.reference import AdamHyper
from functional_offload.optimizers._terminal import Terminal, check_beta, check_nonneg
from functional_offload.placement import Placement
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`."""

    count: torch.Tensor  # int64 scalar on the CPU: updates applied so far (-1 once consumed)
    mu: Params  # first moment, mirrors params; mu_dtype; on the device the placement chose
    nu: Params  # second moment, mirrors params; nu_dtype; same device as mu
    master: Params  # master values (master_dtype) where the param is low precision or its
    #                 state is on the host while it is not; None leaves elsewhere
    params: ParamRefs  # the live params, updated in place (not checkpointed)


def _host_math(value: torch.Tensor, g: torch.Tensor, moments: tuple, out: Optional[torch.Tensor],
               h: AdamHyper) -> None:
    mu, nu = moments
    reference.adam_([value], [g], [mu], [nu], h)
    if out is not None:
        out.copy_(value)


def _adam(decoupled: bool, name: str, lr: ScalarOrSchedule, betas: tuple[float, float],
          eps: float, weight_decay: ScalarOrSchedule, placement: Optional[Placement],
          master_dtype: torch.dtype, mu_dtype: Optional[torch.dtype],
          nu_dtype: Optional[torch.dtype], weight_decay_mask: Any,
          executor: Optional[HostExecutor], cpu_kernel: str, delayed: bool) -> Optimizer:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    b1, b2 = check_beta("betas[0]", betas[0]), check_beta("betas[1]", betas[1])
    eps = check_nonneg("eps", eps)
    t = Terminal(
        name, AdamState, [("mu", mu_dtype), ("nu", nu_dtype)], lr, weight_decay,
        lambda lr_t, wd_t, step: AdamHyper(lr_t, b1, b2, eps, wd_t, step, decoupled),
        lambda values, grads, moms, h: gpu.adam_(values, grads, moms[0], moms[1], h),
        _host_math, cpu.add_adam, placement=placement, master_dtype=master_dtype,
        weight_decay_mask=weight_decay_mask, executor=executor, cpu_kernel=cpu_kernel,
        delayed=delayed)
    return Optimizer(t.init, t.update)


def adamw(lr: ScalarOrSchedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: ScalarOrSchedule = 1e-2, *,
          placement: Optional[Placement] = None, master_dtype: torch.dtype = torch.float32,
          mu_dtype: Optional[torch.dtype] = None, nu_dtype: Optional[torch.dtype] = None,
          weight_decay_mask: Any = None, executor: Optional[HostExecutor] = None,
          cpu_kernel: str = "auto", delayed: bool = False) -> Optimizer:
    r"""AdamW (Loshchilov & Hutter): Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    With :math:`t` the step (1 for the first update), :math:`\eta_t` the learning rate
    (``lr`` or ``lr(t - 1)``), :math:`\lambda` the weight decay and :math:`g_t` the gradient:

    .. math::

        \theta &\leftarrow \theta\,(1 - \eta_t\lambda) \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t \\
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2)\, g_t^2 \\
        \theta_t &= \theta - \frac{\eta_t}{1 - \beta_1^t}\,
                   \frac{m_t}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon}

    :math:`\theta` is the fp32 master of a bf16/fp16 param (the param is then written back as
    ``master.to(param.dtype)``), else the param itself, updated in place.

    Args:
      lr: learning rate, or a schedule: a callable of the number of updates already applied.
      betas: :math:`(\beta_1, \beta_2)`, each in [0, 1).
      eps: :math:`\epsilon`, added outside the square root, as torch does.
      weight_decay: :math:`\lambda`, decoupled (multiplies the param by :math:`1-\eta_t\lambda`);
        a float or a schedule, like ``lr``.
      placement: where each leaf's state lives (default :func:`placement.on_host`).
      master_dtype: dtype of the masters of low-precision params (fp32).
      mu_dtype, nu_dtype: moment dtypes (default fp32 for low-precision params, else the
        param's dtype). bf16 moments halve their memory; the math still runs in fp32.
      weight_decay_mask: a pytree of bools mirroring the params (or a callable
        ``params -> tree``); leaves marked False get no weight decay (biases, norms).
      executor: the :class:`~functional_offload.executor.HostExecutor` running host-resident
        leaves (chunk size, ring slots, threads); one is made by default, with a thread per
        physical core (one fewer with ``delayed=True``: the training loop runs meanwhile).
      cpu_kernel: ``"auto"`` (the native one-pass kernel for host-resident state of GPU
        params, when it builds; torch ops for CPU params), ``"native"`` or ``"torch"``.
      delayed: ZeRO-Offload's delayed parameter update for the host-resident leaves:
        ``update`` starts their host step in the background and returns at once; the new
        params land at the *next* ``update`` (or :func:`~functional_offload.flush`), so the
        gradient applied was computed at the params of one step earlier:
        :math:`\theta_{t+1} = \theta_t - \eta\,\Delta(\nabla L(\theta_{t-1}))`. The first
        update leaves these params unchanged. Device-resident leaves update at once.

    Returns:
      An :class:`~functional_offload.Optimizer` whose state is an :class:`AdamState`.

    Example::

        >>> import torch, functional_offload as fo
        >>> params = {"w": torch.ones(3)}
        >>> opt = fo.adamw(lr=0.1, weight_decay=0.0)
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.ones(3)}, state)
        >>> params["w"]
        tensor([0.9000, 0.9000, 0.9000])

    One count per state: a leaf skipped on some step (its grad ``None``) still uses the shared
    step count for its bias correction, where ``torch.optim`` keeps one count per param.
    """
    return _adam(True, "adamw", lr, betas, eps, weight_decay, placement, master_dtype,
                 mu_dtype, nu_dtype, weight_decay_mask, executor, cpu_kernel, delayed)


def adam(lr: ScalarOrSchedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
         eps: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0, *,
         placement: Optional[Placement] = None, master_dtype: torch.dtype = torch.float32,
         mu_dtype: Optional[torch.dtype] = None, nu_dtype: Optional[torch.dtype] = None,
         weight_decay_mask: Any = None, executor: Optional[HostExecutor] = None,
         cpu_kernel: str = "auto", delayed: bool = False) -> Optimizer:
    r"""Adam (Kingma & Ba) with weight decay coupled as L2, as ``torch.optim.Adam``.

    The same as :func:`adamw` except for the weight decay, which is added to the gradient:

    .. math::

        g_t &\leftarrow g_t + \lambda\,\theta \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t \\
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2)\, g_t^2 \\
        \theta_t &= \theta - \frac{\eta_t}{1 - \beta_1^t}\,
                   \frac{m_t}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon}

    Args and returns: as :func:`adamw` (``weight_decay`` defaults to 0, as in torch).

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.adam(lr=0.1)
        >>> params, state = opt.update({"w": torch.ones(2)}, opt.init({"w": torch.zeros(2)}))
        >>> params["w"]
        tensor([-0.1000, -0.1000])
    """
    return _adam(False, "adam", lr, betas, eps, weight_decay, placement, master_dtype,
                 mu_dtype, nu_dtype, weight_decay_mask, executor, cpu_kernel, delayed)
