r"""Learning-rate schedules: plain callables of the number of updates already applied.

``n`` is 0 for the first update, so ``lr=lambda n: base * f(n)`` matches
``torch.optim.lr_scheduler.LambdaLR(opt, f)`` step for step.
"""

from __future__ import annotations

import math

from functional_offload.checks import is_int
from functional_offload.typing import Schedule

__all__ = ["constant", "linear_warmup", "cosine_decay", "warmup_cosine"]


def _steps(name: str, n: int) -> int:
    if not is_int(n) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return n


def constant(value: float) -> Schedule:
    r""":math:`\eta(n) = v`."""
    return lambda n: value


def linear_warmup(peak: float, warmup_steps: int, init: float = 0.0) -> Schedule:
    r"""From ``init`` to ``peak`` linearly over ``warmup_steps``, then ``peak``:
    :math:`\eta(n) = \eta_0 + (\eta_{peak} - \eta_0)\min(1, n / W)`."""
    w = _steps("warmup_steps", warmup_steps)
    return lambda n: peak if w == 0 else init + (peak - init) * min(1.0, n / w)


def cosine_decay(init: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    r"""Cosine from ``init`` to ``alpha * init`` over ``decay_steps``, then flat:
    :math:`\eta(n) = \eta_0\,[(1-\alpha)\tfrac{1}{2}(1 + \cos(\pi \min(n, T)/T)) + \alpha]`."""
    T = _steps("decay_steps", decay_steps)

    def f(n: int) -> float:
        c = 0.5 * (1 + math.cos(math.pi * min(n, T) / T)) if T else 0.0
        return init * ((1 - alpha) * c + alpha)

    return f


def warmup_cosine(peak: float, warmup_steps: int, decay_steps: int, init: float = 0.0,
                  end: float = 0.0) -> Schedule:
    r"""Linear warmup from ``init`` to ``peak`` over ``warmup_steps``, then cosine decay to
    ``end`` over the following ``decay_steps - warmup_steps`` (``decay_steps`` counts the
    warmup, as in optax's ``warmup_cosine_decay_schedule``)."""
    w, T = _steps("warmup_steps", warmup_steps), _steps("decay_steps", decay_steps)
    if T < w:
        raise ValueError(f"decay_steps ({T}) must be >= warmup_steps ({w})")
    warm = linear_warmup(peak, w, init)

    def f(n: int) -> float:
        if n < w:
            return warm(n)
        c = 0.5 * (1 + math.cos(math.pi * min(n - w, T - w) / (T - w))) if T > w else 0.0
        return end + (peak - end) * c

    return f
