"""Core types: transformations, optimizers, the step protocol (optax's ``_src/base.py``).

A :class:`GradientTransformation` maps grads to grads; an :class:`Optimizer` (terminal) maps
grads to params. Optimizers that can be fed leaf by leaf also have ``begin(state) -> Step``
(:class:`Step`): the public step protocol that ``update``, grad streaming (:func:`fo.stream`),
the delayed update and :class:`~functional_offload.TorchOptimizer` all use.

The state's life cycle (its marks, :func:`~functional_offload.state.flush`) is in
:mod:`functional_offload.state`; ``chain``, the held step and the wrapper steps are in
:mod:`functional_offload.combine`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from functional_offload.typing import OptState, Params, Updates

__all__ = [
    "TransformInitFn", "TransformUpdateFn", "OptimizerUpdateFn", "GlobalScaleFn", "BeginFn",
    "Step", "StepBase", "GradientTransformation", "Optimizer", "EmptyState", "Pending", "ParamRefs",
    "StateError",
]


class TransformInitFn(Protocol):
    """``init(params) -> state``: allocate the state for a params tree."""

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """``update(grads, state) -> (grads, state)``: transform a gradient tree."""

    def __call__(self, updates: Updates, state: OptState) -> tuple[Updates, OptState]: ...


class OptimizerUpdateFn(Protocol):
    """``update(grads, state) -> (params, state)``: apply one step and return the new params."""

    def __call__(self, updates: Updates, state: OptState) -> tuple[Params, OptState]: ...


class GlobalScaleFn(Protocol):
    """``global_scale(grads, state) -> factor``: the one 0-d tensor a transform multiplies every
    grad by (e.g. clipping's). Lets a streamed step run ahead as if it were 1 (see :class:`Step`)."""

    def __call__(self, updates: Updates, state: OptState) -> torch.Tensor: ...


class Step(Protocol):
    """One step of an optimizer, fed leaf by leaf; made by ``Optimizer.begin(state)``.

    Leaves are numbered in the params' flatten order (``optree.tree_leaves(params)``).

    - ``feed(i, grad)``: leaf ``i``'s grad is complete (on the current stream). Its update may
      start at once (host-resident state starts its copies and kernel). Errors in the grad are
      raised here, naming the leaf.
    - ``finish(grads=None) -> (params, state)``: the leaves not fed take their grad from
      ``grads`` (a tree like the params; ``None`` leaves get no update); returns what
      ``update(all grads, state)`` returns, bit for bit.
    - ``abort()``: give up the step. The state is left as it was, or marked :data:`FAILED` when
      part of the step was already applied in place.
    - ``close()``: no more ``feed`` (backward is over); work already fed finishes on its own,
      and its hold on shared resources (the executor's staging ring) ends with it.

    A step begun with ``speculative=True`` applies nothing in place before ``finish``, so that
    ``abort`` always leaves the state as it was (host work done ahead goes to spare buffers).

    Attributes (defaults in :class:`StepBase`):
      delayed: the step is a delayed update's, whose host work lands after ``finish`` (at the
        next update or :func:`~functional_offload.flush`): :func:`~functional_offload.stream`
        refuses it, as two ways to hide the host step.
      committed: after ``finish``, for a step run ahead behind factors known only at ``finish``
        (a chain with clipping in front): ``True`` if it was kept, ``False`` if redone;
        ``None`` otherwise.
    """

    delayed: bool
    committed: Optional[bool]

    def feed(self, index: int, grad: torch.Tensor) -> None: ...

    def finish(self, grads: Updates = None) -> tuple[Params, OptState]: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


class StepBase:
    """The defaults of :class:`Step`'s attributes, for the classes implementing it: not delayed,
    nothing run ahead to commit."""

    delayed: bool = False
    committed: Optional[bool] = None


class BeginFn(Protocol):
    def __call__(self, state: OptState, speculative: bool = False) -> Step: ...


class GradientTransformation(NamedTuple):
    """A pure pair ``(init, update)`` mapping gradients to gradients (clipping, scaling, masks).

    ``global_scale``: set by transforms that multiply every grad by one factor computed from
    all of them (clipping), so that a streamed chain can start the step before the factor is
    known and redo it only if the factor is not 1.

    ``fresh_updates``: ``update`` returns new tensors that nothing else holds (not its input,
    not its state). Last in front of a terminal optimizer in a :func:`~functional_offload.chain`,
    it lets that optimizer's step keep them instead of copying them (a delayed step's landing
    writes its new params into their bytes).
    """

    init: TransformInitFn
    update: TransformUpdateFn
    global_scale: Optional[GlobalScaleFn] = None
    fresh_updates: bool = False


class Optimizer(NamedTuple):
    """A terminal transformation: ``update(grads, state)`` returns the updated params.

    The state holds references to the params (a :class:`ParamRefs` node) and is *donated*:
    ``update`` reuses its buffers in place and marks it consumed, so it must not be used again.
    ``begin`` (optional) starts a :class:`Step` to feed leaf by leaf.
    """

    init: TransformInitFn
    update: OptimizerUpdateFn
    begin: Optional[BeginFn] = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class Pending(Protocol):
    """A delayed step in flight: ``land()`` applies it (raising its error, if any);
    ``settle()`` waits for it and drops its result (before a checkpoint is loaded over it);
    ``on_failure(fn)``: ``fn()`` is called when its host step is found to have failed, once its
    state is marked failed (the update it was part of, a partition's, is torn)."""

    def land(self) -> None: ...

    def settle(self) -> None: ...

    def on_failure(self, fn: Callable[[], None]) -> None: ...


@dataclasses.dataclass(eq=False)
class StepCache:
    """What a terminal state's steps learn for the next ones, and what a failed step leaves for
    its recovery; shared by the states an update returns, never checkpointed.

    The layout and what derives from it are valid for one identity, ``key`` (the optimizer's
    spec and weight-decay mask, the params tree, the masters, moments and EMA trees: an update
    keeps them); :meth:`invalidate` drops what a change makes stale.
    """

    packs: list = dataclasses.field(default_factory=list)  # small host leaves packed at init
    key: tuple = ()  # the identity the layout was built for
    layout: Any = None  # the leaves of that identity (optimizers.layout.Leaf)
    static: Any = None  # what the steps of that layout reuse (optimizers.layout.Static)
    kernel: Any = None  # (cpu_kernel, the host kernel over the layout's host views)
    pack_buffers: dict = dataclasses.field(default_factory=dict)  # (pack, device, dtype) -> Buffers
    spares: dict = dataclasses.field(default_factory=dict)  # speculative steps' second host
    #                                                          buffers, by leaf index
    grads_of: Any = None  # the grads check of the params tree (tree.GradsOf)
    scale_was_one: bool = True  # a chain's factors were 1 in the last step: run ahead
    wants_scale: bool = False  # set by init: a chain tells each step whether its factors are 1
    #                            (scale_was_one; delayed steps with Delay.exact_when_clipped)
    lost_params: list = dataclasses.field(default_factory=list)  # a failed step changed these
    #                                                                in place with no master
    restore_params: bool = False  # loaded into a failed state: set the params from the masters
    adopt_masters: list = dataclasses.field(default_factory=list)  # leaves whose masters a
    #     checkpoint lacked (saved in a mode keeping none): set from their params at next use
    split: Any = None  # engine="both": what the split steps measured (forms.split.SplitPlan),
    #                    which plans the next one
    land_order: list = dataclasses.field(default_factory=list)  # leaves in the order the last
    #     forward landed them (fo.land): the next delayed step's host run takes them so
    landing_buffer: Any = None  # the device buffer of the delayed step an update landed, for
    #     that update's own delayed step (dropped by the update if it takes none)
    owned_grads: Any = None  # during a chain's update, the grads its front made (id -> tensor,
    #     held by nothing else): a delayed step's landing keeps them instead of copying them

    def invalidate(self, why: str) -> None:
        """Drop what ``why`` makes stale: ``"layout"`` (another identity: the layout and all
        derived from it, the split's measurements too), ``"params"`` (a param's dtype or shape
        changed: the static part, the packs' buffers and the split's measurements), ``"views"``
        (host storages replaced: the kernel over them)."""
        if why not in ("layout", "params", "views"):
            raise ValueError(f"unknown reason {why!r}")
        if why == "layout":
            self.key, self.layout = (), None
        if why in ("layout", "params"):
            self.static = None
            self.split = None  # the share is searched anew
        if why == "params":
            self.pack_buffers.clear()
        if why in ("layout", "views"):
            self.kernel = None


class ParamRefs(NamedTuple):
    """The live side of a terminal optimizer's state: the params it updates in place, and the
    buffers and work that belong to this process rather than to the checkpoint.

    Part of the state tree so that the state is self-contained, never saved by checkpoints.
    """

    tree: Params
    pending: Optional["Pending"] = None  # delayed mode: the step in flight
    cache: Optional[StepCache] = None  # what steps learn for the next ones (terminal states)


class StateError(RuntimeError):
    """A state was consumed by an update, is in a step, or holds a partially applied step."""

