"""Core types: transformations, optimizers, the step protocol, ``chain`` (optax's ``_src/base.py``).

A :class:`GradientTransformation` maps grads to grads; an :class:`Optimizer` (terminal) maps
grads to params. Optimizers that can be fed leaf by leaf also have ``begin(state) -> Step``
(:class:`Step`): the public step protocol that ``update``, grad streaming (:func:`fo.stream`),
the delayed update and :class:`~functional_offload.TorchOptimizer` all use.

State life cycle. A terminal state's ``count`` (int64, 0-d) is the number of updates applied,
or one of three marks: :data:`CONSUMED` (an update reused its buffers: use the state it
returned), :data:`FAILED` (a step was partially applied: load a checkpoint into it) and
:data:`BUSY` (a step on it has begun and not finished). :func:`check_usable` refuses marked
states with an error that says what to do.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional, Protocol, Union

import optree
import torch

from functional_offload.tree import check_grads, flatten_like, local
from functional_offload.typing import OptState, Params, Updates

__all__ = [
    "TransformInitFn", "TransformUpdateFn", "OptimizerUpdateFn", "GlobalScaleFn", "BeginFn",
    "Step", "GradientTransformation", "Optimizer", "EmptyState", "ParamRefs", "StateError",
    "CONSUMED", "FAILED", "BUSY", "chain", "params_of", "grads_for", "ema_params", "flush",
    "check_usable", "claim", "release", "mark_tensors",
    "terminal_states", "terminal_counts", "stepped", "mark_failed", "check_recoverable", "check_states",
    "restore_params",
]

CONSUMED, FAILED, BUSY = -1, -2, -3


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
    """

    def feed(self, index: int, grad: torch.Tensor) -> None: ...

    def finish(self, grads: Updates = None) -> tuple[Params, OptState]: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


class BeginFn(Protocol):
    def __call__(self, state: OptState, speculative: bool = False) -> Step: ...


class GradientTransformation(NamedTuple):
    """A pure pair ``(init, update)`` mapping gradients to gradients (clipping, scaling, masks).

    ``global_scale``: set by transforms that multiply every grad by one factor computed from
    all of them (clipping), so that a streamed chain can start the step before the factor is
    known and redo it only if the factor is not 1.
    """

    init: TransformInitFn
    update: TransformUpdateFn
    global_scale: Optional[GlobalScaleFn] = None


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
    ``settle()`` waits for it and drops its result (before a checkpoint is loaded over it)."""

    def land(self) -> None: ...

    def settle(self) -> None: ...


class ParamRefs(NamedTuple):
    """The live side of a terminal optimizer's state: the params it updates in place, and the
    buffers and work that belong to this process rather than to the checkpoint.

    Part of the state tree so that the state is self-contained, never saved by checkpoints.
    """

    tree: Params
    pending: Optional["Pending"] = None  # delayed mode: the step in flight
    spare: Any = None  # speculative steps: a second set of host state buffers, by leaf index
    notes: Any = None  # what steps learn for the next ones (a dict; e.g. whether to run ahead)


class StateError(RuntimeError):
    """A state was consumed by an update, is in a step, or holds a partially applied step."""


def _state_nodes(tree: Any, out: list[Any]) -> list[Any]:
    """Append the NamedTuples inside ``tree`` to ``out``, outer before inner, in a fixed order;
    tensors, :class:`ParamRefs` and the trees of a terminal state (which mirror the params) are
    not entered (called on each step: no per-leaf work)."""
    if isinstance(tree, (torch.Tensor, ParamRefs)) or tree is None:
        return out
    kind = type(tree)
    if kind is dict or kind is list or kind is tuple:
        for x in (tree.values() if kind is dict else tree):
            if type(x) is not torch.Tensor and x is not None:
                _state_nodes(x, out)
    else:
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            out.append(tree)
            if isinstance(getattr(tree, "params", None), ParamRefs):
                return out  # a terminal state: its other fields are trees of tensors
            children: Any = tree
        else:
            try:
                children = optree.tree_flatten_one_level(tree)[0]
            except ValueError:  # a leaf
                return out
        for x in children:
            _state_nodes(x, out)
    return out


def terminal_states(state: OptState) -> list[Any]:
    """The terminal optimizers' states inside ``state`` (those with a :class:`ParamRefs`)."""
    return _terminal(_state_nodes(state, []))


def terminal_counts(state: OptState) -> list[int]:
    """The counts (or marks) of the terminal states inside ``state``."""
    return [int(s.count) for s in terminal_states(state)]


def stepped(state: OptState, counts: list[int]) -> bool:
    """Whether every terminal state inside ``state`` holds one step more than ``counts`` (its
    :func:`terminal_counts` when a step began): the step completed, even if what ran it then
    raised (a signal's handler, run once the step was done)."""
    return all(c == n + 1 for n, c in zip(counts, terminal_counts(state)))


def _terminal(nodes: list[Any]) -> list[Any]:
    return [x for x in nodes if isinstance(getattr(x, "params", None), ParamRefs)]


MARK_FIELDS = ("count", "mini_step", "notfinite_count")
"""A state NamedTuple carries its marks in the first of these fields it has (an int64 0-d
tensor): terminal states and ``inject_hyperparams`` in ``count``, ``MultiSteps`` in
``mini_step``, ``apply_if_finite`` in ``notfinite_count``."""


def _mark_tensors(state: OptState, nodes: Optional[list[Any]] = None) -> list[tuple[Any, torch.Tensor]]:
    """``(node, marks tensor)`` for every state NamedTuple inside ``state`` (or of ``nodes``,
    its :func:`_state_nodes`) with a marks field."""
    out = []
    for node in _state_nodes(state, []) if nodes is None else nodes:
        field = next((f for f in MARK_FIELDS if f in node._fields), None)
        x = getattr(node, field) if field is not None else None
        if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point():
            out.append((node, x))
    return out


def _marked(state: OptState, nodes: Optional[list[Any]] = None) -> list[tuple[Any, int]]:
    """``(node, mark)`` for every state NamedTuple inside ``state`` with a marks field."""
    return [(node, int(x)) for node, x in _mark_tensors(state, nodes)]


def mark_tensors(state: OptState) -> list[torch.Tensor]:
    """The tensors holding the marks of every state NamedTuple inside ``state`` (counts)."""
    return [x for _, x in _mark_tensors(state)]


def check_states(state: OptState) -> None:
    """Run the ``check()`` of every state NamedTuple inside ``state`` that has one (what a
    state type requires of values a loop may write into it), before it is saved."""
    for node in _state_nodes(state, []):
        check = getattr(node, "check", None)
        if callable(check):
            check()


def check_usable(state: OptState, action: str) -> None:
    """Raise :class:`StateError` if a state inside ``state`` is consumed, failed or in a step
    (see :data:`MARK_FIELDS`); ``action`` names what was attempted ("update", "save"...)."""
    _refuse_marked(_marked(state), action)


def _refuse_marked(marked: list[tuple[Any, int]], action: str) -> None:
    for s, n in marked:
        name = type(s).__name__
        if n == CONSUMED:
            raise StateError(f"cannot {action}: this {name} was consumed by an earlier update (its "
                             "buffers were reused in place); use the state that update returned")
        if n == FAILED:
            raise StateError(f"cannot {action}: this {name} is failed — a step was partially "
                             "applied when it raised (see that error). Load the last checkpoint "
                             "into it (fo.load(path, like=state)) or start again from opt.init")
        if n == BUSY:
            raise StateError(f"cannot {action}: this {name} is in a step that has not finished "
                             "(a fo.stream block not finished yet, or an update in another "
                             "thread); finish that step first")


def mark_failed(count: torch.Tensor, notes: Optional[dict], lost: list[str]) -> None:
    """Mark a terminal state (its ``count`` and ``ParamRefs.notes``) :data:`FAILED`. ``lost``:
    the paths of the params its failed step may have changed in place that the state keeps no
    master of, so that a checkpoint of the state alone cannot put them back
    (:func:`check_recoverable`)."""
    count.fill_(FAILED)
    if notes is not None:
        notes["lost_params"] = list(lost)


def check_recoverable(state: OptState) -> None:
    """Before a checkpoint is loaded into ``state``: raise :class:`StateError` if a failed step
    changed params that loading cannot restore; else note that the params of failed terminal
    states are to be set from their loaded masters (:func:`restore_params`)."""
    for s in terminal_states(state):
        if int(s.count) != FAILED or s.params.notes is None:
            continue
        lost = s.params.notes.get("lost_params", [])
        if lost:
            shown = ", ".join(repr(p) for p in lost[:8]) + (f" (of {len(lost)})" if len(lost) > 8 else "")
            raise StateError(
                f"cannot load into this failed {type(s).__name__}: its failed step changed "
                f"params {shown} in place, and the state keeps no master copy of them, so "
                "loading the optimizer's checkpoint cannot put them back. Restore the params "
                "from your model checkpoint, then load into a fresh state: "
                "state = fo.load(path, like=opt.init(params)) (with fo.TorchOptimizer: restore "
                "the model's params, then optimizer.load_state_dict(...))")
        s.params.notes["restore_params"] = True


@torch.no_grad()
def restore_params(state: OptState) -> None:
    """Set the params of the terminal states that :func:`check_recoverable` noted from their
    masters, just loaded (the params a failed step left half stepped are then those of the
    checkpoint, as after any completed step: each is its master rounded)."""
    for s in terminal_states(state):
        notes = s.params.notes
        if notes is None or not notes.pop("restore_params", False):
            continue
        notes.pop("lost_params", None)
        params = flatten_like(s.params.tree, s.params.tree, "params")
        for p, m in zip(params, flatten_like(s.master, s.params.tree, "state.master")):
            if m is not None:
                local(p).copy_(m)


_claiming = threading.Lock()


def claim(state: OptState, action: str) -> list[tuple[torch.Tensor, int]]:
    """Check ``state`` is usable and mark its terminal states busy, atomically (two threads
    cannot both begin a step on one state, or save it while a step begins); returns the
    ``(count, value)`` pairs to restore with :func:`release`."""
    with _claiming:
        nodes = _state_nodes(state, [])
        _refuse_marked(_marked(state, nodes), action)
        marks = [(s.count, int(s.count)) for s in _terminal(nodes)]
        for count, _ in marks:
            count.fill_(BUSY)
    return marks


def release(marks: list[tuple[torch.Tensor, int]]) -> None:
    """Undo :func:`claim`."""
    for count, n in marks:
        count.fill_(n)


def flush(state: OptState) -> OptState:
    """Finish any update still in flight in ``state`` (delayed mode) and apply it to the params.

    The host step started by the last ``update`` is waited for, its params are copied to the
    device, and the caller's stream is ordered after the copies. A no-op for states with nothing
    in flight. If the step failed, its error is raised and the state is marked failed (later
    calls raise :class:`StateError`, as for any failed or consumed state). An interrupt (Ctrl-C)
    arriving meanwhile is raised once the step has landed. After ``dcp.load`` into a failed
    state, it sets the params from the masters loaded (the next update does it otherwise).
    Returns ``state``.
    """
    check_usable(state, "flush")
    restore_params(state)  # loaded into a failed state in place (DCP): its params now
    for s in terminal_states(state):
        if s.params.pending is not None:
            s.params.pending.land()
    return state


AnyTransformation = Union[GradientTransformation, Optimizer]


def chain(*transforms: AnyTransformation) -> AnyTransformation:
    """Apply transformations in sequence; the last one may be a terminal :class:`Optimizer`.

    ``chain(t1, ..., tn)`` feeds the gradients through ``t1 ... tn``. Its state is the tuple
    ``(s1, ..., sn)`` of the parts' states. It is an :class:`Optimizer` when ``tn`` is one (its
    ``update`` returns params), else a :class:`GradientTransformation`.

    A chain ending in an optimizer can be streamed (``begin``): when every transform in front
    has a ``global_scale`` (clipping), the step runs ahead as if every factor were 1 and is
    committed if they are (bit for bit what ``update`` gives) or redone with the true factors;
    otherwise the grads are held until ``finish`` runs ``update``.

    Example::

        opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=1e-3))
        state = opt.init(params)
        params, state = opt.update(grads, state)
    """
    if not transforms:
        raise ValueError("chain() needs at least one transformation")
    for i, t in enumerate(transforms):
        if not isinstance(t, (GradientTransformation, Optimizer)):
            raise TypeError(f"chain argument {i} is a {type(t).__name__}, expected a "
                            "GradientTransformation or an Optimizer")
        if isinstance(t, Optimizer) and i != len(transforms) - 1:
            raise TypeError(f"chain argument {i} is a terminal Optimizer (it returns params); "
                            "only the last element of a chain may be one")
    *front, last = transforms

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def check_state(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain state must be a tuple of {len(transforms)} states (the one "
                             f"init returned); got {type(state).__name__}")

    def update(updates: Updates, state: tuple) -> tuple[Any, tuple]:
        check_state(state)
        if isinstance(last, GradientTransformation):
            return _through(transforms, updates, state)
        check_usable(state, "update")
        grads_for(updates, state[-1])
        counts = terminal_counts(state[-1])
        marks = [(x, int(x)) for x in mark_tensors(state[:-1])]
        try:
            return _through(transforms, updates, state)
        except BaseException:
            # the front's transforms are pure: their states are as they were but for their
            # marks, so a terminal step that did not happen leaves the whole chain usable
            if not stepped(state[-1], counts):
                release(marks)
            raise

    if isinstance(last, GradientTransformation):
        return GradientTransformation(init, update)

    def begin(state: tuple, speculative: bool = False) -> Step:
        check_state(state)
        if not front:
            return _Chained(last.begin(state[-1], speculative), None, state, update) \
                if last.begin is not None else HeldStep(update, state)
        if last.begin is not None and all(t.global_scale is not None for t in front):
            notes = terminal_states(state[-1])[0].params.notes
            ahead = notes is None or notes.get("scale_was_one", True)
            inner = last.begin(state[-1], True) if ahead else HeldStep(last.update, state[-1])
            return _Chained(inner, front, state, update)
        return HeldStep(update, state)

    return Optimizer(init, update, begin)


def _through(transforms: tuple, updates: Updates, state: tuple) -> tuple[Any, tuple]:
    new = []
    for t, s in zip(transforms, state):
        updates, s = t.update(updates, s)
        new.append(s)
    return updates, tuple(new)


class HeldStep:
    """A :class:`Step` for optimizers that cannot start before every grad is known: ``feed``
    holds the grads, ``finish`` runs ``update`` on them. The state is marked busy meanwhile."""

    def __init__(self, update: OptimizerUpdateFn, state: OptState):
        self.update, self.state = update, state
        self.params = params_of(state)
        self.spec = optree.tree_structure(self.params)
        self.fed: dict[int, torch.Tensor] = {}
        self.finished = False
        self.marks = claim(state, "update")

    def _unmark(self) -> None:
        release(self.marks)
        self.marks = []

    def feed(self, index: int, grad: torch.Tensor) -> None:
        if index in self.fed:
            raise RuntimeError(f"leaf {index} got a second gradient in one step")
        self.fed[index] = grad

    def finish(self, grads: Updates = None) -> tuple[Params, OptState]:
        if self.finished:
            raise RuntimeError("this step already finished; begin a new one for each update")
        self.finished = True
        self._unmark()
        full = merge_grads(self.spec, self.fed, grads)
        self.fed.clear()
        return self.update(full, self.state)

    def abort(self) -> None:
        self.finished = True
        self._unmark()

    def close(self) -> None:
        """Nothing was started: nothing to close."""


def merge_grads(spec: optree.PyTreeSpec, fed: dict[int, torch.Tensor], grads: Updates) -> Updates:
    """A grads tree of structure ``spec``: the fed grads by leaf index, the rest from ``grads``."""
    rest = [None] * spec.num_leaves if grads is None else flatten_up_to(spec, grads)
    return optree.tree_unflatten(spec, [fed.get(i, g) for i, g in enumerate(rest)])


def flatten_up_to(spec: optree.PyTreeSpec, tree: Any) -> list[Any]:
    return flatten_like(tree, optree.tree_unflatten(spec, [0] * spec.num_leaves), "grads")


class _Chained:
    """A chain's step: the terminal's step fed the raw grads; the front's factors (if any)
    decide at ``finish`` between committing it and redoing the step through ``update``.

    Whether the factors were 1 is noted in the state's ``ParamRefs.notes``: after a step whose
    factor was not 1 (clipping on) the next step holds its grads instead of running ahead (a
    step run ahead would be redone), until a factor of 1 is seen again."""

    def __init__(self, inner: Step, front: Optional[list], state: tuple, update: OptimizerUpdateFn):
        self.inner, self.front, self.state, self.update = inner, front, state, update
        self.spec = optree.tree_structure(params_of(state[-1]))
        self.fed: dict[int, torch.Tensor] = {}
        self.committed: Optional[bool] = None  # after finish: True if the step ran ahead
        self.delayed = front is None and getattr(inner, "delayed", False)

    def feed(self, index: int, grad: torch.Tensor) -> None:
        self.inner.feed(index, grad)
        self.fed[index] = grad

    def finish(self, grads: Updates = None) -> tuple[Params, OptState]:
        if self.front is None:
            params, s = self.inner.finish(grads)
            return params, (s,)
        try:
            full = merge_grads(self.spec, self.fed, grads)
            self.fed.clear()
            factors = [t.global_scale(full, s) for t, s in zip(self.front, self.state)]
            dev = factors[0].device
            ones = bool(torch.stack([f.detach().float().to(dev) for f in factors]).eq(1).all())
        except BaseException:
            self.inner.abort()
            raise
        notes = terminal_states(self.state[-1])[0].params.notes
        if notes is not None:
            notes["scale_was_one"] = ones
        if isinstance(self.inner, HeldStep):  # nothing ran ahead
            self.inner.abort()
            return self.update(full, self.state)
        if ones:  # every factor is 1: the grads the step ran on are the chain's, bit for bit
            self.committed = True
            params, s = self.inner.finish(grads)
            return params, (*self.state[:-1], s)
        self.committed = False
        self.inner.abort()  # the state is as it was: run the chain as update would
        return self.update(full, self.state)

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()


def ema_params(state: OptState) -> Params:
    """The EMA of the params kept by a terminal optimizer built with ``ema_decay`` (fp32, a tree
    like the params; host-resident where the state is). A delayed step in flight lands first.

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.sgd(lr=1.0, ema_decay=0.5)
        >>> params, state = opt.update({"w": torch.ones(1)}, opt.init({"w": torch.zeros(1)}))
        >>> params["w"], fo.ema_params(state)["w"]
        (tensor([-1.]), tensor([-0.5000]))
    """
    found = [s for s in terminal_states(state) if hasattr(s, "ema")]
    if not found:
        raise ValueError("this state holds no terminal optimizer's state")
    keeping = [s for s in found if not (isinstance(s.ema, tuple) and not s.ema)]
    if not keeping:
        raise ValueError(f"this {type(found[0]).__name__} keeps no EMA: build the optimizer with "
                         "ema_decay=... (e.g. fo.adamw(1e-3, ema_decay=0.999))")
    check_usable(state, "read its EMA")
    flush(state)
    if len(found) == 1:
        return found[0].ema
    # several terminal states (fo.partition's parts): each param's EMA from the part stepping it
    by_param: dict[int, torch.Tensor] = {}
    for s in keeping:
        tree = s.params.tree
        for p, e in zip(optree.tree_leaves(tree), flatten_like(s.ema, tree, "state.ema")):
            by_param[id(p)] = e
    paths, leaves, spec = optree.tree_flatten_with_path(params_of(state))
    missing = [".".join(map(str, path)) for path, p in zip(paths, leaves) if id(p) not in by_param]
    if missing:
        shown = f"{missing[:8]}" + (f" (of {len(missing)})" if len(missing) > 8 else "")
        raise ValueError(f"params {shown} are stepped by a part that keeps no EMA: build "
                         "every part's optimizer with ema_decay=... to read fo.ema_params")
    return optree.tree_unflatten(spec, [by_param[id(p)] for p in leaves])


def params_of(state: OptState) -> Params:
    """The params tree referenced by a (chained) terminal state (the first :class:`ParamRefs`)."""
    return _refs_of(state).tree


def grads_for(grads: Updates, state: OptState) -> list[Optional[torch.Tensor]]:
    """``grads`` flattened like the params of ``state`` (as :func:`params_of` finds them), each
    checked (:func:`~functional_offload.tree.check_grads`; the state's notes keep what the check
    learns of the params, for the next steps)."""
    refs = _refs_of(state)
    return check_grads(grads, refs.tree, refs.notes)


def _refs_of(state: OptState) -> ParamRefs:
    found = terminal_states(state)
    if not found:
        raise ValueError("this state holds no params: it is not the state of a terminal Optimizer")
    return found[0].params
