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

from functional_offload.kernels.reference import AdamHyper
from functional_offload.kernels.work import Work

__all__ = ["native", "adam_chunk", "sgd_chunk"]

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


def _common(work: Work) -> tuple[list, list, list]:
    """Per piece: the fp32 value, the grad, and the param out (``_EMPTY`` where none)."""
    return ([p.state[0] for p in work.pieces], [p.grad for p in work.pieces],
            [p.out if p.out is not None else _EMPTY for p in work.pieces])


def adam_chunk(mod: ModuleType, work: Work) -> None:
    """Adam/AdamW on the blocks of ``work`` this thread claims; ``piece.hyper`` is an
    :class:`AdamHyper`, ``piece.state`` ``(value fp32, mu, nu)``."""
    if work.prepared is None:  # once per chunk; tasks racing here build the same lists
        values, grads, outs = _common(work)
        mus, nus = [p.state[1] for p in work.pieces], [p.state[2] for p in work.pieces]
        scalars = torch.tensor([_adam_scalars(p.hyper) for p in work.pieces], dtype=torch.float64)
        work.prepared = (values, grads, mus, nus, outs, scalars)
    mod.adam_chunk(*work.prepared, work.counter, work.block)


def sgd_chunk(mod: ModuleType, work: Work) -> None:
    """SGD on the blocks of ``work`` this thread claims; ``piece.state`` is ``(value fp32,)`` or
    ``(value fp32, momentum)``."""
    if work.prepared is None:
        values, grads, outs = _common(work)
        bufs = [p.state[1] if len(p.state) > 1 else _EMPTY for p in work.pieces]
        scalars = torch.tensor([[-p.hyper.lr, p.hyper.momentum, p.hyper.weight_decay,
                                 float(p.hyper.nesterov)] for p in work.pieces], dtype=torch.float64)
        work.prepared = (values, grads, bufs, outs, scalars)
    mod.sgd_chunk(*work.prepared, work.counter, work.block)


def _adam_scalars(h: AdamHyper) -> list[float]:
    """The kernel's scalars, computed in double exactly as torch.optim computes them."""
    wd = h.weight_decay
    return [1 - h.lr * wd if h.decoupled else 1.0, 0.0 if h.decoupled else wd,
            1 - h.beta1, h.beta2, 1 - h.beta2, (1 - h.beta2 ** h.step) ** 0.5, h.eps,
            -(h.lr / (1 - h.beta1 ** h.step))]


_EMPTY = torch.empty(0)  # "no tensor" in the kernels' lists (no separate param, no momentum)
