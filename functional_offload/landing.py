"""The next forward lands each module's params as it reaches the module.

With ``delayed=fo.Delay(lookahead=False)`` an update returns once its host step has started;
its new params come up during the next forward and backward, and by default they land at the
next update, so that forward and backward read the params of the step before. With
:func:`land_before_forward`, each module's forward first lands that module's params
(:func:`~functional_offload.state.land`): it waits for just those, so the forward reads the
exact new params while the host step goes on for the modules after it. The update is then
exact (the same results as without ``delayed``, bit for bit) and its host step overlaps the
next forward: a delayed step runs its leaves in the order the forward before it landed them
(at the first step, the params tree's insertion order: for a model's ``named_parameters()``, the
order its forward usually reaches them).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from functional_offload.state import land, terminal_states
from functional_offload.typing import OptState

__all__ = ["LandingHooks", "land_before_forward"]


class LandingHooks:
    """The forward pre-hooks :func:`land_before_forward` registered; :meth:`remove` them."""

    def __init__(self, handles: list[Any]):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def land_before_forward(model: nn.Module, state: Any) -> LandingHooks:
    """Before each forward of a module of ``model`` with params of its own, land those params
    from the update in flight in ``state()`` (the optimizer's current state: a function, as
    every update returns a new one), or through ``state.land(params)`` for an object with that
    method (a :class:`~functional_offload.TorchOptimizer`, which holds its states).

    Example::

        >>> import torch, functional_offload as fo
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> params = dict(model.named_parameters())
        >>> opt = fo.adamw(1e-2, delayed=fo.Delay(lookahead=False))
        >>> state = opt.init(params)
        >>> hooks = fo.land_before_forward(model, lambda: state)
        >>> for _ in range(3):
        ...     model(torch.ones(2, 4)).sum().backward()
        ...     params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        ...     model.zero_grad(set_to_none=True)
        >>> state = fo.flush(state)  # the last update lands
        >>> hooks.remove()

    ``nn.MultiheadAttention``'s hook lands its ``out_proj``'s params too (it reads them without
    calling it). Each hook runs before the module's other forward pre-hooks. A param another
    module reads itself, never calling its module, is not landed by these hooks: the next update
    then raises, naming it (:func:`~functional_offload.land`). A param read before its module's
    forward begins (by a parent that calls the module afterwards, or by a method other than
    ``forward``) reads the previous step's value (or the new one, if an earlier landing took it
    along), undetected: ``fo.land(state, model)`` first in such code. Register the hooks before
    compiling anything (``torch.compile`` does not check hooks: code compiled for another
    instance of the module's class is reused without them), or call ``torch.compiler.reset()``
    after. Not for FSDP2 (``fully_shard``) models yet: refused
    with a ``ValueError``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"land_before_forward takes an nn.Module, got {type(model).__name__}")
    lander = getattr(state, "land", None)
    if not callable(lander):
        if not callable(state):
            raise TypeError("land_before_forward takes a function returning the optimizer's "
                            "current state (e.g. lambda: state) or an object with a land(params) "
                            f"method (fo.TorchOptimizer), got {type(state).__name__}")
        lander = None
    handles = []
    shared = _Shared(state, lander)
    try:
        for name, module in model.named_modules():
            if _fsdp_module(module):
                raise ValueError(f"module {name or type(module).__name__!r} is an FSDP2 module: "
                                 "land_before_forward does not land sharded params before "
                                 "FSDP2's all-gather yet; use fo.flush(state) before the forward")
            # nn.MultiheadAttention reads its out_proj's params itself, never calling it
            own = list(module.parameters(recurse=isinstance(module, nn.MultiheadAttention)))
            if own:  # first: before other pre-hooks that read the params (weight_norm's)
                handles.append(module.register_forward_pre_hook(
                    torch.compiler.disable(_Land(own, shared)), prepend=True))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    return LandingHooks(handles)


def _fsdp_module(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # a torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


class _Shared:
    """What a model's hooks share: how to reach the update in flight, and the last state's
    pending steps (found once per state, not once per module)."""

    def __init__(self, state: Callable[[], OptState],
                 lander: Optional[Callable[[list[torch.Tensor]], None]]):
        self.state, self.lander = state, lander
        self.seen: Any = _Shared  # no state seen yet (a returned None is checked too)
        self.terminals: list[Any] = []  # the terminal states inside ``seen``

    def land(self, params: list[torch.Tensor]) -> None:
        if self.lander is not None:
            self.lander(params)
            return
        st = self.state()
        if st is not self.seen or any(int(t.count) < 0 for t in self.terminals):
            land(st, [])  # a new state (or one marked since): checked and searched once
            self.terminals = terminal_states(st)
            self.seen = st
        for t in self.terminals:
            if t.params.pending is not None:
                t.params.pending.land_params(params)


class _Land:
    """One module's hook: land its params."""

    def __init__(self, params: list[torch.Tensor], shared: _Shared):
        self.params, self.shared = params, shared

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.shared.land(self.params)
