"""The one-pass native CPU kernels (``csrc/cpu_optim.cpp``), built on first use.

``native()`` returns the compiled module, or ``None`` when it cannot be built here (no compiler
or ninja): callers then use :mod:`functional_offload.kernels.reference`, which computes the same
update in several torch passes. The build is cached by torch (``TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import Optional

import torch

from functional_offload.kernels.reference import AdamHyper, SGDHyper

__all__ = ["native", "adam_", "sgd_"]

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "cpu_optim.cpp")
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-ffp-contract=off",
          "-fopenmp-simd"]


@functools.lru_cache(maxsize=None)
def native() -> Optional[ModuleType]:
    """The compiled kernel module, or ``None`` (with one warning) when it cannot be built."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(name="functional_offload_cpu_optim", sources=[_SRC],
                                  extra_cflags=_FLAGS, verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported flags: fall back, loudly
        warnings.warn(f"functional_offload: native CPU kernel unavailable ({type(e).__name__}: "
                      f"{str(e)[:200]}); using the slower torch kernel", RuntimeWarning,
                      stacklevel=2)
        return None


def adam_(mod: ModuleType, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
          out: Optional[torch.Tensor], h: AdamHyper) -> None:
    """One Adam/AdamW step on contiguous 1-D slices; writes ``out`` (model dtype) if given."""
    wd = h.weight_decay
    mod.adam_step(p, g, m, v, out,
                  1 - h.lr * wd if h.decoupled else 1.0,
                  0.0 if h.decoupled else wd,
                  1 - h.beta1, h.beta2, 1 - h.beta2,
                  (1 - h.beta2 ** h.step) ** 0.5, h.eps,
                  -(h.lr / (1 - h.beta1 ** h.step)))


def sgd_(mod: ModuleType, p: torch.Tensor, g: torch.Tensor, buf: Optional[torch.Tensor],
         out: Optional[torch.Tensor], h: SGDHyper) -> None:
    """One SGD step on contiguous 1-D slices; ``buf`` is ``None`` without momentum."""
    mod.sgd_step(p, g, buf, out, -h.lr, h.momentum, h.weight_decay, h.nesterov)
