"""A state's life cycle: its marks, claiming it for a step, landing a delayed step, reading it.

A terminal state's ``count`` (int64, 0-d) is the number of updates applied, or one of three
marks: :data:`CONSUMED` (an update reused its buffers: use the state it returned),
:data:`FAILED` (a step was partially applied: load a checkpoint into it) and :data:`BUSY` (a
step on it has begun and not finished). :func:`check_usable` refuses marked states with an
error that says what to do; :func:`claim` marks a state busy for a step and :func:`release`
undoes it; :func:`flush` lands a delayed step; :func:`params_of` and :func:`ema_params` read a
state.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import optree
import torch

from functional_offload.base import ParamRefs, StateError, StepCache
from functional_offload.kernels.remainder import high, is_lean, is_split
from functional_offload.quantized import is_quantized, write_params
from functional_offload.tree import check_grads, flatten_like, local, paths_of
from functional_offload.typing import OptState, Params, Updates

__all__ = [
    "CONSUMED", "FAILED", "BUSY", "MARK_FIELDS", "params_of", "grads_for", "ema_params", "flush",
    "land", "missed_landing", "refuse_missed_landings", "tensors_of",
    "check_usable", "claim", "release", "mark_tensors", "terminal_states", "terminal_counts",
    "stepped", "mark_failed", "check_recoverable", "check_states", "restore_params",
    "after_load",
]

CONSUMED, FAILED, BUSY = -1, -2, -3


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


def check_loadable(state: OptState) -> None:
    """Raise :class:`StateError` if a state inside ``state`` — a wrapper's too — is consumed or
    in a step: a load would overwrite buffers that a newer state shares. A failed one may be
    loaded into (that is how it recovers)."""
    _refuse_marked([(s, n) for s, n in _marked(state) if n in (CONSUMED, BUSY)], "load into it")


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


def mark_failed(count: torch.Tensor, cache: Optional[StepCache], lost: list[str]) -> None:
    """Mark a terminal state (its ``count`` and ``ParamRefs.cache``) :data:`FAILED`. ``lost``:
    the paths of the params its failed step may have changed in place that the state keeps no
    master of, so that a checkpoint of the state alone cannot put them back
    (:func:`check_recoverable`)."""
    count.fill_(FAILED)
    if cache is not None:
        cache.lost_params = list(lost)


def mark_torn(state: OptState, changed: set[str]) -> None:
    """Mark the terminal states inside ``state`` :data:`FAILED`: their step completed, but within
    a larger one that failed (a :func:`~functional_offload.partition`'s other part). ``changed``:
    the paths of the params that step changed; those the states keep no master of are lost to
    a checkpoint load (:func:`mark_failed`)."""
    for s in terminal_states(state):
        masters, spec = optree.tree_flatten(s.master, none_is_leaf=True)
        lost = [p for p, m in zip(paths_of(spec), masters) if m is None and p in changed]
        mark_failed(s.count, s.params.cache, lost)


def check_recoverable(state: OptState) -> None:
    """Before a checkpoint is loaded into ``state``: raise :class:`StateError` if a failed step
    changed params that loading cannot restore; else note that the params of failed terminal
    states are to be set from their loaded masters (:func:`restore_params`)."""
    for s in terminal_states(state):
        if int(s.count) != FAILED or s.params.cache is None:
            continue
        lost = s.params.cache.lost_params
        if lost:
            shown = ", ".join(repr(p) for p in lost[:8]) + (f" (of {len(lost)})" if len(lost) > 8 else "")
            raise StateError(
                f"cannot load into this failed {type(s).__name__}: its failed step may have "
                f"changed params {shown} in place (work that writes them had been handed out), "
                "and the state keeps no master copy of them, so loading the optimizer's "
                "checkpoint cannot put them back. Restore the params "
                "from your model checkpoint, then load into a fresh state: "
                "state = fo.load(path, like=opt.init(params)) (with fo.TorchOptimizer: restore "
                "the model's params, then optimizer.load_state_dict(...))")
        s.params.cache.restore_params = True


@torch.no_grad()
def restore_params(state: OptState) -> None:
    """Set the params of the terminal states that :func:`check_recoverable` noted from their
    masters, just loaded (the params a failed step left half stepped are then those of the
    checkpoint, as after any completed step: each is its master rounded)."""
    for s in terminal_states(state):
        cache = s.params.cache
        if cache is None or not cache.restore_params:
            continue
        cache.restore_params, cache.lost_params = False, []
        params = flatten_like(s.params.tree, s.params.tree, "params")
        for p, m in zip(params, flatten_like(s.master, s.params.tree, "state.master")):
            if m is None:
                continue
            p = local(p)
            if is_quantized(p) and m.device.type == "cpu":  # as a host step writes it: from
                m = m.to(p.dtype)  # the value copied up in the param's nominal dtype
            if not is_lean(m):  # (a remainder-only one's param was written with it)
                write_params([p], [high(m) if is_split(m) else m])


@torch.no_grad()
def adopt_masters(state: OptState) -> None:
    """Set the masters a checkpoint lacked from their params (noted by the load: masters of
    fp32 params, which equal their params after every landed step, are kept in some modes and
    not in others). Done at first use, not at the load, so that the model's own checkpoint may
    be loaded after the optimizer's."""
    for s in terminal_states(state):
        cache = s.params.cache
        if cache is None or not cache.adopt_masters:
            continue
        params = flatten_like(s.params.tree, s.params.tree, "params")
        masters = flatten_like(s.master, s.params.tree, "state.master")
        for i in cache.adopt_masters:
            masters[i].copy_(local(params[i]))
        cache.adopt_masters = []


def after_load(state: OptState) -> None:
    """What a load left for the first use of ``state``: :func:`restore_params`, then
    :func:`adopt_masters`."""
    restore_params(state)
    adopt_masters(state)


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


def missed_landing(paths: list[str]) -> RuntimeError:
    """The error of an update whose grads include params the forward read before they were
    landed (``Pending.missed``, :mod:`functional_offload.optimizers.forms.delayed`)."""
    names = [repr(p) for p in paths]
    return RuntimeError(
        f"params {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} got grads but "
        "were not landed before the forward read them (their module's forward did not "
        "run: e.g. a parent reads them itself): those grads were computed from the params "
        "of the step before. Land them before they are read (fo.land(state, [...]), or "
        "optimizer.land([...]) with fo.TorchOptimizer, where they are used). This update "
        "did not run; the state holds the last one, landed")


def refuse_missed_landings(parts: Sequence[tuple[OptState, Any]],
                           name: Callable[[int, str], str] = lambda _, path: path) -> None:
    """Before an update of several states steps any (a partition's parts, a
    ``fo.TorchOptimizer``'s groups; ``parts``: (state, its grads, a tree like its params)
    pairs): if a param with a grad was not landed before the forward read it (``Pending.missed``,
    :mod:`functional_offload.optimizers.forms.delayed`), land every step in flight, so that each
    state is whole and usable, and raise :func:`missed_landing` naming the params
    (``name(part index, path)``)."""
    missed = [name(n, path) for n, (state, grads) in enumerate(parts)
              for s in terminal_states(state) if s.params.pending is not None
              for path in s.params.pending.missed(flatten_like(grads, s.params.tree, "grads"))]
    if missed:
        for state, _ in parts:
            for s in terminal_states(state):
                if s.params.pending is not None:
                    s.params.pending.land()
        raise missed_landing(missed)


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
    after_load(state)  # loaded into a failed state in place (DCP): its params now
    for s in terminal_states(state):
        if s.params.pending is not None:
            s.params.pending.land()
    return state


def land(state: OptState, params: Any) -> OptState:
    """Land the new values of ``params`` from the update in flight in ``state`` before the rest
    of it: wait (on the host) until its host step has copied them up, copy them over the params
    and order the caller's stream after those copies. For a delayed update without a look-ahead
    (``delayed=fo.Delay(lookahead=False)``), called as a forward reaches each module (e.g. by
    :func:`~functional_offload.land_before_forward`), this makes the forward read the exact new
    params while the host step still runs on later leaves: the results equal those of the same
    optimizer without ``delayed``, bit for bit. ``params``: a tensor, a module (its params) or
    a tree of tensors; a tensor is the param sharing its memory (the param itself, its
    ``.data``...). Params of no leaf of the update in flight are ignored; a state with nothing
    in flight is left as it is. Once a step's params have been landed so, the next update
    raises (after landing the rest) if a param with a grad was not: the forward read it before
    it landed. A failed host step raises here and marks the state failed, as :func:`flush`;
    anything but an optimizer's state raises ``TypeError``. Returns ``state``.
    """
    check_usable(state, "land")
    terminals = terminal_states(state)
    if not terminals:  # None, an optimizer, a number...: nothing would ever land, silently
        raise TypeError(f"fo.land: expected an optimizer state (what init or update returned), "
                        f"got {type(state).__name__}, which holds none")
    after_load(state)
    ps = tensors_of(params, "fo.land params")
    for s in terminals:
        if s.params.pending is not None:
            s.params.pending.land_params(ps)
    return state


def tensors_of(params: Any, what: str) -> list[torch.Tensor]:
    """The tensors of ``params``: a tensor, a module's params, or a tree's leaves (all tensors,
    else ``TypeError`` naming ``what``)."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    leaves = optree.tree_leaves(params)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
    if bad:
        raise TypeError(f"{what}: expected tensors (a tensor, a module, or a tree of tensors), "
                        f"got a {bad[0]}")
    return leaves


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
    checked (:func:`~functional_offload.tree.check_grads`; the state's cache keeps what the check
    learns of the params, for the next steps)."""
    refs = _refs_of(state)
    return check_grads(grads, refs.tree, refs.cache)


def _refs_of(state: OptState) -> ParamRefs:
    found = terminal_states(state)
    if not found:
        raise ValueError("this state holds no params: it is not the state of a terminal Optimizer")
    return found[0].params
