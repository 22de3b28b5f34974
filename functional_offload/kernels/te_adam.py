"""TransformerEngine's fused Adam kernel (``multi_tensor_adam``, the kernel of its
``FusedAdam(master_weights=True)``) for device-resident Adam/AdamW leaves.

One pass per element reads the grad in the param's dtype, the fp32 master and moments, and
writes the master, the moments and the bf16/fp16 param: 28 bytes a param of a bf16 model, where
torch's fused kernel needs the grad cast to fp32 first and the param written from the master
after (40 bytes). Its arithmetic is TransformerEngine's, not torch.optim's: the update is
:math:`\\theta - \\eta\\,(\\hat m / (\\sqrt{\\hat v} + \\epsilon) + \\lambda\\theta)` with
:math:`\\hat m = m / (1 - \\beta_1^t)`, :math:`\\hat v = v / (1 - \\beta_2^t)`, rounding
differently from torch's (a few ulps of the master), bit for bit ``FusedAdam``'s.

TransformerEngine is imported on first use; :func:`available` says whether it imports here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["available", "adam_step"]

CHUNK = 2048 * 32  # elements per block of the multi-tensor launch (FusedAdam's)

_module: list[Any] = []  # [transformer_engine_torch] once imported
_error: list[str] = []  # why it does not import here


def _tex() -> Optional[Any]:
    if not _module and not _error:
        try:  # on machines without CUDA TransformerEngine raises RuntimeError, not ImportError
            import transformer_engine.pytorch  # noqa: F401 - loads the core library first
            import transformer_engine_torch as tex
            _module.append(tex)
        except Exception as e:  # noqa: BLE001 - any failure means: not available here
            _error.append(f"{type(e).__name__}: {e}")
    return _module[0] if _module else None


def available() -> tuple[bool, str]:
    """``(True, "")`` where TransformerEngine's kernels import, else ``(False, why)``."""
    return (True, "") if _tex() is not None else (False, _error[0])


def adam_step(grads: list[torch.Tensor], params: list[torch.Tensor], mus: list[torch.Tensor],
              nus: list[torch.Tensor], masters: Optional[list[torch.Tensor]], *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
              decoupled: bool) -> None:
    """One Adam (``decoupled=False``: L2) or AdamW step in place on one device, in one launch
    per :data:`CHUNK` blocks. With ``masters`` (fp32), ``params`` are their bf16/fp16 params,
    written from the new masters, and ``grads`` are in the params' dtype; without, ``params``
    are fp32 and updated themselves. Every tensor contiguous, moments fp32."""
    tex = _tex()
    if tex is None:
        raise RuntimeError(f"TransformerEngine does not import here ({_error[0]})")
    if not params:
        return
    noop = torch.zeros(1, dtype=torch.int32, device=params[0].device)
    lists = [grads, params, mus, nus] + ([masters] if masters is not None else [])
    tex.multi_tensor_adam(CHUNK, noop, lists, lr, beta1, beta2, eps, step,
                          1 if decoupled else 0, 1, weight_decay)
