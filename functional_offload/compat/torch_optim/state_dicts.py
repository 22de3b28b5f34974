"""``TorchOptimizer``'s state_dict: torch.optim's format, both ways.

:func:`pack_state_dict` and :func:`unpack_state_dict` work on what ``torch.optim`` makes public
(``param_groups``, ``state``) and on the groups' functional states (:class:`.GroupStates`); the
optimizer runs torch's state-dict hooks around them.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from itertools import chain
from typing import Any, NamedTuple, Optional

import torch

from functional_offload.state import FAILED
from functional_offload.compat.torch_optim.groups import GroupStates, GroupStep
from functional_offload.compat.torch_optim.views import (Copy, Expect, Slot, apply_copies,
                                                         mark_error, param_label, quiesce,
                                                         scalar_dtype)

__all__ = ["from_earlier_format", "pack_state_dict", "unpack_state_dict"]


_EARLIER_KEYS = {"mu": "exp_avg", "nu": "exp_avg_sq", "momentum": "momentum_buffer",
                 "master": "master", "ema": "ema"}


def from_earlier_format(sd: dict[str, Any]) -> dict[str, Any]:
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


def _warn_names(where: str, mine: Any, theirs: Any) -> None:
    if mine is None or theirs is None or list(mine) == list(theirs):
        return
    at = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    warnings.warn(f"{where}the state_dict's param_names differ from this optimizer's (first at "
                  f"position {at}); state is matched by position, as torch.optim does",
                  stacklevel=5)


def pack_state_dict(states: GroupStates, param_groups: list[dict], opt_state: Any) -> dict[str, Any]:
    """torch.optim's format of the optimizer's groups and per-param state (see
    :meth:`~functional_offload.TorchOptimizer.state_dict`); delayed steps landed by the caller."""
    for g in param_groups:
        slot = states.slot_of(g)
        if slot is not None:
            slot.follow()
    ids: dict[int, int] = {}
    start = 0
    groups = []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params" and k not in states.algo.options}
        ids.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in ids})
        packed["params"] = [ids[id(p)] for p in g["params"]]
        start += len(packed["params"])
        groups.append(packed)
    state: dict[Any, Any] = {}
    for k, v in opt_state.items():
        if not isinstance(k, torch.Tensor):
            state[k] = v
        elif id(k) in ids:  # entries of params no longer in a group are dropped
            state[ids[id(k)]] = ({**v, "step": v["step"].clone()}
                                 if isinstance(v, dict) and isinstance(v.get("step"), torch.Tensor)
                                 else v)
    return {"state": state, "param_groups": groups}


class _Planned(NamedTuple):
    """A group of a state_dict being loaded, checked: its new values and its entries."""

    group: dict  # the optimizer's param group
    new: dict  # what the group holds after the load (its params aside)
    step: GroupStep
    entries: list[Optional[dict]]  # per param, its state_dict entry (``None``: none)


class _Staged(NamedTuple):
    """A planned group with the state its values go into (``None``: it has none) and the copies."""

    planned: _Planned
    state: Any
    keys: Optional[list]
    copies: Optional[list[Copy]]
    count: Optional[int]


def unpack_state_dict(states: GroupStates, param_groups: list[dict], defaults: dict,
                      opt_state: Any, state_dict: dict[str, Any]) -> dict:
    """Load torch.optim's format (converted from the earlier one by the caller) into the
    groups and their functional states, and return the optimizer's new per-param ``state``
    (see :meth:`~functional_offload.TorchOptimizer.load_state_dict`). Everything is checked
    before anything is copied."""
    saved_groups = copy.deepcopy(state_dict["param_groups"])
    if len(param_groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(param_groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                         "size of optimizer's group")
    saved_state = state_dict["state"]
    for i, g in enumerate(param_groups):  # a failed state is what the load recovers
        slot = states.slot_of(g)
        if slot is not None and slot.state is not None and int(slot.state.count) != FAILED:
            err = mark_error(slot.state, f"param group {i}: ", "load into it")
            if err is not None:
                raise err
    expect = states.algo.expect()
    # 1. the per-param states' keys (another algorithm's state is named as such), then the
    # groups' new values, checked
    planned = [_plan(states, i, g, s, saved_state, defaults, expect)
               for i, (g, s) in enumerate(zip(param_groups, saved_groups))]
    # 2. every value checked against the state it goes into (laid out now where needed)
    staged = [_stage(states, p, expect) for p in planned]
    # 3. copy, then show
    owned = set(chain.from_iterable(s["params"] for s in saved_groups))
    new_state: defaultdict = defaultdict(dict)
    for k, v in saved_state.items():
        if k not in owned:
            new_state[k] = v
    for st in staged:
        _install(states, st, opt_state, new_state)
    return new_state


def _plan(states: GroupStates, i: int, g: dict, s: dict, saved_state: dict, defaults: dict,
          expect: Expect) -> _Planned:
    """Group ``i``'s saved group ``s`` and its entries, checked against the algorithm."""
    where = f"param group {i}: "
    new = {k: v for k, v in g.items() if k != "params"}
    _warn_names(where, g.get("param_names"), s.get("param_names"))
    new.update({k: v for k, v in s.items() if k != "params" and k not in states.algo.options})
    entries = [saved_state.get(k) for k in s["params"]]
    entries = [dict(e) if isinstance(e, dict) and e else None for e in entries]
    for j, e in enumerate(entries):
        if e:
            expect.check(e, param_label(where, j, new.get("param_names")))
    states.algo.on_load(new)
    step = states.step_for(i, g, states.values(new, defaults), states.options(new))
    return _Planned(g, new, step, entries)


def _stage(states: GroupStates, p: _Planned, expect: Expect) -> _Staged:
    """The state a planned group's values go into, and the copies that put them there."""
    slot, params = p.step.slot, list(p.group["params"])
    if slot.state is None and not any(p.entries):
        return _Staged(p, None, None, None, None)
    if slot.state is not None and states.compatible(slot, params, p.step):
        state, keys = slot.state, slot.keys
    else:
        state, keys = states.lay_out(p.step, params, group=p.new)
    copies, count = Slot.copies_for(state, keys, params, p.entries, reset=True,
                                    resync_masters=True, where=p.step.where,
                                    names=p.new.get("param_names"), expect=expect)
    return _Staged(p, state, keys, copies, count)


def _install(states: GroupStates, st: _Staged, opt_state: Any, new_state: dict) -> None:
    """Copy a staged group's values into its state, give the group its new values and show the
    state in ``new_state``."""
    p, slot = st.planned, st.planned.step.slot
    if st.state is not None:
        if slot.state is not None:
            quiesce(slot.state, dropping=True)
        apply_copies(st.state, st.copies, st.count)
    params = p.group["params"]
    p.group.clear()
    p.group.update(p.new)
    p.group["params"] = params
    if st.state is None:
        slot.state = None
        return
    slot.install(st.state, st.keys, params, states.fixed(p.step.options))
    for q in params:  # reuse the dicts users may hold
        if isinstance(opt_state.get(q), dict):
            new_state[q] = opt_state[q]
    slot.write_views(new_state, p.entries)
