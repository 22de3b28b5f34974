"""``TorchOptimizer``: a ``torch.optim.Optimizer`` over the functional core.

Module loops keep their shape — ``loss.backward(); opt.step(); opt.zero_grad()`` — and torch's
LR schedulers drive ``param_groups[i]["lr"]`` (and ``"weight_decay"``), which the functional
optimizer reads as schedules at every step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Optional

import torch

from functional_offload.base import Optimizer
from functional_offload.checkpoint import load_state_dict as fo_load_state_dict
from functional_offload.checkpoint import state_dict as fo_state_dict
from functional_offload.optimizers import adamw
from functional_offload.transforms import clip_by_global_norm

__all__ = ["TorchOptimizer"]

_SCALARS = (bool, int, float, str)


def _split_names(params: list) -> tuple[list[str], list[torch.Tensor]]:
    names, tensors = [], []
    for i, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            names.append(p[0])
            tensors.append(p[1])
        elif isinstance(p, torch.Tensor):
            names.append(str(i))
            tensors.append(p)
        else:
            raise TypeError(f"params entry {i} is a {type(p).__name__}; pass tensors or "
                            "(name, tensor) pairs (e.g. model.named_parameters())")
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique within a group")
    return names, tensors


class TorchOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose step is a functional_offload terminal optimizer.

    Args:
      params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``), or param-group
        dicts holding either, as ``torch.optim`` accepts.
      optimizer: the functional optimizer's constructor (``fo.adamw``, ``fo.adam``,
        ``fo.sgd``), called once per param group with that group's options.
      max_grad_norm: if set, gradients are clipped by their global norm over all groups
        (``clip_grad_norm_`` semantics) before the step.
      **defaults: the optimizer's options (``lr``, ``betas``, ``weight_decay``, ``placement``…);
        groups may override any of them.

    Each group's ``lr`` and ``weight_decay`` are read at every step, so LR schedulers drive them.
    ``state_dict()`` holds only tensors and plain values (loads with ``weights_only=True``).

    Example::

        >>> import torch, functional_offload as fo
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-3)
        >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        >>> model(torch.ones(3, 4)).sum().backward(); opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, params: Iterable[Any], optimizer: Callable[..., Optimizer] = adamw, *,
                 max_grad_norm: Optional[float] = None, **defaults: Any):
        self._make = optimizer
        self._accepts = set(inspect.signature(optimizer).parameters)
        unknown = set(defaults) - self._accepts
        if unknown:
            raise TypeError(f"{getattr(optimizer, '__name__', optimizer)} does not take "
                            f"{sorted(unknown)}")
        self._clip = clip_by_global_norm(max_grad_norm) if max_grad_norm is not None else None
        self._names: list[list[str]] = []
        self._opts: list[Optimizer] = []
        self._states: list[Any] = []
        defaults.setdefault("lr", inspect.signature(optimizer).parameters["lr"].default)
        defaults.setdefault("weight_decay", inspect.signature(optimizer).parameters["weight_decay"].default)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names, tensors = _split_names(params)
        group["params"] = tensors
        super().add_param_group(group)
        g = self.param_groups[-1]
        opts = {k: v for k, v in g.items() if k in self._accepts and k not in ("lr", "weight_decay")}
        opt = self._make(lr=lambda n, g=g: g["lr"], weight_decay=lambda n, g=g: g["weight_decay"], **opts)
        self._names.append(names)
        self._opts.append(opt)
        self._states.append(opt.init(dict(zip(names, tensors))))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [{n: p.grad for n, p in zip(names, g["params"])}
                 for names, g in zip(self._names, self.param_groups)]
        if self._clip is not None:
            grads, _ = self._clip.update(grads, self._clip.init(None))
        for i, (opt, gr) in enumerate(zip(self._opts, grads)):
            _, self._states[i] = opt.update(gr, self._states[i])
        return loss

    @property
    def fo_states(self) -> list[Any]:
        """The functional states, one per param group (read-only use: they are donated)."""
        return list(self._states)

    def state_dict(self) -> dict[str, Any]:
        state = {f"{i}.{k}": (v.clone() if v.dim() == 0 else v)  # counts: the live one is replaced
                 for i, st in enumerate(self._states) for k, v in fo_state_dict(st).items()}
        groups = [{**{k: v for k, v in g.items() if k != "params" and isinstance(v, _SCALARS + (tuple,))},
                   "params": list(names)} for names, g in zip(self._names, self.param_groups)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        for i, (saved, names) in enumerate(zip(groups, self._names)):
            if list(saved["params"]) != names:
                raise ValueError(f"param group {i}: saved names {saved['params'][:4]}… differ "
                                 f"from this optimizer's {names[:4]}…")
        for i, st in enumerate(self._states):
            prefix = f"{i}."
            sub = {k[len(prefix):]: v for k, v in state_dict["state"].items() if k.startswith(prefix)}
            fo_load_state_dict(sub, st)
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
