"""Checks of the plain Python numbers that options take (a bool is not a number here).

At the bottom of the package: it imports nothing of it, so every module may use it.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

__all__ = ["real", "is_int"]


def real(x: Any) -> Optional[float]:
    """``x`` as a float if it is a real number (not a bool) that a float holds, else ``None``.

    >>> real(2), real(0.5), real(True), real("1"), real(10 ** 400)
    (2.0, 0.5, None, None, None)
    """
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


def is_int(x: Any) -> bool:
    """Whether ``x`` is an int and not a bool.

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(x, int) and not isinstance(x, bool)
