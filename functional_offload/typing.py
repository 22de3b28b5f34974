"""Type aliases shared by every module (TorchOpt's ``typing`` module, on optree pytrees)."""

from __future__ import annotations

from typing import Any, Callable, Union

__all__ = ["Params", "Updates", "OptState", "Schedule", "ScalarOrSchedule", "Path"]

Params = Any
"""A pytree (optree) whose leaves are tensors: a dict of named params, a list, a NamedTuple..."""
Updates = Any
"""A pytree mirroring ``Params``; a ``None`` leaf means "no gradient for this leaf"."""
OptState = Any
"""A pytree of tensors (NamedTuples, tuples): the explicit state of a transformation."""
Schedule = Callable[[int], float]
"""A function of the number of updates already applied (0 before the first update)."""
ScalarOrSchedule = Union[float, Schedule]
Path = str
"""A leaf's dotted path in its tree, e.g. ``"layers.0.weight"``."""
