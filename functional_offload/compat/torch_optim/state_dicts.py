"""``TorchOptimizer``'s state_dict: torch.optim's format, both ways (a mixin of the class)."""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from itertools import chain
from typing import Any, Optional

import torch

from functional_offload.base import FAILED, Optimizer
from functional_offload.compat.torch_optim.views import (Slot, mark_error, param_label, quiesce,
                                                         scalar_dtype)

__all__ = ["Run", "StateDicts", "apply_copies"]


class Run:
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


_EARLIER_KEYS = {"mu": "exp_avg", "nu": "exp_avg_sq", "momentum": "momentum_buffer",
                 "master": "master", "ema": "ema"}


def _from_earlier_format(sd: dict[str, Any]) -> dict[str, Any]:
    """A state_dict of the first TorchOptimizer (groups' ``params`` were names, ``state`` the
    functional state's dotted paths: ``"0.count"``, ``"0.mu.<name>"``) in torch's format;
    others are returned as they are."""
    groups = sd.get("param_groups", [])
    if not any(isinstance(x, str) for g in groups for x in g.get("params", [])):
        return sd
    old, state, new_groups, start = sd.get("state", {}), {}, [], 0
    for i, g in enumerate(groups):
        names = [str(n) for n in g["params"]]
        ids = list(range(start, start + len(names)))
        start += len(names)
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = ids
        if names != [str(j) for j in range(len(names))]:  # unnamed params were named "0", "1"...
            group["param_names"] = names
        count = old.get(f"{i}.count")
        for pid, name in zip(ids, names):
            entry = {"step": torch.tensor(float(count), dtype=scalar_dtype())} if count is not None else {}
            for field, key in _EARLIER_KEYS.items():
                if f"{i}.{field}.{name}" in old:
                    entry[key] = old[f"{i}.{field}.{name}"]
            state[pid] = entry
        new_groups.append(group)
    return {**sd, "state": state, "param_groups": new_groups}


def apply_copies(state: Any, copies: list, count: Optional[int]) -> None:
    """Run the copies :meth:`Slot.copies_for` made and set the count (``None``: keep it)."""
    with torch.no_grad():
        for c in copies:
            c.run()
        if count is not None:
            state.count.fill_(count)


def _warn_names(where: str, mine: Any, theirs: Any) -> None:
    if mine is None or theirs is None or list(mine) == list(theirs):
        return
    at = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    warnings.warn(f"{where}the state_dict's param_names differ from this optimizer's (first at "
                  f"position {at}); state is matched by position, as torch.optim does",
                  stacklevel=3)


class StateDicts:
    """``state_dict`` / ``load_state_dict`` of :class:`~functional_offload.TorchOptimizer`."""

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format: ``{"state": {id: {...}}, "param_groups": [...]}``, ids being
        positions over all groups, names in ``param_names``; the layout options (placement,
        dtypes…) are the optimizer's construction, not its state, and are left out. ``step`` is
        a tensor per param (torch's optimizers add to it in place). Runs torch's state-dict
        hooks; lands delayed steps first."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._check_marks("take a state_dict")
        self.flush()
        for g in self.param_groups:
            slot = self._slots.get(id(g))
            if slot is not None:
                slot.follow()
        ids: dict[int, int] = {}
        start = 0
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params" and k not in self._algo.options}
            ids.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in ids})
            packed["params"] = [ids[id(p)] for p in g["params"]]
            start += len(packed["params"])
            groups.append(packed)
        state: dict[Any, Any] = {}
        for k, v in self.state.items():
            if not isinstance(k, torch.Tensor):
                state[k] = v
            elif id(k) in ids:  # entries of params no longer in a group are dropped
                state[ids[id(k)]] = ({**v, "step": v["step"].clone()}
                                     if isinstance(v, dict) and isinstance(v.get("step"), torch.Tensor)
                                     else v)
        sd = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.optim's format (this adapter's, or torch's class of the same algorithm).

        Params are matched by position, as torch does (names are kept, not used); state_dicts
        of the first TorchOptimizer (params by name) are converted. Everything is checked —
        group sizes, each param's state keys (those the algorithm reads, and none of another
        algorithm's), option values, every tensor's shape — before anything is copied. The
        values are copied into the functional state (keeping its placement); masters not in
        the state_dict are set from the params. A failed state is recovered; a delayed step
        in flight is dropped; a state in another thread's step is refused
        (:class:`~functional_offload.StateError`). Runs torch's load-state-dict hooks.
        """
        state_dict = _from_earlier_format(state_dict.copy())
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                             "size of optimizer's group")
        saved_state = state_dict["state"]
        owned = set(chain.from_iterable(s["params"] for s in saved_groups))
        for i, g in enumerate(groups):  # a failed state is what the load recovers
            slot = self._slots.get(id(g))
            if slot is not None and slot.state is not None and int(slot.state.count) != FAILED:
                err = mark_error(slot.state, f"param group {i}: ", "load into it")
                if err is not None:
                    raise err
        # 1. the per-param states' keys (another algorithm's state is named as such), then the
        # groups' new values, checked
        expect = self._algo.expect()
        plans = []
        for i, (g, s) in enumerate(zip(groups, saved_groups)):
            where = f"param group {i}: "
            new = {k: v for k, v in g.items() if k != "params"}
            _warn_names(where, g.get("param_names"), s.get("param_names"))
            new.update({k: v for k, v in s.items() if k != "params" and k not in self._algo.options})
            entries = [saved_state.get(k) for k in s["params"]]
            entries = [dict(e) if isinstance(e, dict) and e else None for e in entries]
            for j, e in enumerate(entries):
                if e:
                    expect.check(e, param_label(where, j, new.get("param_names")))
            self._algo.on_load(new)
            values, options = self._values(new), self._options(new)
            opt, moments = self._compile(values, options, where)
            run = Run(i, self._slot(g), opt, values, options, moments)
            plans.append((g, new, run, list(g["params"]), entries))
        # 2. every value checked against the state it goes into (laid out now where needed)
        staged = []
        for g, new, run, params, entries in plans:
            slot = run.slot
            if slot.state is None and not any(entries):
                staged.append((g, new, run, None, None, None, None, entries))
                continue
            if slot.state is not None and self._compatible(slot, params, run):
                state, keys = slot.state, slot.keys
            else:
                state, keys = self._lay_out(run, params, group=new)
            copies, count = Slot.copies_for(state, keys, params, entries, reset=True, resync_masters=True,
                                      where=run.where, names=new.get("param_names"),
                                      expect=expect)
            staged.append((g, new, run, state, keys, copies, count, entries))
        # 3. copy, then show
        new_state: defaultdict = defaultdict(dict)
        for k, v in saved_state.items():
            if k not in owned:
                new_state[k] = v
        for g, new, run, state, keys, copies, count, entries in staged:
            slot = run.slot
            if state is not None:
                if slot.state is not None:
                    quiesce(slot.state, dropping=True)
                apply_copies(state, copies, count)
            params = g["params"]
            g.clear()
            g.update(new)
            g["params"] = params
            if state is None:
                slot.state = None
                continue
            slot.install(state, keys, params, self._fixed(run.options))
            old = self.state
            for p in params:  # reuse the dicts users may hold
                if isinstance(old.get(p), dict):
                    new_state[p] = old[p]
            slot.write_views(new_state, entries)
        self.state = new_state
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
