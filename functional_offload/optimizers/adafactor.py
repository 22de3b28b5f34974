"""Adafactor (Shazeer & Stern, 2018) as ``torch.optim.Adafactor``: the spec and the constructor.

Its math is not element-wise — second moments factored into row and column means, a step size
from the norm of the whole param, an update clipped by its own RMS — so host-resident leaves run
whole (:mod:`functional_offload.executor.leaves`).
"""

from __future__ import annotations

import functools
import math
from types import MappingProxyType
from typing import Any, Iterator, Mapping, NamedTuple, Optional

import torch

from functional_offload.base import Optimizer, ParamRefs
from functional_offload.checks import real
from functional_offload.executor import HostExecutor
from functional_offload.optimizers.spec import Moment, OptimizerSpec, check_nonneg
from functional_offload.optimizers.terminal import terminal
from functional_offload.placement import Placement
from functional_offload.tree import is_dtensor, leaves_with_paths
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["AdafactorState", "AdafactorHyper", "adafactor", "spec"]


class AdafactorState(NamedTuple):
    """State of :func:`adafactor`."""

    count: torch.Tensor  # int64 scalar on the CPU: updates applied so far (or a mark, see fo.base)
    row_var: Params  # leaves of 2+ dims: mean of g² over the last dim (shape [..., n, 1]); else None
    col_var: Params  # leaves of 2+ dims: mean of g² over dim -2 (shape [..., 1, m]); else None
    variance: Params  # leaves of 0 or 1 dim: the unfactored second moment; else None
    master: Params  # as in AdamState: master values, None where the param is its own master
    ema: Params  # fp32 EMA of the values (ema_decay), mirrors params; () without
    params: ParamRefs  # the live params, updated in place (not checkpointed)

    # the dims of its param that a factored field's leaf reduces to size 1, over the whole param
    # (functional_offload.dcp lays it out like its param along the others)
    reduced_dims = MappingProxyType({"row_var": (-1,), "col_var": (-2,)})


class AdafactorHyper(NamedTuple):
    lr: float
    beta2_decay: float
    eps1: Optional[float]  # None: the value dtype's machine epsilon
    eps2: float
    d: float
    weight_decay: float
    step: int  # 1 for the first update


def _row(shape: torch.Size) -> Optional[tuple[int, ...]]:
    return (*shape[:-1], 1) if len(shape) > 1 else None


def _col(shape: torch.Size) -> Optional[tuple[int, ...]]:
    return (*shape[:-2], 1, shape[-1]) if len(shape) > 1 else None


def _vector(shape: torch.Size) -> Optional[tuple[int, ...]]:
    return tuple(shape) if len(shape) <= 1 else None


def _second_moment(p: torch.Tensor, g: torch.Tensor, row: Any, col: Any, var: Any, w: float,
                   eps1: float) -> torch.Tensor:
    """Update the second-moment state; the estimate of E[g²] (torch.optim.Adafactor's code)."""
    if g.dim() > 1:  # the moments may be narrower than the values (fp32 beside an fp64 master)
        row.lerp_(torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)).to(row.dtype), w)
        col.lerp_(torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2)).to(col.dtype), w)
        estimate = row @ col
        return estimate.div_(row.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    var.lerp_((g * g).to(var.dtype), w)
    return var.clone()


def _updates(params: list, grads: list, moments: list, h: AdafactorHyper) -> Iterator[tuple]:
    """Per non-empty leaf, in ``torch.optim.Adafactor``'s order: ``(p, |p| before the weight
    decay, update)``, with the decay applied to ``p`` and the second moments updated; the caller
    scales the update and applies it."""
    rows, cols, variances = moments
    w = h.step ** h.beta2_decay
    for p, g, row, col, var in zip(params, grads, rows, cols, variances):
        if p.numel() == 0:  # nothing to update (and no RMS to divide by)
            continue
        g = g if g.dtype == p.dtype else g.to(p.dtype)
        eps1 = torch.finfo(p.dtype).eps if h.eps1 is None else h.eps1
        norm = p.norm(2)
        if h.weight_decay != 0:
            p.mul_(1 - h.lr * h.weight_decay)
        update = _second_moment(p, g, row, col, var, w, eps1).clamp_(min=eps1 * eps1).rsqrt_()
        yield p, norm, update.mul_(g)


def reference(params: list, grads: list, moments: list, h: AdafactorHyper) -> None:
    """One step in place, op for op as ``torch.optim.Adafactor``'s single-tensor code (it reads
    two norms on the host per leaf: for host-resident state, where that costs nothing)."""
    rho = min(h.lr, 1 / (h.step ** 0.5))
    for p, norm, update in _updates(params, grads, moments, h):
        alpha = max(h.eps2, norm.item() / (p.numel() ** 0.5)) * rho
        denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * h.d))
        p.add_(update, alpha=-alpha / denom)


def on_device(params: list, grads: list, moments: list, h: AdafactorHyper) -> None:
    """The same step without reading anything on the host (device-resident state): the step
    size and the clipping stay 0-d tensors, so results differ from torch's in the last bits."""
    rho = min(h.lr, 1 / (h.step ** 0.5))
    for p, norm, update in _updates(params, grads, moments, h):
        alpha = torch.clamp(norm / math.sqrt(p.numel()), min=h.eps2) * rho
        denom = torch.clamp(update.norm(2) / (math.sqrt(update.numel()) * h.d), min=1.0)
        p.sub_(update * (alpha / denom))


def _check_decay(name: str, x: Any) -> float:
    if real(x) is None or not math.isfinite(x) or x > 0:
        raise ValueError(f"{name} must be a finite number <= 0, got {x!r}")
    return float(x)


def _check_whole(params: Params) -> None:
    """Raise ``ValueError`` naming the first param sharded across ranks (a DTensor split over a
    mesh dim of more than one rank, as FSDP2 makes them): this rank's step sees its shard only,
    and Adafactor's means, step size and clipping need the whole param."""
    paths, leaves, _ = leaves_with_paths(params)
    for path, p in zip(paths, leaves):
        if is_dtensor(p) and any(not pl.is_replicate() and p.device_mesh.size(i) > 1
                                 for i, pl in enumerate(p.placements)):
            raise ValueError(
                f"adafactor: param {path!r} is sharded across ranks (a DTensor with placements "
                f"{tuple(p.placements)} on a mesh of shape {tuple(p.device_mesh.shape)}); "
                "Adafactor's row and column means, step size and update clipping span the whole "
                "param, and each rank's step sees its own shard only, so the results would "
                "depend on the world size. Use an element-wise optimizer (fo.adamw, fo.lion, "
                "fo.sgd) for sharded params, and fo.adafactor for params whole on every rank "
                "(plain or replicated), next to it through fo.partition if need be")


def _check_d(name: str, x: Any) -> float:
    if check_nonneg(name, x) < 1:
        raise ValueError(f"{name} (the clipping threshold) must be >= 1, got {x!r}")
    return float(x)


@functools.lru_cache(maxsize=None)
def spec(eps1: Optional[float]) -> OptimizerSpec:
    """Adafactor's spec; ``eps1`` is fixed per spec (None: the value dtype's epsilon)."""
    def hyper(v: Mapping[str, float], step: int) -> AdafactorHyper:
        return AdafactorHyper(v["lr"], v["beta2_decay"], eps1, v["eps2"], v["d"], v["weight_decay"], step)

    return OptimizerSpec(
        name="adafactor", state=AdafactorState,
        moments=(Moment("row_var", "row_var", "row_var_dtype", _row),
                 Moment("col_var", "col_var", "col_var_dtype", _col),
                 Moment("variance", "variance", "variance_dtype", _vector)),
        hyperparameters={"lr": check_nonneg, "beta2_decay": _check_decay, "eps2": check_nonneg,
                         "d": _check_d, "weight_decay": check_nonneg},
        hyper=hyper, reference=reference, device=on_device, elementwise=False,
    ).check()


def adafactor(lr: ScalarOrSchedule = 1e-2, beta2_decay: ScalarOrSchedule = -0.8,
              eps: tuple[Optional[float], ScalarOrSchedule] = (None, 1e-3),
              d: ScalarOrSchedule = 1.0, weight_decay: ScalarOrSchedule = 0.0, *,
              placement: Optional[Placement] = None, master_dtype: torch.dtype = torch.float32,
              weight_decay_mask: Any = None, ema_decay: Optional[float] = None,
              executor: Optional[HostExecutor] = None, cpu_kernel: str = "auto",
              delayed: bool = False, store_param_remainders: bool = False) -> Optimizer:
    r"""Adafactor with ``torch.optim.Adafactor``'s math and defaults (the oracle).

    With :math:`t` the step, :math:`\hat\beta_{2,t} = 1 - t^{c}` (:math:`c` = ``beta2_decay``),
    :math:`\rho_t = \min(\eta, 1/\sqrt t)`, for a leaf of 2+ dims with grad :math:`G`:

    .. math::

        R_t &= \hat\beta_{2,t} R_{t-1} + (1-\hat\beta_{2,t})\,\mathrm{mean}_{-1}(G^2), \quad
        C_t = \hat\beta_{2,t} C_{t-1} + (1-\hat\beta_{2,t})\,\mathrm{mean}_{-2}(G^2) \\
        \hat V_t &= R_t C_t / \max(\mathrm{mean}(R_t), \epsilon_1), \quad
        U_t = G / \sqrt{\max(\hat V_t, \epsilon_1^2)} \\
        \alpha_t &= \max(\epsilon_2, \mathrm{RMS}(\theta))\,\rho_t, \quad
        \theta \leftarrow \theta(1-\eta\lambda) - \frac{\alpha_t}{\max(1, \mathrm{RMS}(U_t)/d)}\,U_t

    and for 0- and 1-dim leaves an unfactored :math:`V_t` in place of :math:`\hat V_t`. The
    state is small (a row and a column per matrix), so what host placement saves is the fp32
    master of low-precision params. Host-resident leaves run whole, one after another, their
    grads copied to a pinned arena the size of those grads; ``delayed=True`` is not offered.
    Params sharded across ranks (FSDP2's DTensors) are refused at ``init``, naming the param:
    the column means, :math:`\mathrm{RMS}(\theta)` and :math:`\mathrm{RMS}(U_t)` span the
    whole param, which a rank's step does not see. DTensors whole on every rank (replicated,
    or on a mesh of one) are optimized, and :mod:`functional_offload.dcp` checkpoints their
    factored state laid out like the params (a factor keeps its param's placements along the
    dims it keeps and is replicated along the dim it reduces).

    Args:
      lr: :math:`\eta`; ``beta2_decay``: :math:`c \le 0`; ``eps``: :math:`(\epsilon_1,
        \epsilon_2)`, :math:`\epsilon_1` None for the value dtype's epsilon; ``d``: the update
        clipping threshold (>= 1); ``weight_decay``: :math:`\lambda`, decoupled. Floats or
        schedules of the step count (but :math:`\epsilon_1`).
      placement, master_dtype, weight_decay_mask, ema_decay, executor: as in
        :func:`~functional_offload.adamw`; ``cpu_kernel``: ``"auto"`` or ``"torch"`` (the
        host math is torch's, whole leaf by whole leaf; there is no native op); ``delayed``:
        must stay False (the leaf-by-leaf host step has no delayed mode);
        ``store_param_remainders``: as in :func:`~functional_offload.adamw`, the master of
        each bf16 param (but for small host leaves) kept as its high and low 16 bits, exact;
        device state keeps the remainder alone (the param is the high half: 2 bytes a param
        fewer than an fp32 master); host state keeps both halves, as many bytes as an fp32
        master (each leaf joined, stepped and split whole, which costs time and an fp32
        temporary of the largest leaf): it is for device-resident state.

    Returns:
      An :class:`~functional_offload.Optimizer` whose state is an :class:`AdafactorState`.

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.adafactor(lr=0.1)
        >>> params, state = opt.update({"w": torch.ones(2, 3)}, opt.init({"w": torch.ones(2, 3)}))
        >>> state.row_var["w"].shape, state.col_var["w"].shape
        (torch.Size([2, 1]), torch.Size([1, 3]))
    """
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"eps must be a pair (eps1, eps2), got {eps!r}")
    eps1 = None if eps[0] is None else check_nonneg("eps[0]", eps[0])
    opt = terminal(spec(eps1), {"lr": lr, "beta2_decay": beta2_decay, "eps2": eps[1], "d": d,
                                "weight_decay": weight_decay},
                   moment_dtypes={}, placement=placement, master_dtype=master_dtype,
                   weight_decay_mask=weight_decay_mask, ema_decay=ema_decay, executor=executor,
                   cpu_kernel=cpu_kernel, delayed=delayed,
                   store_param_remainders=store_param_remainders)

    def init(params: Params) -> AdafactorState:
        _check_whole(params)
        return opt.init(params)

    return Optimizer(init, opt.update, opt.begin)
