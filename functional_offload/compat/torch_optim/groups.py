"""The functional states of a :class:`~functional_offload.TorchOptimizer`'s param groups.

:class:`GroupStates` keeps one :class:`~.views.Slot` per param group and turns a group's values
into the functional optimizer of one step (:class:`GroupStep`). It lays a group's state out at
its first step (or load), and again when the group changed; it takes values written into
``optimizer.state`` into the state before the state is used. It sees of the optimizer only what
``torch.optim`` makes public: ``defaults``, ``param_groups`` and ``state``, handed in per call.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from functional_offload.base import Optimizer, ParamRefs
from functional_offload.compat.torch_optim.algorithms import FREE_OPTIONS, Algorithm, check_options
from functional_offload.compat.torch_optim.views import (Slot, apply_copies, mark_error, quiesce,
                                                         signature, tree_of)

__all__ = ["GroupStep", "GroupStates", "entries_of"]


class GroupStep:
    """One group's part of a step: its slot, its functional optimizer for this step, the
    moment fields the step uses (``None``: all) and, later, its grads."""

    __slots__ = ("index", "slot", "opt", "values", "options", "moments", "grads")

    def __init__(self, index: int, slot: Slot, opt: Optimizer, values: dict, options: dict,
                 moments: Optional[frozenset]):
        self.index, self.slot, self.opt, self.values = index, slot, opt, values
        self.options, self.moments, self.grads = options, moments, None

    @property
    def where(self) -> str:
        return f"param group {self.index}: "


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - objects without a plain equality are compared by identity
        return False


def entries_of(opt_state: Any, params: list) -> list[Optional[dict]]:
    """Snapshots of the params' dicts in ``opt_state`` (``None`` where a param has none)."""
    out = []
    for p in params:
        e = opt_state.get(p) if hasattr(opt_state, "get") else None
        out.append(dict(e) if isinstance(e, dict) and e else None)
    return out


class GroupStates:
    """The slots of an optimizer's param groups (by group), and the algorithm that makes their
    steps."""

    def __init__(self, algo: Algorithm):
        self.algo = algo
        self._slots: dict[int, Slot] = {}

    # ---- groups and their values ------------------------------------------------------------
    def values(self, group: dict, defaults: dict) -> dict[str, Any]:
        """The group's hyperparameters and flags (``defaults``' where the group lacks one)."""
        return {k: group[k] if k in group else defaults.get(k, v)
                for k, v in self.algo.defaults.items()}

    def options(self, group: dict) -> dict[str, Any]:
        """The group's keyword options of the functional constructor."""
        return {k: group[k] for k in self.algo.options if k in group}

    def fixed(self, options: dict) -> dict:
        """The options that decide the state's layout."""
        return {k: v for k, v in options.items() if k not in FREE_OPTIONS}

    def compile(self, values: dict, options: dict,
                where: str) -> tuple[Optimizer, Optional[frozenset]]:
        """Check a group's values and build this step's functional optimizer from them."""
        try:
            self.algo.check(values)
            check_options(options)
            return self.algo.build(values, options), self.algo.moments(values)
        except (ValueError, TypeError, RuntimeError) as e:
            if not where:
                raise
            try:
                err = type(e)(f"{where}{e}")
            except Exception:  # noqa: BLE001 - an exception type with another signature
                raise e from None
            raise err from None

    def step_for(self, index: int, group: dict, values: dict, options: dict) -> GroupStep:
        """Group ``index``'s step with these values and options (checked first)."""
        opt, moments = self.compile(values, options, f"param group {index}: ")
        return GroupStep(index, self.slot(group), opt, values, options, moments)

    def steps(self, param_groups: list[dict], defaults: dict) -> list[GroupStep]:
        """Check every non-empty group and build its optimizer for this step (nothing changes
        yet); slots of groups gone are dropped."""
        live = {id(g) for g in param_groups}
        for k in [k for k in self._slots if k not in live]:
            del self._slots[k]
        return [self.step_for(i, g, self.values(g, defaults), self.options(g))
                for i, g in enumerate(param_groups) if g["params"]]

    # ---- the slots --------------------------------------------------------------------------
    def slot(self, group: dict) -> Slot:
        """The group's slot, made now if it has none."""
        slot = self._slots.get(id(group))
        if slot is None or slot.group is not group:
            slot = self._slots[id(group)] = Slot(group)
        return slot

    def slot_of(self, group: dict) -> Optional[Slot]:
        """The group's slot, or ``None`` before its first step or load."""
        return self._slots.get(id(group))

    @property
    def slots(self) -> list[Slot]:
        """Every group's slot."""
        return list(self._slots.values())

    def check_marks(self, param_groups: list[dict], action: str) -> None:
        """Raise :class:`~functional_offload.StateError` if a group's state is failed or in a
        step (nothing reads or writes it then but a load)."""
        for i, g in enumerate(param_groups):
            slot = self.slot_of(g)
            if slot is not None and slot.state is not None:
                err = mark_error(slot.state, f"param group {i}: ", action)
                if err is not None:
                    raise err

    # ---- layouts ----------------------------------------------------------------------------
    def compatible(self, slot: Slot, params: list, step: GroupStep) -> bool:
        """Whether the slot's state fits the group as it is now (else it is laid out anew)."""
        fixed = self.fixed(step.options)
        return (len(params) == len(slot.params) and all(a is b for a, b in zip(params, slot.params))
                and signature(params) == slot.signature
                and fixed.keys() == slot.fixed.keys()
                and all(_same(fixed[k], slot.fixed[k]) for k in fixed)
                and (step.moments is None or step.moments <= Slot.moment_fields(slot.state)))

    def lay_out(self, step: GroupStep, params: list, group: Optional[dict] = None) -> tuple[Any, list]:
        """A new state for ``params`` (of ``group``, else the step's) and its keys by position."""
        tree, keys = tree_of(step.slot.group if group is None else group, params)
        try:
            state = step.opt.init(tree)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{step.where}{e}") from None
        if not isinstance(getattr(state, "params", None), ParamRefs) or not hasattr(state, "master"):
            raise TypeError(f"{step.where}{self.algo.name} made a {type(state).__name__} state; "
                            "TorchOptimizer needs a terminal optimizer's state (fo.adamw, fo.adam, "
                            "fo.sgd...); clip with max_grad_norm= instead of a chain")
        return state, keys

    def ready(self, step: GroupStep, opt_state: Any, action: str = "step") -> None:
        """Make the step's slot hold a usable state that shows what ``opt_state`` (the
        optimizer's ``state``) shows: lay it out at the first step or when the group changed
        (params, their devices or dtypes, layout options, moments now needed), taking in values
        written into the views."""
        slot, params = step.slot, list(step.slot.group["params"])
        if slot.state is not None:
            err = mark_error(slot.state, step.where, action)
            if err is not None:
                raise err
            slot.follow()
            if self.compatible(slot, params, step):
                if slot.edited(opt_state):
                    self._sync(step, opt_state)
                return
            quiesce(slot.state, dropping=False)
        entries = entries_of(opt_state, params)
        state, keys = self.lay_out(step, params)
        names = slot.group.get("param_names")
        copies, count = Slot.copies_for(
            state, keys, params, entries, reset=False, resync_masters=False, where=step.where,
            names=names, reshaped="was the param reshaped since its state was made? torch.optim "
            "cannot step it either: restore its shape, or drop its state (del "
            "optimizer.state[param]) to start it afresh")
        apply_copies(state, copies, count)
        slot.install(state, keys, params, self.fixed(step.options))
        slot.write_views(opt_state, entries)

    def _sync(self, step: GroupStep, opt_state: Any) -> None:
        """Take values written into the views into the state (see :mod:`.views`)."""
        slot = step.slot
        entries = entries_of(opt_state, slot.params)
        gone = sum(e is None for e in entries)
        if 0 < gone < len(entries):
            warnings.warn(f"{step.where}{gone} params have no entry in optimizer.state any more: "
                          "their state restarts from zero, but they share the group's step count",
                          stacklevel=4)
        copies, count = Slot.copies_for(slot.state, slot.keys, slot.params, entries, reset=True,
                                        resync_masters=False, where=step.where,
                                        names=slot.group.get("param_names"))
        quiesce(slot.state, dropping=False)
        apply_copies(slot.state, copies, count)
        slot.write_views(opt_state, entries)
