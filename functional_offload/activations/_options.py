""":class:`~functional_offload.ActivationOffload`'s options checked, and the fixed decisions a
count of offloaded groups (``offload=``) makes; errors name the option and what it takes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional, Sequence, Union

from functional_offload.activations.cost_model import KEEP, OFFLOAD, RECOMPUTE
from functional_offload.checks import is_int

__all__ = ["check_int", "check_options"]


def check_int(name: str, value: Any, least: int, what: str) -> None:
    """An int (not a bool) of at least ``least``, or an error naming the option."""
    if not is_int(value) or value < least:
        raise ValueError(f"{name} must be an int >= {least} ({what}), got {value!r}")


def _offload_count(n: int, offload: Union[int, float, None],
                   budget_bytes: Optional[int]) -> Optional[int]:
    """How many early groups ``offload`` offloads (None: a budget decides)."""
    if (offload is None) == (budget_bytes is None):
        raise ValueError("pass one of offload= (how many early groups to offload) or "
                         "budget_bytes= (a peak-memory budget the planner meets)")
    count = None
    if isinstance(offload, float):
        if not 0 <= offload <= 1:  # NaN too
            raise ValueError(f"offload as a fraction must be in [0, 1], got {offload}")
        count = min(math.floor(offload * n), n - 1)
    elif isinstance(offload, int) and not isinstance(offload, bool):
        count = offload
    elif offload is not None:
        raise ValueError(f"offload is a group count (int) or a fraction (float), got "
                         f"{offload!r}")
    if count is not None and not 0 <= count <= n - 1:
        raise ValueError(f"can offload 0 … {n - 1} of {n} groups (never the last), got "
                         f"{count}; lower `offload`")
    return count


def check_options(num_groups: int, offload: Union[int, float, None],
                  budget_bytes: Optional[int], min_bytes: int, prefetch: int,
                  max_inflight_bytes: Union[int, str, None], host_cap_bytes: Optional[int],
                  recompute_groups: Sequence[int]) -> tuple[Optional[int], Optional[list[str]]]:
    """The options checked: ``(count, decisions)``, the offloaded-group count and each group's
    fixed decision, or ``(None, None)`` with ``budget_bytes`` (the planner decides)."""
    check_int("num_groups", num_groups, 1, "how many groups the forward marks")
    n = num_groups
    count = _offload_count(n, offload, budget_bytes)
    if budget_bytes is not None:
        check_int("budget_bytes", budget_bytes, 1, "a byte count, e.g. 8 << 30")
    check_int("min_bytes", min_bytes, 0, "a byte count")
    check_int("prefetch", prefetch, 1, "how many groups ahead backward reloads")
    if not (max_inflight_bytes is None or isinstance(max_inflight_bytes, str)
            and max_inflight_bytes == "auto"):
        check_int("max_inflight_bytes", max_inflight_bytes, 0,
                  "a byte count, 'auto' (twice the largest group's) or None (no bound)")
    if host_cap_bytes is not None:
        check_int("host_cap_bytes", host_cap_bytes, 0, "a byte count or None (no bound)")
    if isinstance(recompute_groups, (str, bytes)) or not isinstance(recompute_groups, Iterable):
        raise ValueError(f"recompute_groups must be a sequence of group indices, got "
                         f"{recompute_groups!r}")
    recompute_groups = tuple(recompute_groups)
    for i in recompute_groups:
        check_int("recompute_groups", i, 0, f"group indices 0 … {n - 1}")
    bad = sorted(i for i in recompute_groups if not 0 <= i < n)
    if bad or (recompute_groups and budget_bytes is not None):
        raise ValueError(f"recompute_groups go with offload= and name groups 0 … {n - 1}; got "
                         f"{list(recompute_groups)} (with budget_bytes the planner decides)")
    both = sorted(set(range(count or 0)) & set(recompute_groups))
    if both:
        raise ValueError(f"groups {both} are both offloaded and recomputed; recomputed groups "
                         "save no activations to offload — offload fewer groups or recompute "
                         "others")
    if count is None:
        return None, None
    return count, [RECOMPUTE if i in recompute_groups else OFFLOAD if i < count else KEEP
                   for i in range(n)]
