"""Build the equivalent functional optimizer from Megatron-LM / NeMo optimizer options.

Takes Megatron-core's own ``OptimizerConfig`` (or any object with its fields) and/or its field
names as keywords (``--optimizer-cpu-offload`` is ``optimizer_cpu_offload``...). Differences on
purpose: ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` are honoured with CPU offload too (Megatron's
offloaded optimizer keeps fp32 moments), the D2H/H2D overlap is always on, and only the staging
ring is pinned (``pin_cpu_grads`` / ``pin_cpu_params`` have nothing to change). See
docs/migration.md for the flag table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Optional, Union

import optree
import torch

from functional_offload.base import Optimizer
from functional_offload.combine import chain
from functional_offload.executor import HostExecutor
from functional_offload.optimizers import adam, adamw, sgd
from functional_offload.placement import offload_fraction, on_device
from functional_offload.transforms import clip_by_global_norm
from functional_offload.tree import leaves_with_paths

__all__ = ["megatron_weight_decay_mask", "optimizer_from_megatron"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_MOMENTS = (torch.float32, torch.bfloat16)  # fp16 moments: TE scales them, we would not

# The OptimizerConfig fields that decide the optimizer, with the defaults of Megatron's command
# line (its dataclass defaults ``optimizer_offload_fraction`` to 0.0, the flag to 1.0).
_MATH: dict[str, Any] = {
    "optimizer": "adam", "lr": None, "weight_decay": 0.01, "apply_wd_to_qk_layernorm": False,
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "decoupled_weight_decay": True,
    "sgd_momentum": 0.9, "clip_grad": 1.0, "optimizer_cpu_offload": False,
    "optimizer_offload_fraction": 1.0, "use_precision_aware_optimizer": False,
    "store_param_remainders": True, "exp_avg_dtype": torch.float32,
    "exp_avg_sq_dtype": torch.float32, "main_params_dtype": torch.float32,
    "fp16": False, "decoupled_lr": None,
}
# Fields that change nothing here: precision of the model and its grads, scheduling and
# logging, ZeRO's sharding (FSDP2's job here), pinning and overlap (always on), loss scaling
# (fp16 is refused), Muon's options (Muon is refused).
_NO_MATH = frozenset({
    "min_lr", "decoupled_min_lr", "fp8_recipe", "bf16", "reuse_grad_buf_for_mxfp8_param_ag",
    "params_dtype", "main_grads_dtype", "loss_scale", "initial_loss_scale", "min_loss_scale",
    "loss_scale_window", "hysteresis", "muon_momentum", "muon_split_qkv", "muon_use_nesterov",
    "muon_scale_mode", "muon_fp32_matmul_prec", "muon_num_ns_steps", "muon_tp_mode",
    "muon_extra_scale_factor", "use_distributed_optimizer", "overlap_param_gather",
    "overlap_param_gather_with_optimizer_step", "use_torch_optimizer_for_cpu_offload",
    "overlap_cpu_optimizer_d2h_h2d", "pin_cpu_grads", "pin_cpu_params", "log_num_zeros_in_grad",
    "barrier_with_L1_time", "timers", "config_logger_dir",
})


def _dtype(name: str, x: Union[str, torch.dtype], allowed: tuple) -> torch.dtype:
    dt = _DTYPES.get(x) if isinstance(x, str) else x
    if dt == torch.uint8 and name.startswith("exp_avg"):
        raise ValueError(f"{name}=torch.uint8 is TransformerEngine's per-tensor scaled fp8 "
                         "moment, not provided here. This library's 8-bit moments are "
                         "block-wise (docs/performance.md): build fo.chain(fo.clip_by_global_norm("
                         "clip_grad, norm_dtype=torch.float32), fo.adamw(..., mu_dtype=torch.uint8, "
                         "nu_dtype=torch.uint8, weight_decay_mask=fo.compat."
                         "megatron_weight_decay_mask))")
    if dt not in allowed:
        raise ValueError(f"{name}={x!r} is not supported; use one of "
                         f"{sorted(k for k, v in _DTYPES.items() if v in allowed)}")
    return dt


def megatron_weight_decay_mask(params: Any, apply_wd_to_qk_layernorm: bool = False) -> Any:
    """Megatron's weight-decay rule as a ``weight_decay_mask`` tree (pass the function itself
    as ``weight_decay_mask=``, or its result): no decay for params of one dimension or whose
    dotted path ends in ``.bias``; with ``apply_wd_to_qk_layernorm``, decay for
    ``q_layernorm.`` / ``k_layernorm.`` params all the same. Paths are the dotted ones of
    ``dict(model.named_parameters())``.

    Example::

        >>> import torch, functional_offload as fo
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> fo.compat.megatron_weight_decay_mask(dict(model.named_parameters()))
        {'0.weight': True, '0.bias': False, '1.weight': False, '1.bias': False}
    """
    paths, leaves, spec = leaves_with_paths(params)

    def decays(path: str, p: torch.Tensor) -> bool:  # init checked the leaves are tensors
        skip = p.dim() == 1 or path.endswith(".bias")
        if apply_wd_to_qk_layernorm and ("q_layernorm." in path or "k_layernorm." in path):
            skip = False
        return not skip

    return optree.tree_unflatten(spec, [decays(n, p) for n, p in zip(paths, leaves)])


def _given(config: Any) -> dict[str, Any]:
    """The fields ``config`` sets: a mapping's items; a dataclass's fields (those we do not know
    only where they differ from their defaults, so that a newer Megatron's additions pass while
    they are left alone); another object's attributes."""
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        out = {}
        for f in dataclasses.fields(config):
            value, default = getattr(config, f.name), f.default
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            if f.name in _MATH or f.name in _NO_MATH or default is dataclasses.MISSING \
                    or value != default:
                out[f.name] = value
        return out
    return dict(vars(config))


def _options(config: Any, options: dict[str, Any]) -> dict[str, Any]:
    o = dict(_MATH)
    for what, given in (("config field(s)", {} if config is None else _given(config)),
                        ("option(s)", options)):
        unknown = sorted(set(given) - set(_MATH) - _NO_MATH)
        if unknown:
            raise TypeError(f"optimizer_from_megatron: unknown {what} {unknown}; the options are "
                            "the fields of Megatron's OptimizerConfig")
        o.update({k: v for k, v in given.items() if k in _MATH})
    return o


def _number(name: str, x: Any, low: float, high: float = math.inf, closed: bool = True) -> float:
    """``x`` as a float in [low, high] (``closed``) or [low, high), else ``ValueError`` naming
    the Megatron field."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not (
            low <= x <= high if closed else low <= x < high):
        bound = f"[{low:g}, {high:g}]" if closed else f"[{low:g}, {high:g})"
        raise ValueError(f"{name} must be a number in {bound}, got {x!r}")
    return float(x)


_FLAGS = ("optimizer_cpu_offload", "decoupled_weight_decay", "use_precision_aware_optimizer",
          "store_param_remainders", "apply_wd_to_qk_layernorm", "fp16")


def optimizer_from_megatron(config: Any = None, /, *, delayed: Any = False,
                            executor: Optional[HostExecutor] = None, cpu_kernel: str = "auto",
                            device_kernel: str = "torch", **options: Any) -> Optimizer:
    """The functional optimizer Megatron's options describe: ``chain(clip, adam/adamw/sgd)``.

    ``config`` is a Megatron-core ``OptimizerConfig`` (or ``AdamOptimizerConfig``...; a dict or
    any object with its fields); ``options`` are the same field names as keywords and take
    precedence.
    Without a config the defaults are Megatron's command line's (``optimizer_offload_fraction``
    1.0).

    - ``optimizer="adam"`` is AdamW when ``decoupled_weight_decay`` (Megatron's default), else
      Adam with L2; ``"sgd"`` is SGD with ``sgd_momentum``. ``lr`` may be a float (Megatron's
      peak) or a schedule: Megatron's scheduler lives outside its optimizer, ours is ``lr``.
    - Weight decay skips params of one dimension and ``*.bias`` (Megatron's rule, with
      ``apply_wd_to_qk_layernorm``), through a ``weight_decay_mask`` on the dotted param paths,
      so pass params named as in ``model.named_parameters()``.
    - ``clip_grad > 0`` puts :func:`clip_by_global_norm` in front, its norm and factor in fp32
      (``norm_dtype=torch.float32``), as Megatron's.
    - ``optimizer_cpu_offload`` places state with ``offload_fraction(optimizer_offload_fraction)``
      (Megatron's greedy rule, over the params in ``named_parameters()`` order; Megatron walks its
      param groups, so the leaves offloaded can differ); without it everything stays on the
      device.
    - ``use_precision_aware_optimizer`` with ``store_param_remainders`` (Megatron's default)
      keeps the split master (``store_param_remainders=True``), as Megatron's TransformerEngine
      optimizer does (its CPU-offloaded optimizer keeps fp32 copies instead).
      ``exp_avg_dtype``/``exp_avg_sq_dtype`` (fp32 or bf16; TE's fp16 moments are scaled, ours
      would not be) apply with or without it, to Adam.

    ``delayed``, ``executor``, ``cpu_kernel``, ``device_kernel`` (no Megatron fields): this
    library's options, passed to the optimizer: the delayed update (``True`` or a
    :class:`~functional_offload.Delay`; e.g. ``fo.Delay(lookahead=False)`` with
    :func:`~functional_offload.land_before_forward` for exact steps that overlap the next
    forward), the :class:`~functional_offload.executor.HostExecutor` of the offloaded part
    (e.g. ``engine="both"``), the host kernel and the device kernel (``"te"``: TransformerEngine's
    fused Adam, Adam only). For the block-wise 8-bit moments, or other options of ``fo.adamw``,
    build the chain yourself with :func:`megatron_weight_decay_mask`.

    Raises ``ValueError`` naming the field for a value out of its range (a fraction outside
    [0, 1], betas outside [0, 1), negative ``clip_grad``...), CPU offload without decoupled
    weight decay or a precision-aware SGD (Megatron refuses both), dtypes we do not provide
    (fp16 or fp8 moments, fp16 masters), a missing ``lr``, and what is not mapped: ``fp16``
    (loss scaling), ``decoupled_lr``, Muon; ``TypeError`` for a keyword or a set config field
    that is no ``OptimizerConfig`` field (a newer Megatron's fields pass at their defaults).

    Example::

        >>> import functional_offload as fo
        >>> opt = fo.compat.optimizer_from_megatron(lr=3e-4, optimizer_cpu_offload=True,
        ...                                         optimizer_offload_fraction=0.5)
        >>> # or Megatron-core's own config:
        >>> # opt = fo.compat.optimizer_from_megatron(OptimizerConfig(lr=3e-4, bf16=True, ...))
    """
    o = _options(config, options)
    for name in _FLAGS:
        if not isinstance(o[name], bool):
            raise TypeError(f"{name} must be True or False, got {o[name]!r}")
    if o["optimizer"] not in ("adam", "sgd"):
        raise ValueError(f"optimizer={o['optimizer']!r}: the choices here are 'adam' and 'sgd'")
    if o["lr"] is None:
        raise ValueError("lr is None: set the config's lr or pass lr= (a float or a schedule)")
    if o["fp16"]:
        raise ValueError("fp16=True: Megatron's loss scaling is not provided here; train with "
                         "bf16 params (bf16=True, fp16=False)")
    if o["decoupled_lr"] is not None:
        raise ValueError("decoupled_lr is not mapped: build fo.chain(fo.clip_by_global_norm(c), "
                         "fo.partition({...}, labels)) with an fo.adamw for the embedding and "
                         "output params and one for the rest (one global clip, as Megatron's)")
    if o["use_precision_aware_optimizer"] and o["optimizer"] != "adam":
        raise ValueError("use_precision_aware_optimizer is for optimizer='adam' only, as in "
                         "Megatron")
    fraction = _number("optimizer_offload_fraction", o["optimizer_offload_fraction"], 0.0, 1.0)
    clip = _number("clip_grad", o["clip_grad"], 0.0)
    placement = on_device()
    if o["optimizer_cpu_offload"]:
        placement = offload_fraction(fraction)
        if not o["decoupled_weight_decay"]:
            raise ValueError("optimizer_cpu_offload needs decoupled_weight_decay=True, as in "
                             "Megatron (its CPU-offloaded optimizer is AdamW)")
    mask = functools.partial(megatron_weight_decay_mask,
                             apply_wd_to_qk_layernorm=bool(o["apply_wd_to_qk_layernorm"]))
    master = _dtype("main_params_dtype", o["main_params_dtype"], (torch.float32,))
    common = dict(lr=o["lr"], weight_decay=_number("weight_decay", o["weight_decay"], 0.0),
                  placement=placement, master_dtype=master, weight_decay_mask=mask,
                  delayed=delayed, executor=executor, cpu_kernel=cpu_kernel)
    if o["optimizer"] == "sgd":  # fp32 momentum, as Megatron's (exp_avg_dtype is Adam's)
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if _dtype(name, o[name], _MOMENTS) != torch.float32:
                raise ValueError(f"{name}={o[name]!r} is Adam's; SGD keeps its momentum in fp32, "
                                 "as Megatron's")
        if device_kernel != "torch":
            raise ValueError(f"device_kernel={device_kernel!r} is Adam's; SGD steps its "
                             "device-resident leaves with torch's kernel")
        last = sgd(momentum=_number("sgd_momentum", o["sgd_momentum"], 0.0), **common)
    else:
        make = adamw if o["decoupled_weight_decay"] else adam
        last = make(betas=(_number("adam_beta1", o["adam_beta1"], 0.0, 1.0, closed=False),
                           _number("adam_beta2", o["adam_beta2"], 0.0, 1.0, closed=False)),
                    eps=_number("adam_eps", o["adam_eps"], 0.0),
                    mu_dtype=_dtype("exp_avg_dtype", o["exp_avg_dtype"], _MOMENTS),
                    nu_dtype=_dtype("exp_avg_sq_dtype", o["exp_avg_sq_dtype"], _MOMENTS),
                    store_param_remainders=bool(o["use_precision_aware_optimizer"]
                                                and o["store_param_remainders"]),
                    device_kernel=device_kernel, **common)
    if clip == 0:
        return last
    # Megatron clips by an fp32 norm and factor, whatever its grads' dtype
    return chain(clip_by_global_norm(clip, norm_dtype=torch.float32), last)
