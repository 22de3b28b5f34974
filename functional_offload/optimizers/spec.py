"""The declarative definition of a terminal optimizer: :class:`OptimizerSpec`.

A spec says everything that differs between optimizers, once: the state's fields and dtypes
(:class:`Moment`), the hyperparameters and how each is checked, how they become the math's
per-step values, and the element-wise math — a torch reference (any device; bit for bit
``torch.optim``'s single-tensor code where there is one), optionally a fused device path, and
the name of the native host op that computes the same thing (registered in
``kernels/csrc/math.cpp``). :func:`~functional_offload.optimizers.terminal.terminal` turns a spec
into an :class:`~functional_offload.Optimizer`; placement, masters, the host executor, streaming,
the delayed update, EMA, checkpoints and failure handling come with it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import torch

from functional_offload.checks import real
from functional_offload.kernels.remainder import join_base
from functional_offload.typing import ScalarOrSchedule

__all__ = ["Moment", "OptimizerSpec", "as_dtypes_of", "batches", "BATCH", "land", "LAND_BATCH",
           "check_nonneg",
           "check_positive", "check_beta",
           "check_schedule", "check_representable", "torch_state_names", "STATE_FIELDS"]

STATE_FIELDS = ("count", "master", "ema", "params")  # every terminal state has these
"""Besides its moments, a terminal state has ``count`` (int64 0-d, updates applied), ``master``
(fp32 values where the param is not its own master), ``ema`` (the EMA of the values, or ``()``)
and ``params`` (the live params, a :class:`~functional_offload.ParamRefs`)."""


class Moment(NamedTuple):
    """A per-leaf state tensor of an optimizer (e.g. Adam's ``mu``)."""

    name: str  # the state field, e.g. "mu"
    torch_name: str  # torch.optim's per-param state key, e.g. "exp_avg"
    option: str  # the constructor's dtype option, e.g. "mu_dtype"
    # its shape for a param's shape, or None where the leaf has none (factored state); None:
    # the param's shape (element-wise state)
    shape: Optional[Callable[[torch.Size], Optional[tuple[int, ...]]]] = None
    signed: bool = True  # it may be negative (block-wise 8-bit: the signed or unsigned map)


# The math's per-step values (a NamedTuple of floats) from the hyperparameters' values at this
# step and the step t (1 for the first update).
HyperFn = Callable[[Mapping[str, float], int], Any]
# In-place math on lists: (values fp32, grads, [one list per moment], hyper) -> None. The
# values of one call share a device and a dtype, and so do each moment's tensors; the device
# math gets the grads in the values' dtype (the reference casts them itself).
MathFn = Callable[[list, list, list, Any], None]
# The delayed update's look-ahead (optimizers/delay.py), on the host: (new values fp32, [one
# list per moment, as stored], hyper, next step's hyper) -> (bases, rates), fp32 lists, the
# next step's values for any grad ``g`` being a function of base, rate and ``g``.
AheadFn = Callable[[list, list, Any, Any], tuple[list, list]]
# Its device side: (params, bases, rates, the next step's grads, hyper, next hyper) -> None,
# the bases (fp32, the function's to change) set to the next step's values for those grads; the
# params are the ones the device holds, read only (:func:`land`).
LandAheadFn = Callable[[list, list, list, list, Any, Any], None]


class OptimizerSpec(NamedTuple):
    """What makes an optimizer itself; everything else is shared.

    Fields:
      name: the constructor's name (``"adamw"``), used in messages.
      state: its state NamedTuple: ``count``, the moments' fields, ``master``, ``ema``,
        ``params``, in that order (a field no moment of this spec fills is ``()``, e.g. SGD's
        ``momentum`` without momentum).
      moments: the per-leaf state tensors, each mirroring the params (element-wise state).
      hyperparameters: ``{name: check}``; each value is a float or a schedule (a callable of
        the step count), ``check(name, value) -> float`` raises ``ValueError`` naming it.
      hyper: builds the math's per-step values from ``{name: value at this step}`` and the step.
      reference: the math in torch ops, in place on lists; runs on any device.
      device: a faster version of ``reference`` for device-resident groups (fused kernels), or
        ``None`` to use ``reference``.
      native: the name of the native element-wise op (``kernels/csrc/math.cpp``), or ``None``.
      scalars: the native op's scalars (doubles, computed as torch computes them) for a hyper.
      decay: the hyperparameter a ``weight_decay_mask`` switches off per leaf, or ``None``.
      elementwise: the math is element-wise (chunks cut across leaves may run it); else each
        host-resident leaf runs whole (:mod:`functional_offload.executor.leaves`), and the
        moments may have shapes of their own.
      ahead: the look-ahead of the delayed update (:class:`~functional_offload.Delay`): what
        the host step computes of the next step beside the new state; ``None``: none.
      ahead_scalars: the native op's look-ahead scalars for ``(hyper, next_hyper)`` (an op
        with ``kAheadScalars`` > 0).
      land_ahead: the look-ahead's device side (with ``ahead``, and only with it).
      ahead_dtypes: the param dtypes the look-ahead's values keep in range, or ``None``: all.
      device_writes: a device kernel that also writes the params, ``(grads, params, moments,
        masters, hyper)`` (``masters`` ``None`` for fp32 params stepped themselves; grads in
        the params' dtype): TransformerEngine's fused Adam, chosen by ``device_kernel="te"``;
        ``None``: none.
      device_stored: ``device`` for one device-resident leaf on its stored formats in one pass
        (split master, 8-bit moments), bit for bit the decoded math, ``(value, param, grad,
        moments, hyper) -> bool`` (``param``: a remainder-only master's, else None; False:
        nothing done, the leaf is not its to take); ``None``: none.
    """

    name: str
    state: type
    moments: tuple[Moment, ...]
    hyperparameters: Mapping[str, Callable[[str, Any], float]]
    hyper: HyperFn
    reference: MathFn
    device: Optional[MathFn] = None
    native: Optional[str] = None
    scalars: Optional[Callable[[Any], Sequence[float]]] = None
    decay: Optional[str] = "weight_decay"
    elementwise: bool = True
    ahead: Optional[AheadFn] = None
    ahead_scalars: Optional[Callable[[Any, Any], Sequence[float]]] = None
    land_ahead: Optional[LandAheadFn] = None
    ahead_dtypes: Optional[tuple[torch.dtype, ...]] = None
    device_writes: Optional[Callable[[list, list, list, Optional[list], Any], None]] = None
    device_stored: Optional[Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, list,
                                      Any], bool]] = None

    def check(self) -> "OptimizerSpec":
        """Raise ``TypeError`` if the spec is inconsistent (for optimizer authors)."""
        fields = tuple(self.state._fields)
        moments = [m.name for m in self.moments]
        if (fields[:1] != ("count",) or fields[-3:] != ("master", "ema", "params")
                or [f for f in fields[1:-3] if f in moments] != moments):
            raise TypeError(f"{self.name}: state fields must be count, the moments {moments} in "
                            f"order, master, ema, params; got {fields}")
        if (self.native is None) != (self.scalars is None):
            raise TypeError(f"{self.name}: a native op needs its scalars function, and only it")
        if self.elementwise and any(m.shape is not None for m in self.moments):
            raise TypeError(f"{self.name}: element-wise state mirrors the params' shapes")
        if not self.elementwise and (self.native is not None or self.ahead is not None):
            raise TypeError(f"{self.name}: native ops and look-aheads are element-wise")
        if (self.ahead_scalars is not None) != (self.ahead is not None and self.native is not None):
            raise TypeError(f"{self.name}: a native op with a look-ahead needs its look-ahead "
                            "scalars, and only it")
        if (self.land_ahead is None) != (self.ahead is None):
            raise TypeError(f"{self.name}: a look-ahead has a host side (ahead) and a device "
                            "side (land_ahead), both or neither")
        if self.decay is not None and self.decay not in self.hyperparameters:
            raise TypeError(f"{self.name}: decay hyperparameter {self.decay!r} is not declared")
        return self

    def torch_names(self) -> dict[str, str]:
        """``{moment field: torch.optim's per-param state key}``, from the moments' ``torch_name``."""
        return {m.name: m.torch_name for m in self.moments}


def torch_state_names(state: Any) -> dict[str, str]:
    """``{moment field: torch.optim's per-param state key}`` of a terminal state (or its type),
    e.g. ``{"mu": "exp_avg", "nu": "exp_avg_sq"}`` for an :class:`~functional_offload.AdamState`.

    The state type carries them as its class attribute ``TORCH_NAMES``, which
    :func:`~functional_offload.optimizers.terminal.terminal` sets from the spec it is given: a
    state type is known here once an optimizer of its spec was built.
    """
    kind = state if isinstance(state, type) else type(state)
    names = getattr(kind, "TORCH_NAMES", None)
    if not isinstance(names, dict):
        raise TypeError(f"{kind.__name__} is not the state of a terminal optimizer")
    return dict(names)


def as_dtypes_of(xs: list, like: list) -> list:
    """``xs[i]`` in ``like[i]``'s dtype (itself where it has it): the math's inputs in the
    values' dtype."""
    return [x if x.dtype == p.dtype else x.to(p.dtype) for x, p in zip(xs, like)]


def check_nonneg(name: str, x: Any) -> float:
    """A finite number >= 0."""
    v = real(x)
    if v is None or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
    return v


def check_positive(name: str, x: Any) -> float:
    """A finite number > 0."""
    if check_nonneg(name, x) == 0:
        raise ValueError(f"{name} must be > 0, got {x!r}")
    return float(x)


def check_beta(name: str, b: Any) -> float:
    """A number in [0, 1)."""
    v = real(b)
    if v is None or not 0 <= v < 1:
        raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    return v


def check_schedule(name: str, x: ScalarOrSchedule, check: Callable[[str, Any], float]) -> ScalarOrSchedule:
    """A constant checked now, or a schedule (its values are checked at each step)."""
    if callable(x):
        return x
    if isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a Python number or a schedule (a callable of the step "
                        f"count), got a tensor; pass float({name}) or a schedule")
    return check(name, x)


_F32_MAX = torch.finfo(torch.float32).max


def check_representable(spec: OptimizerSpec, hyper: Any, names: Sequence[str]) -> None:
    """Raise ``ValueError`` if a native scalar of ``hyper`` is not a finite fp32 (the kernels'
    compute dtype): e.g. ``lr=1e38`` makes Adam's step size overflow.

    The message names the hyperparameters (of ``names``, fields of ``hyper``) that make the
    first such scalar: those at 0 with which it is representable, and of them the ones above 1
    in magnitude (a beta scales a step size up only through ``1 / (1 - beta)``); all of
    ``names`` when no field of ``hyper`` is one of them."""
    scalars = _scalars(spec)
    at = _unrepresentable(scalars(hyper))
    if at is None:
        return
    bad = scalars(hyper)[at]
    fields = getattr(hyper, "_fields", ())
    values = {k: getattr(hyper, k) for k in names if k in fields}
    involved = [k for k, v in values.items()
                if real(v) is not None and _fixed_by_zero(scalars, hyper, k, at)]
    culprits = [k for k in involved if abs(values[k]) > 1] or involved
    if not culprits:
        raise ValueError(f"{spec.name}: the hyperparameters {', '.join(names)} give a kernel "
                         f"scalar of {bad!r}, which float32 (the kernels' compute dtype) "
                         "cannot represent; use smaller values")
    given = ", ".join(f"{k}={values[k]!r}" for k in culprits)
    raise ValueError(f"{spec.name}: {given} give{'s' if len(culprits) == 1 else ''} a kernel "
                     f"scalar of {bad!r}, which float32 (the kernels' compute dtype) cannot "
                     f"represent; use a smaller {' or '.join(culprits)}")


def _scalars(spec: OptimizerSpec) -> Callable[[Any], list[float]]:
    """The values the kernels compute with: the native op's scalars, or the hyper's numbers."""
    if spec.scalars is None:
        return lambda hyper: [float(v) for v in hyper if isinstance(v, (int, float))]
    return lambda hyper: [float(v) for v in spec.scalars(hyper)]


def _unrepresentable(values: Sequence[float]) -> Optional[int]:
    """The index of the first of ``values`` that is not a finite fp32, or ``None``."""
    return next((i for i, v in enumerate(values) if not math.isfinite(v) or abs(v) > _F32_MAX),
                None)


def _fixed_by_zero(scalars: Callable[[Any], list[float]], hyper: Any, name: str, at: int) -> bool:
    """Whether scalar ``at`` is representable with ``hyper``'s field ``name`` at 0."""
    try:
        v = scalars(hyper._replace(**{name: 0.0}))[at]
    except ArithmeticError:  # the scalars divide by it
        return False
    return math.isfinite(v) and abs(v) <= _F32_MAX


BATCH = 1 << 26  # elements a device-side pass takes at once: what bounds its temporaries


def batches(tensors: Sequence[torch.Tensor], limit: int = BATCH) -> Iterator[slice]:
    """Consecutive slices of ``tensors`` holding at most ``limit`` elements in all (a larger
    tensor alone): the groups a device-side pass takes at once, to bound its temporaries."""
    start = 0
    while start < len(tensors):
        stop, n = start, 0
        while stop < len(tensors) and (stop == start or n + tensors[stop].numel() <= limit):
            n += tensors[stop].numel()
            stop += 1
        yield slice(start, stop)
        start = stop


LAND_BATCH = 1 << 25  # elements of small leaves a landing lays end to end at once


def _end_to_end(xs: list, n: int) -> torch.Tensor:
    """The tensors ``xs`` (one dtype, ``n`` elements in all) laid end to end in a new tensor."""
    out = torch.empty(n, dtype=xs[0].dtype, device=xs[0].device)
    torch._foreach_copy_(list(out.split([x.numel() for x in xs])), [x.reshape(-1) for x in xs])
    return out


@torch.no_grad()
def land(fn: LandAheadFn, params: list, bases: list, residuals: list, rates: list, grads: list,
         hyper: Any, next_hyper: Any) -> None:
    """A look-ahead's landing (:class:`~functional_offload.executor.delayed.Landing`): ``fn``
    makes the next step's values in fp32 from the bases — a bf16 base joined with its residual
    (``residuals[i]``, or None; :func:`~functional_offload.kernels.remainder.join_base`) — and
    each param (1-D) is set from them, rounded to its dtype once, as the step rounds its master.
    Leaves of one kind (dtypes, residual or not) are laid end to end, at most
    :data:`LAND_BATCH` elements at once (a larger leaf alone), so that each op is one kernel
    over all of them rather than one per leaf: the landing's ops mix fp32 and bf16, which
    torch's multi-tensor kernels do not take."""
    kinds: dict[tuple, list[int]] = {}
    for i, (p, b, e, q, g) in enumerate(zip(params, bases, residuals, rates, grads)):
        kinds.setdefault((p.dtype, b.dtype, e is None, q.dtype, g.dtype), []).append(i)
    for idx in kinds.values():
        ps = [params[i] for i in idx]
        for part in batches(ps, LAND_BATCH):
            mine = idx[part]
            p, b, e, q, g = ([xs[i] for i in mine]
                             for xs in (params, bases, residuals, rates, grads))
            if len(mine) > 1:
                n = sum(x.numel() for x in p)
                p, b, q, g = ([_end_to_end(xs, n)] for xs in (p, b, q, g))
                e = [None] if e[0] is None else [_end_to_end(e, n)]
            b32 = [x.to(torch.promote_types(x.dtype, torch.float32)) if r is None
                   else join_base(x, r) for x, r in zip(b, e)]  # fp64 params' in fp64
            fn(p, b32, q, g, hyper, next_hyper)
            if len(mine) > 1:
                out = b32[0].to(ps[0].dtype)
                torch._foreach_copy_(ps[part], list(out.split([x.numel() for x in ps[part]])))
            else:
                torch._foreach_copy_(ps[part], b32)
