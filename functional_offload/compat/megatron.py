"""Build the equivalent functional optimizer from Megatron-LM / NeMo optimizer options.

The option names are Megatron's (``--optimizer-cpu-offload`` is ``optimizer_cpu_offload``...).
Differences on purpose: ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` are honoured whether or not
``use_precision_aware_optimizer`` is set (Megatron ignores them without it), the D2H/H2D overlap
is always on, and only the staging ring is pinned (``pin_cpu_grads`` / ``pin_cpu_params`` are
accepted and have nothing to change). See docs/migration.md for the flag table.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from functional_offload.base import Optimizer
from functional_offload.combine import chain
from functional_offload.optimizers import adam, adamw, sgd
from functional_offload.placement import offload_fraction, on_device
from functional_offload.transforms import clip_by_global_norm

__all__ = ["optimizer_from_megatron"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _dtype(name: str, x: Union[str, torch.dtype], allowed: tuple) -> torch.dtype:
    dt = _DTYPES.get(x) if isinstance(x, str) else x
    if dt not in allowed:
        raise ValueError(f"{name}={x!r} is not supported; use one of "
                         f"{sorted(k for k, v in _DTYPES.items() if v in allowed)}")
    return dt


def optimizer_from_megatron(*, optimizer: str = "adam", lr: Any, weight_decay: float = 0.01,
                            adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                            adam_eps: float = 1e-8, sgd_momentum: float = 0.9,
                            clip_grad: float = 1.0, optimizer_cpu_offload: bool = False,
                            optimizer_offload_fraction: float = 1.0,
                            overlap_cpu_optimizer_d2h_h2d: bool = False,
                            pin_cpu_grads: bool = True, pin_cpu_params: bool = True,
                            use_precision_aware_optimizer: bool = False,
                            decoupled_weight_decay: bool = True,
                            exp_avg_dtype: Union[str, torch.dtype] = torch.float32,
                            exp_avg_sq_dtype: Union[str, torch.dtype] = torch.float32,
                            main_params_dtype: Union[str, torch.dtype] = torch.float32) -> Optimizer:
    """The functional optimizer Megatron's options describe: ``chain(clip, adam/adamw/sgd)``.

    - ``optimizer="adam"`` is AdamW when ``decoupled_weight_decay`` (Megatron's default), else
      Adam with L2; ``"sgd"`` is SGD with ``sgd_momentum``.
    - ``clip_grad > 0`` puts :func:`clip_by_global_norm` in front.
    - ``optimizer_cpu_offload`` places state with ``offload_fraction(optimizer_offload_fraction)``
      (Megatron's greedy rule); without it everything stays on the device.

    Raises ``ValueError`` for a fraction outside [0, 1], CPU offload without decoupled weight
    decay (Megatron requires it), or dtypes we do not provide (fp8 moments, fp16 masters).

    Example::

        >>> import functional_offload as fo
        >>> opt = fo.compat.optimizer_from_megatron(lr=3e-4, optimizer_cpu_offload=True,
        ...                                         optimizer_offload_fraction=0.5)
    """
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer={optimizer!r}: Megatron's choices are 'adam' and 'sgd'")
    placement = on_device()
    if optimizer_cpu_offload:
        placement = offload_fraction(optimizer_offload_fraction)
        if not decoupled_weight_decay:
            raise ValueError("optimizer_cpu_offload needs decoupled_weight_decay=True, as in "
                             "Megatron (its CPU-offloaded optimizer is AdamW)")
    elif not 0 <= optimizer_offload_fraction <= 1:
        raise ValueError(f"optimizer_offload_fraction must be in [0, 1], got {optimizer_offload_fraction}")
    common = dict(lr=lr, weight_decay=weight_decay, placement=placement,
                  master_dtype=_dtype("main_params_dtype", main_params_dtype, (torch.float32,)))
    if optimizer == "sgd":
        last = sgd(momentum=sgd_momentum,
                   momentum_dtype=_dtype("exp_avg_dtype", exp_avg_dtype,
                                         (torch.float32, torch.bfloat16, torch.float16)), **common)
    else:
        make = adamw if decoupled_weight_decay else adam
        last = make(betas=(adam_beta1, adam_beta2), eps=adam_eps,
                    mu_dtype=_dtype("exp_avg_dtype", exp_avg_dtype,
                                    (torch.float32, torch.bfloat16, torch.float16)),
                    nu_dtype=_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype,
                                    (torch.float32, torch.bfloat16, torch.float16)), **common)
    return chain(clip_by_global_norm(clip_grad), last) if clip_grad and clip_grad > 0 else last
