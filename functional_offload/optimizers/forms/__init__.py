"""How a terminal step's host-resident leaves run: one form per step behind
:class:`~functional_offload.optimizers.forms.base.HostForm`.

- :class:`InPlace`: element-wise math in place, chunked through the executor (grad streaming,
  packed small leaves, strided and quantized params written back);
- :class:`Speculative`: the same, with leaves fed ahead of an unknown factor into spare buffers;
- :class:`Delayed`: in the background, landed by the next step;
- :class:`LeafGranular`: math that needs a whole leaf, one leaf at a time;
- :class:`GpuEngine`: element-wise math on the params' GPU, the state copied up and back in
  chunks (plain and speculative steps of an executor with ``engine="gpu"``, at finish);
- :class:`Split`: the leaves divided between the two, run at once (``engine="both"``; in a
  speculative step the CPU kernel's part is :class:`Speculative`).

:func:`form_for` picks one; a new form is a module here and a line in ``FORMS``.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

from functional_offload.optimizers.forms.base import HostForm, HostWork
from functional_offload.optimizers.forms.delayed import Delayed, Pending
from functional_offload.optimizers.forms.gpu_engine import GpuEngine
from functional_offload.optimizers.forms.in_place import InPlace
from functional_offload.optimizers.forms.leaf_granular import LeafGranular
from functional_offload.optimizers.forms.speculative import Speculative
from functional_offload.optimizers.forms.split import Split

__all__ = ["FORMS", "Case", "Delayed", "GpuEngine", "HostForm", "HostWork", "InPlace",
           "LeafGranular", "Pending", "Speculative", "Split", "form_for"]


class Case(NamedTuple):
    """What decides a step's form."""

    delayed: bool  # the optimizer's delayed=True
    elementwise: bool  # the spec's math is element-wise
    speculative: bool  # begun with speculative=True
    engine: str  # the executor's engine: "cpu", "gpu" or "both"


# the first whose test holds is the step's form, made from the step's HostWork
FORMS: list[tuple[Callable[[Case], bool], Callable[[HostWork], HostForm]]] = [
    (lambda c: not c.elementwise, LeafGranular),
    (lambda c: c.delayed, Delayed),
    # a speculative step's leaves run ahead on the CPU kernel; the GPU engine's at finish,
    # which applies nothing before (the bits of a plain step either way)
    (lambda c: c.speculative and c.engine == "cpu", Speculative),
    (lambda c: c.engine == "gpu", GpuEngine),
    (lambda c: c.engine == "both" and c.speculative, partial(Split, speculative=True)),
    (lambda c: c.engine == "both", Split),
    (lambda c: True, InPlace),
]


def form_for(case: Case, work: HostWork) -> HostForm:
    """The form of a step in ``case``."""
    return next(make for test, make in FORMS if test(case))(work)
