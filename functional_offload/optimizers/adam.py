"""Adam and AdamW (torch's names and semantics): the spec and the constructors."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Union

import torch

from functional_offload.base import Optimizer, ParamRefs
from functional_offload.executor import HostExecutor
from functional_offload.kernels import adam_cuda, remainder, te_adam
from functional_offload.kernels.blockwise import is_blockwise
from functional_offload.optimizers.delay import Delay
from functional_offload.optimizers.spec import (Moment, OptimizerSpec, as_dtypes_of,
                                                check_beta, check_nonneg, check_schedule)
from functional_offload.optimizers.terminal import terminal
from functional_offload.placement import Placement
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["AdamState", "AdamHyper", "adam", "adamw", "ADAM", "ADAMW"]


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`."""

    count: torch.Tensor  # int64 scalar on the CPU: updates applied so far (or a mark, see fo.base)
    mu: Params  # first moment, mirrors params; mu_dtype; on the device the placement chose
    nu: Params  # second moment, mirrors params; nu_dtype; same device as mu
    master: Params  # master values (master_dtype) where the param is low precision or its
    #                 state is on the host while it is not; None leaves elsewhere
    ema: Params  # fp32 EMA of the values (ema_decay), mirrors params; () without
    params: ParamRefs  # the live params, updated in place (not checkpointed)


class AdamHyper(NamedTuple):
    """One step's values for the math."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1 for the first update
    decoupled: bool  # AdamW (True) or Adam with L2 (False)


def _store(dst: list, src: list) -> None:
    for d, s in zip(dst, src):
        if d is not s:
            d.copy_(s)


def reference(params: list, grads: list, moments: list, h: AdamHyper) -> None:
    """One Adam/AdamW step in place, op for op as ``torch.optim``'s single-tensor code."""
    if not params:
        return
    mus, nus = moments
    grads = as_dtypes_of(grads, params)
    m, v = as_dtypes_of(mus, params), as_dtypes_of(nus, params)
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


def fused(params: list, grads: list, moments: list, h: AdamHyper) -> None:
    r"""torch's fused CUDA kernels for fp32 values and moments; the reference otherwise (each
    list shares one device and dtype: its first tensor says which).

    Adam's L2 term :math:`g + \lambda\theta` is computed before the kernel (the product
    rounded, then the sum), because the kernel's vectorized and element-wise loops round that
    multiply-add differently, and which one an element takes depends on how its leaf is cut
    and aligned. So Adam with ``weight_decay > 0`` may differ from
    ``torch.optim.Adam(fused=True)`` by 1 ulp at a few percent of the elements."""
    mus, nus = moments
    if not params or not all(x[0].is_cuda and x[0].dtype == torch.float32 for x in (params, mus, nus)):
        reference(params, grads, moments, h)
        return
    step = torch.full((), float(h.step), dtype=torch.float32, device=params[0].device)
    fn, wd = torch._fused_adamw_, h.weight_decay
    if not h.decoupled:
        fn, wd = torch._fused_adam_, 0.0
        if h.weight_decay:
            l2 = torch._foreach_mul(params, h.weight_decay)
            torch._foreach_add_(l2, grads)
            grads = l2
    fn(params, grads, mus, nus, [], [step] * len(params), lr=h.lr, beta1=h.beta1,
       beta2=h.beta2, weight_decay=wd, eps=h.eps, amsgrad=False, maximize=False)


def fused_stored(value: torch.Tensor, param: Optional[torch.Tensor], grad: torch.Tensor,
                 moments: list, h: AdamHyper) -> bool:
    """A device-resident leaf's step in one pass on a CUDA device where its master is split
    and both moments are block-wise 8-bit (:mod:`~functional_offload.kernels.adam_cuda`): the
    bits of :func:`fused` between the formats' decoding and encoding. ``param``: the param of a
    remainder-only master (its high half), else None. False (nothing done) where the kernel
    does not take the leaf: Adam with weight decay, other formats, other devices, strided
    tensors, no Triton, a torch whose fused AdamW rounds otherwise (:func:`adam_cuda.agrees`)."""
    mu, nu = moments
    if (not remainder.is_split(value) or not (is_blockwise(mu) and is_blockwise(nu))
            or not (h.decoupled or h.weight_decay == 0)):
        return False
    if not (grad.is_contiguous() and (param is None or param.is_contiguous())):
        return False
    hi, lo = remainder.flat_halves(value, param)
    if not (adam_cuda.available(hi, lo, grad, mu, nu)
            and adam_cuda.agrees(grad.device)):
        return False
    adam_cuda.adamw_split_q8(hi, lo, grad.view(-1), mu, nu, h.lr, h.beta1, h.beta2, h.eps,
                             h.weight_decay, h.step)
    return True


def ahead(params: list, moments: list, h: AdamHyper, h2: AdamHyper) -> tuple[list, list]:
    r"""The look-ahead of the step after ``h``'s (``h2``'s, primed below), from the values and
    moments ``h``'s step left: its result for a zero grad with the denominator as it is now
    (the *base*), and its bias-corrected second moment but for the grad's part (:math:`q`):

    .. math::

        \text{base} = \theta_t\,(1-\eta'\lambda') - \frac{\eta'}{1-\beta_1'^{t+1}}\,
                      \frac{\beta_1' m_t}{\sqrt{v_t} / \sqrt{1-\beta_2^t} + \epsilon'}, \qquad
        q = \frac{\beta_2' v_t}{1-\beta_2'^{t+1}}

    (Adam: no decay factor; its L2 term is part of the grad :func:`land_ahead` takes). Op for
    op as the native op's ``ahead``."""
    mus, nus = moments
    m, v = as_dtypes_of(mus, params), as_dtypes_of(nus, params)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, (1 - h.beta2 ** h.step) ** 0.5)
    torch._foreach_add_(denom, h2.eps)
    decay, beta1, _, step, second = ahead_scalars(h, h2)
    bases = torch._foreach_mul(params, decay)
    torch._foreach_addcdiv_(bases, torch._foreach_mul(m, beta1), denom, step)
    return bases, torch._foreach_mul(v, second)


def ahead_scalars(h: AdamHyper, h2: AdamHyper) -> list[float]:
    """The native op's look-ahead scalars (math.cpp), in double."""
    return [1 - h2.lr * h2.weight_decay if h2.decoupled else 1.0, h2.beta1, h2.eps,
            -(h2.lr / (1 - h2.beta1 ** h2.step)), h2.beta2 / (1 - h2.beta2 ** h2.step)]


@torch.no_grad()
def land_ahead(params: list, bases: list, qs: list, grads: list, h: AdamHyper,
               h2: AdamHyper) -> None:
    r"""The device side of :func:`ahead`: the values of the step after ``h``'s for its grads
    :math:`g` (plus :math:`\lambda'\theta` for Adam), into ``bases`` (fp32). With :math:`d` the
    base's denominator (:math:`\sqrt{v_t}/\sqrt{1-\beta_2^t}+\epsilon'`, recovered from
    :math:`q`), :math:`d'` the next step's
    (:math:`\sqrt{q + (1-\beta_2')\,g^2/(1-\beta_2'^{t+1})}+\epsilon'`), :math:`\hat\theta` the
    params the device holds (those the last forward read) and :math:`c = \eta'/(1-\beta_1'^{t+1})`:

    .. math::

        \theta = \text{base} + (\hat\theta\,(1-\eta'\lambda') - \text{base})\,(1 - d/d')
                 - c\,\frac{(1-\beta_1')\,g}{d'}

    Since :math:`\theta_t(1-\eta'\lambda') - \text{base} = c\,\beta_1' m_t / d`, this is the
    next step exactly, its momentum term over its own denominator, where
    :math:`\hat\theta = \theta_t`; otherwise it is off by
    :math:`(1-\eta'\lambda')(\hat\theta-\theta_t)(1-d/d')`, a fraction of the last error
    (:math:`d/d'` is held to at most 2, which only a :math:`\beta_2 < 1/3` reaches, so that it
    never grows; where the correction is not finite — denominators past fp32's range, params
    written non-finite — it is dropped, and without a momentum term, :math:`\beta_1' = 0`, or
    without :math:`v_t` in :math:`q`, :math:`\beta_2' = 0`, it is not made). Held params one
    step behind (when the first delayed update's step lands, or that of the first update after
    a flush, a save or an exact one) are set from the new masters first
    (:class:`~functional_offload.executor.delayed.Landing`). The denominators are computed in
    :math:`q`'s dtype, in place; the sums in fp32
    (:func:`~functional_offload.optimizers.spec.land`)."""
    bc1, bc2 = 1 - h2.beta1 ** h2.step, 1 - h2.beta2 ** h2.step
    # v_t / bc2_t = q * recover. Without a momentum term (beta1' = 0) there is nothing to bring
    # over; with beta2' = 0, q holds nothing of v_t: the base stands as it is
    correct = h2.beta1 != 0 and h2.beta2 != 0
    recover = bc2 / (h2.beta2 * (1 - h.beta2 ** h.step)) if correct else 0.0
    decay = 1 - h2.lr * h2.weight_decay if h2.decoupled else 1.0
    g = grads
    if not h2.decoupled and h2.weight_decay != 0:
        g = torch._foreach_add(g, params, alpha=h2.weight_decay)  # the params before they change
    if correct:
        ratio = torch._foreach_mul(qs, recover)
        torch._foreach_sqrt_(ratio)
        torch._foreach_add_(ratio, h2.eps)  # d
    torch._foreach_addcmul_(qs, g, g, (1 - h2.beta2) / bc2)
    torch._foreach_sqrt_(qs)
    torch._foreach_add_(qs, h2.eps)  # d'
    if correct:
        torch._foreach_div_(ratio, qs)  # d / d'
        torch._foreach_clamp_max_(ratio, 2.0)  # |1 - d/d'| <= 1: the error never grows
        torch._foreach_neg_(ratio)
        torch._foreach_add_(ratio, 1.0)  # 1 - d/d'
        w = torch._foreach_add(bases, params, alpha=-decay)  # base - held*decay: the momentum
        torch._foreach_mul_(w, ratio)  # term over d (and the held params' error), x (1 - d/d')
        for x in w:  # overflowed denominators, non-finite held params: no correction
            torch.nan_to_num_(x, nan=0.0, posinf=0.0, neginf=0.0)
        torch._foreach_sub_(bases, w)
    torch._foreach_addcdiv_(bases, g, qs, -h2.lr * (1 - h2.beta1) / bc1)


def scalars(h: AdamHyper) -> list[float]:
    """The native op's scalars, computed in double exactly as torch.optim computes them."""
    wd = h.weight_decay
    return [1 - h.lr * wd if h.decoupled else 1.0, 0.0 if h.decoupled else wd,
            1 - h.beta1, h.beta2, 1 - h.beta2, (1 - h.beta2 ** h.step) ** 0.5, h.eps,
            -(h.lr / (1 - h.beta1 ** h.step))]


def te_step(grads: list, params: list, moments: list, masters: Optional[list],
            h: AdamHyper) -> None:
    """TransformerEngine's fused Adam on one device (:mod:`~functional_offload.kernels.te_adam`):
    the masters, moments and params written in one pass."""
    te_adam.adam_step(grads, params, moments[0], moments[1], masters, lr=h.lr, beta1=h.beta1,
                      beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=h.step,
                      decoupled=h.decoupled)


def _spec(decoupled: bool) -> OptimizerSpec:
    def hyper(v: Mapping[str, float], step: int) -> AdamHyper:
        return AdamHyper(v["lr"], v["beta1"], v["beta2"], v["eps"], v["weight_decay"], step, decoupled)

    return OptimizerSpec(
        name="adamw" if decoupled else "adam", state=AdamState,
        moments=(Moment("mu", "exp_avg", "mu_dtype"), Moment("nu", "exp_avg_sq", "nu_dtype", signed=False)),
        hyperparameters={"lr": check_nonneg, "beta1": check_beta, "beta2": check_beta,
                         "eps": check_nonneg, "weight_decay": check_nonneg},
        hyper=hyper, reference=reference, device=fused, native="adam", scalars=scalars,
        ahead=ahead, ahead_scalars=ahead_scalars, land_ahead=land_ahead,
        ahead_dtypes=(torch.float32, torch.bfloat16, torch.float64),  # fp16: eps and q underflow
        device_writes=te_step, device_stored=fused_stored,
    ).check()


ADAMW, ADAM = _spec(True), _spec(False)


def _adam(spec: OptimizerSpec, lr: ScalarOrSchedule, betas: Any, eps: ScalarOrSchedule,
          weight_decay: ScalarOrSchedule, mu_dtype: Optional[torch.dtype],
          nu_dtype: Optional[torch.dtype], **options: Any) -> Optimizer:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_schedule(f"betas[{i}]", b, check_beta)
    hypers = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": weight_decay}
    if options.get("device_kernel") == "te":
        ok, why = te_adam.available()
        if not ok:
            raise RuntimeError(f"device_kernel='te' needs TransformerEngine, which does not import "
                               f"here ({why}); use device_kernel='torch'")
    return terminal(spec, hypers, moment_dtypes={"mu": mu_dtype, "nu": nu_dtype}, **options)


def adamw(lr: ScalarOrSchedule = 1e-3, betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
          eps: ScalarOrSchedule = 1e-8, weight_decay: ScalarOrSchedule = 1e-2, *,
          placement: Optional[Placement] = None, master_dtype: torch.dtype = torch.float32,
          mu_dtype: Optional[torch.dtype] = None, nu_dtype: Optional[torch.dtype] = None,
          weight_decay_mask: Any = None, ema_decay: Optional[float] = None,
          executor: Optional[HostExecutor] = None, cpu_kernel: str = "auto",
          delayed: Union[bool, Delay] = False, store_param_remainders: bool = False,
          device_kernel: str = "torch") -> Optimizer:
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
      betas: :math:`(\beta_1, \beta_2)`, each in [0, 1) (each may also be a schedule).
      eps: :math:`\epsilon`, added outside the square root, as torch does.
      weight_decay: :math:`\lambda`, decoupled (multiplies the param by :math:`1-\eta_t\lambda`).
      placement: where each leaf's state lives (default :func:`placement.on_host`).
      master_dtype: dtype of the masters of low-precision params (fp32).
      mu_dtype, nu_dtype: moment dtypes (default fp32 for low-precision params, else the
        param's dtype). bf16 moments halve their memory; the math still runs in fp32.
      weight_decay_mask: a pytree of bools mirroring the params (or a callable
        ``params -> tree``); leaves marked False get no weight decay (biases, norms).
      ema_decay: keep an EMA of the (master) values in the state: after each step
        :math:`e \leftarrow d\,e + (1-d)\,\theta` (:func:`~functional_offload.ema_params`).
      executor: the :class:`~functional_offload.executor.HostExecutor` running host-resident
        leaves (default: the process-wide one, :func:`~functional_offload.executor.default_executor`).
      cpu_kernel: ``"auto"`` (the native one-pass kernel when it builds and fits the dtypes),
        ``"native"`` or ``"torch"``.
      delayed: ZeRO-Offload's delayed parameter update for the host-resident leaves:
        ``update`` starts their host step in the background and returns at once; the step
        lands at the *next* ``update`` (or :func:`~functional_offload.flush`). ``True`` is
        ``fo.Delay()``: every update delayed, each with its look-ahead, which lands the params
        as the next step's values for that update's own grads, so the forwards read about the
        params they read without ``delayed`` (:class:`~functional_offload.Delay`; the first
        update lands nothing). Without it (``fo.Delay(lookahead=False)``) the gradient applied
        was computed at the params of one step earlier:
        :math:`\theta_{t+1} = \theta_t - \eta\,\Delta(\nabla L(\theta_{t-1}))`. Device-resident
        leaves update at once. The look-ahead refuses fp16 params (use bf16, or
        ``lookahead=False``).
      store_param_remainders: keep the fp32 master of each bf16 param as the param's bits (the
        master's high 16 bits, rounded) plus an ``int16`` remainder (its low 16 bits), as
        Megatron's and TransformerEngine's option of that name
        (:mod:`~functional_offload.kernels.remainder`). The master stays exact, bit for bit that
        of the fp32 format, and the host step writes no separate param: 2 bytes per param
        fewer through host memory. The param is the master rounded to nearest with ties away
        from zero (the fp32 format rounds ties to even: one bf16 ulp apart where a master lies
        exactly halfway). Small host leaves (packed, at most 65,536 elements) keep fp32 masters.
      device_kernel: what steps device-resident leaves: ``"torch"`` (torch's fused kernel,
        torch.optim's bits) or ``"te"``: TransformerEngine's fused Adam, the kernel of its
        ``FusedAdam(master_weights=True)``, which reads the bf16 grads and writes the bf16
        params in its one pass (no grad cast, no separate param write: 28 bytes of GPU memory
        traffic a param where torch's path moves 40). Its arithmetic is TransformerEngine's:
        bit for bit ``FusedAdam``'s, a few ulps of the master from torch's. Leaves it cannot
        step (fp8 or strided params, bf16 or 8-bit moments, split masters) keep torch's.
        Refused where TransformerEngine does not import. Host-resident leaves are not affected.

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
    return _adam(ADAMW, lr, betas, eps, weight_decay, mu_dtype, nu_dtype, placement=placement,
                 master_dtype=master_dtype, weight_decay_mask=weight_decay_mask,
                 ema_decay=ema_decay, executor=executor, cpu_kernel=cpu_kernel, delayed=delayed,
                 store_param_remainders=store_param_remainders, device_kernel=device_kernel)


def adam(lr: ScalarOrSchedule = 1e-3, betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
         eps: ScalarOrSchedule = 1e-8, weight_decay: ScalarOrSchedule = 0.0, *,
         placement: Optional[Placement] = None, master_dtype: torch.dtype = torch.float32,
         mu_dtype: Optional[torch.dtype] = None, nu_dtype: Optional[torch.dtype] = None,
         weight_decay_mask: Any = None, ema_decay: Optional[float] = None,
         executor: Optional[HostExecutor] = None, cpu_kernel: str = "auto",
         delayed: Union[bool, Delay] = False, store_param_remainders: bool = False,
         device_kernel: str = "torch") -> Optimizer:
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
    return _adam(ADAM, lr, betas, eps, weight_decay, mu_dtype, nu_dtype, placement=placement,
                 master_dtype=master_dtype, weight_decay_mask=weight_decay_mask,
                 ema_decay=ema_decay, executor=executor, cpu_kernel=cpu_kernel, delayed=delayed,
                 store_param_remainders=store_param_remainders, device_kernel=device_kernel)
