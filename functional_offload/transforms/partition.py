"""Different transformations for different leaves, chosen by label (optax's ``partition``)."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Mapping, NamedTuple, Union

import optree
import torch

from functional_offload.base import (EmptyState, GradientTransformation, Optimizer, ParamRefs,
                                     Step, StepBase)
from functional_offload.combine import begin_step, merge_grads
from functional_offload.executor.shield import shielded
from functional_offload.state import (CONSUMED, FAILED, check_usable, mark_torn, params_of,
                                      refuse_missed_landings, terminal_counts, terminal_states)
from functional_offload.tree import (check_grads, check_unique_paths, insertion_order,
                                     leaves_with_paths, paths_of)
from functional_offload.typing import OptState, Params, Updates

__all__ = ["PartitionRefs", "PartitionState", "partition"]

AnyT = Union[Optimizer, GradientTransformation]
Labels = Union[Any, Callable[[Params], Any]]


class PartitionRefs(NamedTuple):
    """The whole params tree of a :func:`partition` of optimizers, and its step count.

    It is what makes the partition's state a terminal state: :func:`~functional_offload.params_of`,
    :func:`~functional_offload.stream` and the consumption checks see the whole tree here (each
    part's state holds only its own leaves).
    """

    count: torch.Tensor  # int64 0-d (CPU): updates applied, or a mark (consumed, failed)
    params: ParamRefs  # the whole params tree (not checkpointed)


class PartitionState(NamedTuple):
    """State of :func:`partition`."""

    refs: Any  # PartitionRefs (a partition of optimizers) or EmptyState() (of transformations)
    inner_states: dict[str, OptState]  # label -> the state of that label's transformation


def partition(transforms: Mapping[str, AnyT], labels: Labels) -> AnyT:
    r"""Apply a different transformation (optimizer, placement...) to each labelled part of the
    params.

    ``labels`` gives each leaf a label, a key of ``transforms``. With :math:`P_\ell` the leaves
    labelled :math:`\ell` and :math:`T_\ell` its transformation:

    .. math:: \text{update}(g)\big|_{P_\ell} = T_\ell.\text{update}\big(g|_{P_\ell}\big)
              \quad \text{for each label } \ell

    Each :math:`T_\ell` sees only its leaves, as a dict ``{dotted path: leaf}`` in the params'
    order (``{"layer1.weight": ...}``): a norm it computes (clipping) is over those leaves, and
    its placement decides among them. The state is a :class:`PartitionState` holding each
    part's state under its label.

    When every transformation is an :class:`~functional_offload.Optimizer`, so is the result:
    ``update`` returns the whole params tree, and the state is consumed by it (use the one it
    returns). Every grad is checked before any part steps; then the parts' steps run
    concurrently, each in a thread of its own (parts sharing an executor take turns on it). A
    step that fails after a part was applied marks the state failed (load a checkpoint into
    it; where that part changed params in place that it keeps no master of, fp32 params say,
    the load names them: restore them from the model's checkpoint and load into a new state,
    as after any failed step); an interrupt (Ctrl-C) lets every part complete, then is raised
    (the state passed in then holds the step). :func:`~functional_offload.plan` shows every
    part's placement, and :func:`~functional_offload.stream` streams every part: a leaf's grad
    goes to its part's step as soon as it arrives.

    Args:
      transforms: ``{label: transformation}``, all optimizers or all gradient transformations.
      labels: a tree of ``str`` mirroring the params, or a function ``params -> labels``
        (called on the params at ``init``; for gradient transformations, on the grads at each
        update, as :func:`~functional_offload.masked` does).

    Returns:
      An :class:`~functional_offload.Optimizer` (or a
      :class:`~functional_offload.GradientTransformation`) whose state is a
      :class:`PartitionState`.

    Example — no weight decay for biases, their state on the device::

        >>> import torch, functional_offload as fo
        >>> opt = fo.partition(
        ...     {"decay": fo.adamw(0.1, weight_decay=0.5),
        ...      "no_decay": fo.adamw(0.1, weight_decay=0.0,
        ...                           placement=fo.placement.on_device())},
        ...     lambda p: {k: "decay" if v.ndim > 1 else "no_decay" for k, v in p.items()})
        >>> state = opt.init({"w": torch.ones(2, 2), "b": torch.ones(2)})
        >>> params, state = opt.update({"w": torch.zeros(2, 2), "b": torch.zeros(2)}, state)
        >>> params["w"][0], params["b"]
        (tensor([0.9500, 0.9500]), tensor([1., 1.]))
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError("partition takes a non-empty dict {label: transformation}")
    for label, t in transforms.items():
        if not isinstance(label, str):
            raise TypeError(f"partition labels must be str; got the key {label!r}")
        if not isinstance(t, (Optimizer, GradientTransformation)):
            raise TypeError(f"partition: transforms[{label!r}] is a {type(t).__name__}, expected "
                            "an Optimizer or a GradientTransformation")
    opts = [k for k, t in transforms.items() if isinstance(t, Optimizer)]
    if opts and len(opts) != len(transforms):
        others = [k for k in transforms if k not in opts]
        raise TypeError(f"partition mixes optimizers {opts} and gradient transformations "
                        f"{others}: the leaves of the latter would never be updated; chain each "
                        "transformation in front of an optimizer (fo.chain(t, fo.adamw(...)))")
    transforms = dict(transforms)

    def init(params: Params) -> PartitionState:
        return _init(transforms, labels, params, bool(opts))

    def update_grads(updates: Updates, state: PartitionState) -> tuple[Updates, PartitionState]:
        _check(transforms, state)
        paths, leaves, names, spec = _resolve(transforms, labels, updates)
        out, news = list(leaves), {}
        for label, t in transforms.items():
            mine = [i for i, name in enumerate(names) if name == label]
            part = {paths[i]: leaves[i] for i in mine}
            sub, news[label] = t.update(part, state.inner_states[label])
            for i in mine:
                out[i] = sub[paths[i]]
        return optree.tree_unflatten(spec, out), PartitionState(state.refs, news)

    if not opts:
        return GradientTransformation(init, update_grads)

    def begin(state: PartitionState, speculative: bool = False) -> Step:
        _check(transforms, state)
        check_usable(state, "update")
        counts = {label: terminal_counts(s) for label, s in state.inner_states.items()}
        return _Partitioned(_begin_parts(transforms, state, speculative), state, counts)

    def update(grads: Updates, state: PartitionState) -> tuple[Params, PartitionState]:
        return begin(state).finish(grads)

    return Optimizer(init, update, begin)


def _resolve(transforms: dict[str, AnyT], labels: Labels,
             tree: Any) -> tuple[tuple[str, ...], list[Any], list[str], optree.PyTreeSpec]:
    """``(paths, leaves, labels, spec)`` of ``tree`` (params or grads; ``None`` kept)."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    paths = paths_of(spec)
    check_unique_paths(paths, "params", "partition names each part's leaves by their path")
    names = labels(tree) if callable(labels) else labels
    try:
        flat = spec.flatten_up_to(names)
    except (ValueError, TypeError):
        raise ValueError(_mismatch(names, paths)) from None
    for path, name in zip(paths, flat):
        if not isinstance(name, str):
            raise TypeError(f"the label of leaf {path!r} is {name!r}; each leaf's label must "
                            f"be a str, one of {list(transforms)}")
        if name not in transforms:
            raise ValueError(f"leaf {path!r} has the label {name!r}, which has no "
                             f"transformation (the labels are {list(transforms)}); add "
                             f"{name!r} to the dict or fix the labels")
    return paths, leaves, flat, spec


def _init(transforms: dict[str, AnyT], labels: Labels, params: Params,
          terminal: bool) -> PartitionState:
    """The partition's state: each part's ``init`` on its leaves (``{path: leaf}``)."""
    paths, leaves, names, _ = _resolve(transforms, labels, params)
    for path, x in zip(paths, leaves):
        if x is None:
            raise TypeError(f"params leaf {path!r} is None; partition needs a tensor at every "
                            "leaf (leave frozen tensors out of the params tree)")
    order = insertion_order(params)  # each part sees its leaves in the model's order
    inner = {}
    for label, t in transforms.items():
        mine = [i for i in order if names[i] == label]
        if not mine:
            raise ValueError(f"the label {label!r} has a transformation but no leaf of the "
                             f"params is labelled {label!r}; label some leaves {label!r} or "
                             "leave it out of the dict")
        inner[label] = t.init({paths[i]: leaves[i] for i in mine})
    refs = (PartitionRefs(torch.zeros((), dtype=torch.int64), ParamRefs(params)) if terminal
            else EmptyState())
    return PartitionState(refs, inner)


def _check(transforms: dict[str, AnyT], state: Any) -> None:
    if not isinstance(state, PartitionState) or not isinstance(state.inner_states, dict):
        raise TypeError(f"partition expects its PartitionState, got {type(state).__name__}")
    if sorted(state.inner_states) != sorted(transforms):
        raise ValueError(f"this PartitionState holds the labels {sorted(state.inner_states)}, "
                         f"the partition has {sorted(transforms)}; pass the state its init "
                         "made")


def _begin_parts(transforms: dict[str, Optimizer], state: PartitionState,
                 speculative: bool) -> dict[str, Step]:
    """Each part's step (if one cannot begin, those begun are aborted)."""
    steps: dict[str, Step] = {}
    try:
        for label, t in transforms.items():
            steps[label] = begin_step(t, state.inner_states[label], speculative)
    except BaseException:
        for step in steps.values():
            step.abort()
        raise
    return steps


def _mismatch(names: Any, paths: tuple[str, ...]) -> str:
    """Why a labels tree does not fit the params (their paths ``paths``)."""
    try:
        got = set(paths_of(optree.tree_structure(names, none_is_leaf=True)))
    except Exception:  # noqa: BLE001 - not a tree optree knows
        return f"labels is a {type(names).__name__}, not a tree of str like the params"
    unlabelled, extra = sorted(set(paths) - got), sorted(got - set(paths))
    parts = (([f"params leaves without a label {_some(unlabelled)}"] if unlabelled else [])
             + ([f"labels of no param {_some(extra)}"] if extra else []))
    what = "; ".join(parts) or "the same paths in other containers (a list where the params have " \
        "a tuple?)"
    return (f"the labels tree does not match the params ({len(paths)} leaves): {what}. Give one "
            "label (a str) per leaf with the params' keys and nesting, or a function params -> "
            "labels")


def _some(paths: list[str], n: int = 5) -> str:
    """``paths`` for a message: the first ``n`` of them, and how many there are."""
    more = f" and {len(paths) - n} more ({len(paths)} in all)" if len(paths) > n else ""
    return f"{paths[:n]}{more}"


def _caller_context(tensors: list[Any]) -> Callable[[contextlib.ExitStack], None]:
    """What a thread needs to act as the caller's: its grad mode, and on CUDA its current device
    and its current stream on each device of ``tensors``."""
    grad = torch.is_grad_enabled()
    streams = [torch.cuda.current_stream(d) for d in
               {t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}]
    device = torch.cuda.current_device() if streams else None

    def enter(stack: contextlib.ExitStack) -> None:
        stack.enter_context(torch.set_grad_enabled(grad))
        for stream in streams:
            stack.enter_context(torch.cuda.stream(stream))
        if device is not None:
            stack.enter_context(torch.cuda.device(device))

    return enter


def _concurrently(calls: dict[str, Callable[[], Any]],
                  context: Callable[[contextlib.ExitStack], None]) -> dict[str, tuple[bool, Any]]:
    """Run each call in a thread of its own, in the caller's ``context``; ``{label: (True,
    result) or (False, exception)}``. The parts' steps finish (or abort) concurrently because a
    step that ran ahead holds its executor's ring until it ends: parts sharing an executor would
    wait for each other in any fixed order."""
    results: dict[str, tuple[bool, Any]] = {}

    def run(label: str, call: Callable[[], Any]) -> None:
        try:
            with contextlib.ExitStack() as stack:
                context(stack)
                results[label] = (True, call())
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            results[label] = (False, e)

    threads = [threading.Thread(target=run, args=item, name=f"fo-partition-{item[0]}")
               for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {label: results[label] for label in calls}


def _torn(count: torch.Tensor, others: list[tuple[OptState, set[str]]]) -> None:
    """A part's delayed step failed after the partition's update returned: the other parts
    applied that update (their params changed in place), so the partition's state is torn —
    each other part marked failed with the params it changed, the partition's count too — and
    a checkpoint loaded into it refuses what it cannot put back, as a failure within the update
    does."""
    for s, paths in others:
        if all(c >= 0 for c in terminal_counts(s)):  # (in a step now: its finish marks it)
            mark_torn(s, paths)
    if int(count) >= 0:
        count.fill_(FAILED)


class _Partitioned(StepBase):
    """A partition's step: each part's step, fed the leaves of its part (indices mapped from the
    whole tree's flatten order to the part's own)."""

    def __init__(self, steps: dict[str, Step], state: PartitionState,
                 counts: dict[str, list[int]]):  # counts: each part's terminal counts at begin
        self.steps, self.state, self.counts = steps, state, counts
        self.n = int(state.refs.count)
        self.params = state.refs.params.tree
        self.paths, _, self.spec = leaves_with_paths(self.params)
        at = {p: i for i, p in enumerate(self.paths)}
        # part label -> whole-tree index of each of its leaves, in the part's flatten order
        self.parts = {label: [at[p] for p in leaves_with_paths(params_of(s))[0]]
                      for label, s in state.inner_states.items()}
        self.route = {i: (label, j) for label, idx in self.parts.items() for j, i in enumerate(idx)}
        self.fed: dict[int, torch.Tensor] = {}
        self.delayed = any(s.delayed for s in steps.values())
        self.finished = False

    def feed(self, index: int, grad: torch.Tensor) -> None:
        label, j = self.route[index]
        self.steps[label].feed(j, grad)
        self.fed[index] = grad

    def finish(self, grads: Updates = None) -> tuple[Params, PartitionState]:
        if self.finished:
            raise RuntimeError("this step already finished; begin a new one for each update")
        self.finished = True
        try:  # every grad is checked before any part changes anything
            full = merge_grads(self.spec, self.fed, grads)
            check_grads(full, self.params)
            flat = self.spec.flatten_up_to(full)
        except BaseException:
            self.abort()
            raise
        part_grads = {label: {self.paths[i]: flat[i] for i in self.parts[label]}
                      for label in self.steps}
        try:  # a missed landing is refused before any part steps
            refuse_missed_landings([(self.state.inner_states[label], g)
                                    for label, g in part_grads.items()])
        except BaseException:
            self.abort()
            raise
        calls = {label: functools.partial(step.finish, part_grads[label])
                 for label, step in self.steps.items()}
        results, interrupt = shielded(_concurrently, calls, _caller_context(flat))
        done = {label: r for label, (ok, r) in results.items() if ok}
        errors = [r for ok, r in results.values() if not ok]
        news = {label: s for label, (_, s) in done.items()}
        if errors:
            moved = [k for k, c in self.counts.items() if terminal_counts(self.state.inner_states[k]) != c]
            if news or moved:
                self.state.inner_states.update(news)  # torn: loading a checkpoint into it recovers
                for label, s in news.items():  # (but params it keeps no master of)
                    mark_torn(s, {self.paths[i] for i in self.parts[label] if flat[i] is not None})
                self.state.refs.count.fill_(FAILED)
                errors[0].add_note(f"fo.partition: the parts {sorted(set(news) | set(moved))} "
                                   "had changed their state, so the partition's state is marked "
                                   "failed (torn); load a checkpoint into it")
            if interrupt is not None:
                raise interrupt from errors[0]
            raise errors[0]
        whole = optree.tree_unflatten(
            self.spec, [done[self.route[i][0]][0][p] for i, p in enumerate(self.paths)])
        if interrupt is not None:  # every part completed: the state passed in holds the step
            self.state.inner_states.update(news)
            self.state.refs.count.fill_(self.n + 1)
            raise interrupt
        new = PartitionState(PartitionRefs(torch.tensor(self.n + 1, dtype=torch.int64),
                                           ParamRefs(whole)), news)
        changed = {label: {self.paths[i] for i in self.parts[label] if flat[i] is not None}
                   for label in news}
        for label, s in news.items():  # a part's delayed step that fails later tears the update
            for t in terminal_states(s):
                if t.params.pending is not None:
                    t.params.pending.on_failure(functools.partial(
                        _torn, new.refs.count, [(news[k], changed[k]) for k in news if k != label]))
        self.state.refs.count.fill_(CONSUMED)
        return whole, new

    def close(self) -> None:
        for step in self.steps.values():
            step.close()

    def abort(self) -> None:
        self.finished = True
        results, interrupt = shielded(_concurrently, {k: s.abort for k, s in self.steps.items()},
                                      _caller_context([]))  # concurrently, as finish
        for ok, error in results.values():
            if not ok:
                raise error
        if interrupt is not None:
            raise interrupt
