"""The next forward lands each module's params as it reaches the module.

With ``delayed=fo.Delay(lookahead=False)`` an update returns once its host step has started;
its new params come up during the next forward and backward, and by default they land at the
next update, so that forward and backward read the params of the step before. With
:func:`land_before_forward`, each module's forward first lands that module's params
(:func:`~functional_offload.state.land`): it waits for just those, so the forward reads the
exact new params while the host step goes on for the modules after it. The update is then
exact (the same results as without ``delayed``, bit for bit) and its host step overlaps the
next forward: the leaves come up in the order of the params tree, which for a model's
``named_parameters()`` is the order its forward usually reaches them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from functional_offload.state import land
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

    Not for FSDP2 (``fully_shard``) models yet: their all-gather runs before these hooks;
    refused with a ``ValueError``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"land_before_forward takes an nn.Module, got {type(model).__name__}")
    lander = getattr(state, "land", None)
    if not callable(lander):
        if not callable(state):
            raise TypeError("land_before_forward takes a function returning the optimizer's "
                            "current state (e.g. lambda: state) or an object with a land(params) "
                            f"method (fo.TorchOptimizer), got a {type(state).__name__}")
        lander = None
    handles = []
    try:
        for name, module in model.named_modules():
            if _fsdp_module(module):
                raise ValueError(f"module {name or type(module).__name__!r} is an FSDP2 module: "
                                 "land_before_forward does not land sharded params before "
                                 "FSDP2's all-gather yet; use fo.flush(state) before the forward")
            own = list(module.parameters(recurse=False))
            if own:
                handles.append(module.register_forward_pre_hook(_Land(own, state, lander)))
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


class _Land:
    """One module's hook: land its params."""

    def __init__(self, params: list[torch.Tensor], state: Callable[[], OptState],
                 lander: Optional[Callable[[list[torch.Tensor]], None]]):
        self.params, self.state, self.lander = params, state, lander

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.lander is not None:
            self.lander(self.params)
        else:
            land(self.state(), self.params)
