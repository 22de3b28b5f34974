"""The one-pass native CPU kernels (``csrc/cpu_optim.cpp``), built on first use.

``native()`` returns the compiled module, or ``None`` when it cannot be built here (no compiler
or ninja): callers then use :mod:`functional_offload.kernels.reference`, which computes the same
update in several torch passes. The build is cached by torch (``TORCH_EXTENSIONS_DIR``).
:class:`NativeKernel` is what an optimizer hands the executor: each run gets a native queue
(:class:`~functional_offload.kernels.work.Queue`) whose worker threads stay in C++, GIL
released, from the first chunk to the last.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from functional_offload.kernels.reference import AdamHyper
from functional_offload.kernels.work import Work

__all__ = ["native", "NativeKernel", "NativeQueue", "add_adam", "add_sgd"]

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


def add_adam(queue: Any, work: Work) -> int:
    """Add ``work`` to a native queue as Adam/AdamW blocks; ``piece.hyper`` is an
    :class:`AdamHyper`, ``piece.state`` ``(value fp32, mu, nu)``."""
    values, grads, outs = _common(work)
    scalars = torch.tensor([_adam_scalars(p.hyper) for p in work.pieces], dtype=torch.float64)
    return queue.add_adam(values, grads, [p.state[1] for p in work.pieces],
                          [p.state[2] for p in work.pieces], outs, scalars, work.block)


def add_sgd(queue: Any, work: Work) -> int:
    """Add ``work`` to a native queue as SGD blocks; ``piece.state`` is ``(value fp32,)`` or
    ``(value fp32, momentum)``."""
    values, grads, outs = _common(work)
    bufs = [p.state[1] if len(p.state) > 1 else _EMPTY for p in work.pieces]
    scalars = torch.tensor([[-p.hyper.lr, p.hyper.momentum, p.hyper.weight_decay,
                             float(p.hyper.nesterov)] for p in work.pieces], dtype=torch.float64)
    return queue.add_sgd(values, grads, bufs, outs, scalars, work.block)


class NativeQueue:
    """The native queue of one run (see :class:`~functional_offload.kernels.work.Queue`)."""

    def __init__(self, queue: Any, add: Callable[[Any, Work], int]):
        self._queue, self._add = queue, add
        self.ready, self.close, self.cancel = queue.ready, queue.close, queue.cancel
        self.work, self.spans = queue.work, queue.spans

    def add(self, work: Work) -> int:
        return self._add(self._queue, work)

    def wait(self, k: int) -> Optional[BaseException]:
        error = self._queue.wait(k)
        return RuntimeError(error) if error else None


class NativeKernel:
    """A one-pass kernel for the executor: ``add`` (:func:`add_adam` or :func:`add_sgd`) puts a
    chunk's :class:`Work` on the native queue that :meth:`queue` makes for each run."""

    def __init__(self, mod: ModuleType, add: Callable[[Any, Work], int]):
        self.mod, self.add = mod, add

    def queue(self, threads: int, record: bool = False) -> NativeQueue:
        return NativeQueue(self.mod.Queue(record), self.add)


def _adam_scalars(h: AdamHyper) -> list[float]:
    """The kernel's scalars, computed in double exactly as torch.optim computes them."""
    wd = h.weight_decay
    return [1 - h.lr * wd if h.decoupled else 1.0, 0.0 if h.decoupled else wd,
            1 - h.beta1, h.beta2, 1 - h.beta2, (1 - h.beta2 ** h.step) ** 0.5, h.eps,
            -(h.lr / (1 - h.beta1 ** h.step))]


_EMPTY = torch.empty(0)  # "no tensor" in the kernels' lists (no separate param, no momentum)
