"""One param group's functional state and ``torch.optim``'s per-param view of it.

``optimizer.state[p]`` is a dict whose entries are the functional state's own leaves under
torch's names (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), ``step`` (a float tensor
shared by the group's params, holding the state's one count), ``master`` where the param is low
precision and ``ema`` with ``ema_decay``. Keys the layout does not use (``max_exp_avg_sq`` from a
torch checkpoint, a user's own) stay in the dict untouched, as torch keeps them.

Values written into the views are taken into the functional state before it is used: a tensor
put in place of a leaf (or a new ``step``) is copied into the leaf, a deleted entry restarts
that param's state. The same copy loads a state_dict. Everything is checked before anything is
copied, so a bad value changes nothing.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple, Optional, Sequence

import torch

from functional_offload.base import StateError
from functional_offload.state import BUSY, CONSUMED, FAILED, flush
from functional_offload.checks import real
from functional_offload.optimizers.spec import torch_state_names
from functional_offload.quantized import is_quantized
from functional_offload.tree import flatten_like, local

__all__ = ["Slot", "Copy", "Expect", "apply_copies", "param_label", "scalar_dtype", "tree_of",
           "signature", "quiesce", "mark_error"]

STEP, MASTER, EMA = "step", "master", "ema"
_ZERO = object()  # a Copy source: fill with zeros


class Adopt(NamedTuple):
    """A Copy source: the param's value, taken at the state's first use after the load (a step,
    a flush, a save), not at the load, so that the model's own checkpoint may be loaded after
    the optimizer's (as ``fo.load`` notes masters a checkpoint lacks)."""

    param: torch.Tensor


def scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives ``step`` (float32, or float64 under a float64 default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def tree_of(group: dict, params: list) -> tuple[Any, list]:
    """The params tree of a group's functional state and its keys by position: a dict by name
    for a group with unique names (errors then name the param), else a list."""
    names = group.get("param_names")
    if (isinstance(names, (list, tuple)) and len(names) == len(params)
            and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)):
        return dict(zip(names, params)), list(names)
    return list(params), list(range(len(params)))


def signature(params: list) -> tuple:
    return tuple((p.device, p.dtype, tuple(p.shape)) for p in params)


def quiesce(state: Any, dropping: bool) -> None:
    """Finish a delayed step in flight before the state is written: land it (``flush``), or,
    when the state is about to be overwritten by a load, wait for it and drop its result."""
    pending = state.params.pending
    if pending is None:
        return
    if dropping:
        pending.settle()
    else:
        flush(state)


def mark_error(state: Any, where: str, action: str) -> Optional[StateError]:
    """A :class:`StateError` saying what to do if ``state`` holds a mark, else ``None``."""
    n = int(state.count)
    if n == FAILED:
        return StateError(f"{where}cannot {action}: the last step of this group failed part-way "
                          "(see that error), so its params and state are inconsistent; load a "
                          "checkpoint with optimizer.load_state_dict(...) to continue")
    if n in (CONSUMED, BUSY):
        return StateError(f"{where}cannot {action}: the functional state is in use by another "
                          "step (another thread, or a fo.stream block not finished)")
    return None


class Expect(NamedTuple):
    """What a loaded per-param entry of an algorithm's state must hold, and must not."""

    name: str  # the algorithm, for messages
    step: bool  # a step (torch's class reads one)
    moments: bool  # every moment the layout gives the param (torch's class reads them)
    needed: tuple  # the moments every param has, known before a layout
    foreign: frozenset  # other algorithms' keys: one of them says that another one saved it

    def check(self, e: dict, label: str, moments: Sequence[str] = ()) -> None:
        """Raise ``ValueError`` naming the param and the keys if entry ``e`` lacks what the
        algorithm reads or holds another algorithm's state; ``moments``: the layout's."""
        want = dict.fromkeys([*self.needed, *(moments if self.moments else ())])
        missing = [k for k in want if k not in e] + ([STEP] if self.step and STEP not in e else [])
        foreign = sorted(k for k in e if k in self.foreign)
        parts = [f"state {_listed(missing)} missing"] if missing else []
        if foreign:
            parts.append(f"state {_listed(foreign)} another algorithm's, not {self.name}'s")
        if parts:
            fails = "; its next step would fail" if missing else ""
            raise ValueError(f"{label}: {' and '.join(parts)} (the param has state "
                             f"{sorted(map(str, e))}){fails}: was the state_dict saved by another "
                             "optimizer, or with other options? Load it into the optimizer that "
                             "saved it")


def param_label(where: str, j: int, names: Optional[list]) -> str:
    """``"param group 0: param 1 ('bias')"``, as errors name a param."""
    return f"{where}param {j}" + (f" ({names[j]!r})" if names and j < len(names) else "")


class Copy:
    """One value to write into a leaf: a tensor (cast to the leaf's dtype and device), zeros,
    or a param's value."""

    __slots__ = ("dst", "src")

    def __init__(self, dst: torch.Tensor, src: Any):
        self.dst, self.src = dst, src

    def run(self) -> None:
        if self.src is _ZERO:
            self.dst.zero_()
        elif self.src is not self.dst:
            self.dst.copy_(self.src)


def apply_copies(state: Any, copies: list[Copy], count: Optional[int]) -> None:
    """Run the copies :meth:`Slot.copies_for` made and set the count (``None``: keep it); a
    master whose source is :class:`Adopt` is noted in the state's cache to be set from its
    param at the state's first use (``StepCache.adopt_masters``), or set now where the state
    has no cache."""
    cache = state.params.cache
    adopt = [c for c in copies if isinstance(c.src, Adopt)]
    with torch.no_grad():
        for c in copies:
            if not isinstance(c.src, Adopt):
                c.run()
            elif cache is None:  # nowhere to note it: the param now
                c.dst.copy_(c.src.param)
        if count is not None:
            state.count.fill_(count)
    if adopt and cache is not None:
        masters = flatten_like(state.master, state.params.tree, "state.master")
        at = {id(m): i for i, m in enumerate(masters) if m is not None}
        cache.adopt_masters = sorted({*cache.adopt_masters, *(at[id(c.dst)] for c in adopt)})


class Slot:
    """A param group's functional state (``None`` until the first step or load) and the views
    of it in ``optimizer.state``."""

    def __init__(self, group: dict):
        self.group = group
        self.state: Any = None
        self.keys: list = []  # the params tree's keys by position
        self.params: list = []  # the params the state was laid out for
        self.signature: tuple = ()  # their (device, dtype, shape)
        self.fixed: dict = {}  # the layout options it was laid out with
        self.mirror = torch.zeros((), dtype=scalar_dtype())  # "step" in the views
        self.seen = 0.0  # the mirror's value as last written
        self.views: list[dict] = []  # per param: its dict in optimizer.state
        self.expected: list[dict] = []  # per param: {key: the object its view holds}

    # ---- the layout -----------------------------------------------------------------------
    @staticmethod
    def leaves(state: Any, keys: list, params: list, j: int) -> list[tuple[str, torch.Tensor, bool]]:
        """``(torch key, leaf, shown in the view)`` of param ``j``: moments, master, EMA. A
        moment the param does not have (Adafactor's ``variance`` of a matrix) is left out, as
        torch leaves it out. A master is shown where it holds more than the param does (a
        low-precision or quantized param); an fp32 param's host copy equals the param after every
        step and is not."""
        key, out = keys[j], []
        for field, name in torch_state_names(state).items():
            tree = getattr(state, field)
            if not (isinstance(tree, tuple) and not tree) and tree[key] is not None:
                out.append((name, tree[key], True))
        master, p = state.master[key], local(params[j])
        if master is not None:
            out.append((MASTER, master, master.dtype != p.dtype or is_quantized(p)))
        if not (isinstance(state.ema, tuple) and not state.ema):
            out.append((EMA, state.ema[key], True))
        return out

    @staticmethod
    def moment_fields(state: Any) -> frozenset:
        """The state's moment fields that hold buffers (SGD without momentum has none)."""
        return frozenset(f for f in torch_state_names(state)
                         if not (isinstance(getattr(state, f), tuple) and not getattr(state, f)))

    # ---- taking values in -----------------------------------------------------------------
    @staticmethod
    def copies_for(state: Any, keys: list, params: list, entries: list[Optional[dict]], *,
                   reset: bool, resync_masters: bool, where: str, names: Optional[list] = None,
                   expect: Optional[Expect] = None,
                   reshaped: str = "was it saved for another model, or with the params in "
                                   "another order?") -> tuple[list[Copy], Optional[int]]:
        """The copies that put ``entries`` (torch-format per-param dicts, ``None`` where a param
        has none) into ``state``, and the count to set (``None``: keep it). Raises ``ValueError``
        naming the param and key of a value that does not fit; copies nothing.

        ``reset``: leaves an entry lacks get a fresh value (zero moments, the param as master),
        as for a load. ``resync_masters``: masters not shown in the views are set from their
        params (the params are the truth after a load). ``expect``: what each entry must hold,
        for a state_dict being loaded (see :class:`Expect`). ``reshaped``: what the error for a
        value of another shape tells the user to check."""
        copies: list[Copy] = []
        steps: list[int] = []
        steps_none = False  # a param of the group has no state (step 0)
        for j, p in enumerate(params):
            e = entries[j]
            label = param_label(where, j, names)
            leaves = Slot.leaves(state, keys, params, j)
            if expect is not None and e:
                expect.check(e, label,
                             [n for n, _, shown in leaves if shown and n not in (MASTER, EMA)])
            fresh: dict[str, Any] = {}
            master_loaded = False  # the master was given the entry's value
            for name, leaf, shown in leaves:
                v = e.get(name) if (e and shown) else None
                if name == MASTER and isinstance(v, torch.Tensor) and v.dtype != leaf.dtype:
                    v = None  # not a master this layout wrote (torch casts state to the param's
                    #           dtype on load, and stops updating it): the param is the truth
                if v is None:  # (a load's master from its param: taken at first use)
                    from_param = Adopt(local(p)) if resync_masters else local(p)
                    if name == MASTER and not shown:
                        if resync_masters or (reset and not e):
                            copies.append(Copy(leaf, from_param))
                    elif reset:
                        src = (_ZERO if name not in (MASTER, EMA) else
                               from_param if name == MASTER else
                               fresh[MASTER] if master_loaded else local(p))
                        copies.append(Copy(leaf, src))
                    fresh[name] = leaf
                    continue
                if not isinstance(v, torch.Tensor):
                    raise ValueError(f"{label}: state {name!r} is a {type(v).__name__}, expected a "
                                     f"tensor of shape {tuple(leaf.shape)}")
                if tuple(v.shape) != tuple(leaf.shape):
                    raise ValueError(f"{label}: state {name!r} has shape {tuple(v.shape)} but the "
                                     f"param's state has shape {tuple(leaf.shape)}; {reshaped}")
                if not (v.dtype.is_floating_point and not v.is_meta):
                    raise ValueError(f"{label}: state {name!r} is a {v.dtype} {v.device} tensor; "
                                     "expected floating values")
                copies.append(Copy(leaf, v))
                fresh[name] = leaf
                master_loaded = master_loaded or name == MASTER
            master = e.get(MASTER) if e else None
            if (not reset and isinstance(master, torch.Tensor) and master.dtype == p.dtype
                    and master.shape == p.shape and master is not fresh.get(MASTER)):
                # a master the views showed, of a param made wider since (its dtype now): the
                # param takes its exact value, and so does the master this layout keeps (hidden)
                copies.append(Copy(local(p), master))
                if MASTER in fresh:
                    copies.append(Copy(fresh[MASTER], master))
            if e and e.get(STEP) is not None:
                steps.append(_as_step(e[STEP], label))
            elif resync_masters and not e:  # loaded with no state: torch starts it at step 1
                steps_none = True
        if steps:
            low = 0 if steps_none else min(steps)
            if low != max(steps):
                warnings.warn(f"{where}the params' steps differ ({low} to {max(steps)}); "
                              f"fo.TorchOptimizer keeps one step count per param group and "
                              f"continues from {max(steps)} (bias corrections of params that "
                              "were updated less often differ from torch.optim's)", stacklevel=4)
            return copies, max(steps)
        return copies, (0 if reset else None)

    def install(self, state: Any, keys: list, params: list, fixed: dict) -> None:
        self.state, self.keys, self.params = state, keys, list(params)
        self.signature, self.fixed = signature(self.params), dict(fixed)

    def refresh(self) -> None:
        """The views' ``step`` follows the state's count (not while the state holds a mark)."""
        n = int(self.state.count)
        if n >= 0:
            self.mirror.fill_(n)
            self.seen = self.mirror.item()

    def follow(self) -> None:
        """The views' ``step`` follows a count loaded into the state from outside the optimizer
        (``fo.load`` or DCP into ``fo_states``), unless a step was written into the views since
        (that one is taken in at the next step)."""
        if self.state is not None and self.mirror.item() == self.seen \
                and int(self.state.count) != self.seen:
            self.refresh()

    def write_views(self, opt_state: Any, entries: list[Optional[dict]]) -> None:
        """Point each param's dict in ``opt_state`` at the state's leaves; keys of ``entries``
        the layout does not use stay as they are. A param's existing dict is reused."""
        self.refresh()
        self.views, self.expected = [], []
        for j, p in enumerate(self.params):
            ours = {STEP: self.mirror}
            ours.update({name: leaf for name, leaf, shown in
                         self.leaves(self.state, self.keys, self.params, j) if shown})
            old = opt_state.get(p) if hasattr(opt_state, "get") else None
            view = old if isinstance(old, dict) else {}
            extras = {k: v for k, v in (entries[j] or {}).items() if k not in ours and k != MASTER}
            view.clear()
            view.update(ours)
            view.update(extras)
            opt_state[p] = view
            self.views.append(view)
            self.expected.append(ours)

    def edited(self, opt_state: Any) -> bool:
        """Whether ``optimizer.state`` no longer shows exactly this state (a tensor or step
        replaced, the step written in place, an entry deleted)."""
        get = getattr(opt_state, "get", None)
        if get is None:
            return True
        for p, view, ours in zip(self.params, self.views, self.expected):
            if get(p) is not view:
                return True
            for k, obj in ours.items():
                if view.get(k) is not obj:
                    return True
        return self.mirror.item() != self.seen


def _listed(keys: list[str]) -> str:
    """``'a' is`` / ``'a' and 'b' are`` / ``'a', 'b' and 'c' are``."""
    names = [repr(k) for k in keys]
    head = ", ".join(names[:-1])
    return f"{head} and {names[-1]} are" if head else f"{names[-1]} is"


def _as_step(x: Any, label: str) -> int:
    v = x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x
    f = real(v)
    if f is None or not math.isfinite(f) or f < 0 or f != int(f):
        raise ValueError(f"{label}: step {x!r} is not a whole number >= 0")
    return int(v)
