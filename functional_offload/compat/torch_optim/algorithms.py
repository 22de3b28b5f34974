"""What :class:`~functional_offload.TorchOptimizer` knows of each algorithm.

For ``fo.adamw``, ``fo.adam`` and ``fo.sgd``: ``torch.optim``'s options with their defaults (so
that a param group holds every key torch's class would, and tools that look for ``betas`` or
``momentum`` find them), their checks with torch's messages, the options the adapter refuses,
and the functional optimizer a group's values make at a step. Any other constructor of a
terminal optimizer gets a generic entry: its signature's hyperparameters, passed through.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Optional

import torch

from functional_offload.base import Optimizer
from functional_offload.compat.torch_optim.views import Expect
from functional_offload.optimizers import adam, adamw, sgd
from functional_offload.optimizers.spec import torch_state_names

__all__ = ["Algorithm", "algorithm_for", "check_options", "number", "FREE_OPTIONS",
           "TORCH_STATE_KEYS"]

FREE_OPTIONS = frozenset({"weight_decay_mask", "executor", "cpu_kernel"})
"""Keyword options of the functional constructors that may change between steps; the others
(``placement``, ``master_dtype``, the moments' dtypes, ``ema_decay``, ``delayed``) decide the
state's layout: changing one re-lays the state out at the next step (a copy)."""

TORCH_STATE_KEYS = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "row_var", "col_var",
    "variance", "square_avg", "acc_delta", "sum", "exp_inf", "mu_product", "grad_avg", "prev",
    "step_size", "eta", "mu", "ax"})
"""The per-param state keys of ``torch.optim``'s algorithms (and so of the functional
optimizers, which use torch's names), ``step`` aside: one that an algorithm does not keep, in a
state_dict being loaded, says that another algorithm saved it."""


def number(x: Any) -> Any:
    """A hyperparameter as the functional constructors take it: a 1-element tensor as a Python
    float (a CUDA tensor costs a sync), numbers and schedules as they are."""
    return float(x.item()) if isinstance(x, torch.Tensor) else x


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _refuse(option: str, value: Any, why: str, fix: str) -> ValueError:
    return ValueError(f"{option}={value!r} is not supported by fo.TorchOptimizer: {why}; {fix}")


def _keyword_options(*fns: Callable) -> frozenset:
    return frozenset(n for f in fns for n, p in inspect.signature(f).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _check_lr(v: Mapping[str, Any]) -> None:
    lr = v["lr"]
    if _is_tensor(lr):
        if v.get("foreach") and not v.get("capturable"):
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not callable(lr) and not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def _check_nonneg(v: Mapping[str, Any], key: str, label: str) -> None:
    x = v[key]
    if _is_tensor(x) and x.numel() != 1:
        raise ValueError(f"Tensor {key} must be 1-element")
    if not callable(x) and not 0.0 <= x:
        raise ValueError(f"Invalid {label} value: {x}")


def check_options(options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for a functional constructor's option the adapter refuses."""
    if options.get("store_param_remainders"):
        raise _refuse("store_param_remainders", options["store_param_remainders"],
                      "torch.optim's state holds a master as one tensor, a split master is two "
                      "halves", "use the functional optimizer (fo.adamw(store_param_remainders="
                      "True)) or leave it False")
    for key, dt in options.items():
        if key.endswith("_dtype") and dt == torch.uint8:
            raise _refuse(key, dt, "torch.optim's state holds each moment as a tensor of the "
                          "param's shape, a block-wise 8-bit moment is codes and scales",
                          f"use the functional optimizer (fo.adamw({key}=torch.uint8)) or fp32/bf16 "
                          "moments")


def _check_flags(v: Mapping[str, Any]) -> None:
    """torch's checks of the implementation flags, then the flags the adapter refuses."""
    if v.get("fused") and v.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if v.get("fused") and v.get("differentiable"):
        raise RuntimeError("`fused` does not support `differentiable`")
    if v.get("differentiable"):
        raise _refuse("differentiable", v["differentiable"],
                      "the step runs under no_grad, partly on host-resident state",
                      "set differentiable=False (torch.optim's optimizers support it)")
    if v.get("capturable"):
        raise _refuse("capturable", v["capturable"],
                      "the step reads its hyperparameters on the host and may run host work, so "
                      "it cannot be captured in a CUDA graph", "set capturable=False")
    if not isinstance(v.get("maximize", False), bool):
        raise ValueError(f"maximize must be True or False, got {v['maximize']!r}")


class Algorithm:
    """The adapter's entry for one functional constructor.

    ``defaults``: every option a param group holds, with its default (torch's for the torch
    algorithms). ``options``: the constructor's keyword-only options (placement, dtypes...),
    also accepted in groups. ``check`` raises on invalid or refused values; ``build`` makes the
    functional optimizer for one step from a group's values; ``moments`` names the state fields
    that step needs (``None``: whatever ``init`` lays out).
    """

    name = "optimizer"
    defaults: dict[str, Any] = {}
    options: frozenset = frozenset()
    keys: frozenset = frozenset()  # torch's per-param state keys of the algorithm, ``step`` aside
    needs: tuple = ()  # the moments a per-param state always holds
    needs_step = True  # a per-param state holds a step (torch's SGD keeps none)
    needs_moments = True  # it holds every moment (torch's SGD starts a missing buffer afresh)

    @property
    def accepts(self) -> frozenset:
        return frozenset(self.defaults) | self.options

    def check(self, v: Mapping[str, Any]) -> None:
        _check_flags(v)

    def build(self, v: Mapping[str, Any], options: Mapping[str, Any]) -> Optimizer:
        raise NotImplementedError

    def moments(self, v: Mapping[str, Any]) -> Optional[frozenset]:
        return None

    def on_load(self, group: dict) -> None:
        """Adjust a group loaded from a state_dict (as torch's ``__setstate__`` does)."""

    def expect(self) -> Expect:
        """What a loaded per-param entry must hold, and the keys that say that another
        algorithm saved it."""
        return Expect(self.name, self.needs_step, self.needs_moments, self.needs,
                      TORCH_STATE_KEYS - self.keys)


class AdamFamily(Algorithm):
    """``torch.optim.AdamW`` / ``Adam``: ``decoupled_weight_decay`` picks ``fo.adamw`` or
    ``fo.adam`` (as the flag does in torch's ``Adam``)."""

    def __init__(self, decoupled: bool):
        self.decoupled = decoupled
        self.name = "AdamW" if decoupled else "Adam"
        self.defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                         "weight_decay": 1e-2 if decoupled else 0.0, "amsgrad": False,
                         "maximize": False, "foreach": None, "capturable": False,
                         "differentiable": False, "fused": None,
                         "decoupled_weight_decay": decoupled}
        self.options = _keyword_options(adam, adamw)
        self.keys = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
        self.needs = ("exp_avg", "exp_avg_sq")

    def check(self, v: Mapping[str, Any]) -> None:
        _check_lr(v)
        _check_nonneg(v, "eps", "epsilon")
        betas = v["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            if not callable(b) and not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        _check_nonneg(v, "weight_decay", "weight_decay")
        if _is_tensor(betas[0]) != _is_tensor(betas[1]):
            raise ValueError("betas must be either both floats or both Tensors")
        for i, b in enumerate(betas):
            if _is_tensor(b):
                if v.get("foreach") and not v.get("capturable"):
                    raise ValueError(f"betas[{i}] as a Tensor is not supported for "
                                     "capturable=False and foreach=True")
                if b.numel() != 1:
                    raise ValueError(f"Tensor betas[{i}] must be 1-element")
        _check_flags(v)
        if v.get("amsgrad"):
            raise _refuse("amsgrad", v["amsgrad"], "fo.adam/fo.adamw keep no maximum of the "
                          "second moments", f"set amsgrad=False, or use torch.optim.{self.name} "
                          "for this model")
        if not isinstance(v.get("decoupled_weight_decay"), bool):
            raise ValueError("decoupled_weight_decay must be True or False, got "
                             f"{v.get('decoupled_weight_decay')!r}")

    def build(self, v: Mapping[str, Any], options: Mapping[str, Any]) -> Optimizer:
        make = adamw if v["decoupled_weight_decay"] else adam
        b1, b2 = v["betas"]
        return make(lr=number(v["lr"]), betas=(number(b1), number(b2)), eps=number(v["eps"]),
                    weight_decay=number(v["weight_decay"]), **options)

    def on_load(self, group: dict) -> None:
        if self.decoupled:  # torch.optim.AdamW.__setstate__ does the same
            group["decoupled_weight_decay"] = True


class SGDAlgorithm(Algorithm):
    """``torch.optim.SGD`` without dampening: momentum 0 makes no buffers; a group whose
    momentum becomes non-zero gets them (zero, so the first step copies the grad, as torch)."""

    name = "SGD"
    keys = frozenset({"momentum_buffer"})
    needs_step = False
    needs_moments = False

    def __init__(self) -> None:
        self.defaults = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                         "nesterov": False, "maximize": False, "foreach": None,
                         "differentiable": False, "fused": None}
        self.options = _keyword_options(sgd)

    @staticmethod
    def _has_momentum(v: Mapping[str, Any]) -> bool:
        m = v["momentum"]
        return callable(m) or m != 0

    def check(self, v: Mapping[str, Any]) -> None:
        _check_lr(v)
        m = v["momentum"]
        if not callable(m) and m < 0.0:
            raise ValueError(f"Invalid momentum value: {m}")
        _check_nonneg(v, "weight_decay", "weight_decay")
        dampening = v["dampening"]
        if not isinstance(v["nesterov"], bool):
            raise ValueError(f"nesterov must be True or False, got {v['nesterov']!r}")
        if v["nesterov"] and (not (callable(m) or m > 0) or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _check_flags(v)
        if dampening != 0:
            raise _refuse("dampening", dampening, "fo.sgd has no dampening",
                          "set dampening=0, or use torch.optim.SGD for this model")

    def build(self, v: Mapping[str, Any], options: Mapping[str, Any]) -> Optimizer:
        m = number(v["momentum"]) if self._has_momentum(v) else 0.0
        return sgd(lr=number(v["lr"]), momentum=m, nesterov=v["nesterov"],
                   weight_decay=number(v["weight_decay"]), **options)

    def moments(self, v: Mapping[str, Any]) -> Optional[frozenset]:
        return frozenset({"momentum"}) if self._has_momentum(v) else frozenset()


class Generic(Algorithm):
    """Any other constructor of a terminal optimizer: its parameters with defaults that are not
    keyword-only are the hyperparameters (read from the group at every step)."""

    def __init__(self, make: Callable[..., Optimizer]):
        self.make = make
        self.name = getattr(make, "__name__", type(make).__name__)
        sig = inspect.signature(make)
        self.defaults = {n: p.default for n, p in sig.parameters.items()
                         if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty}
        self.defaults["maximize"] = False
        self.options = _keyword_options(make)
        self.keys = _moment_keys(make)

    def build(self, v: Mapping[str, Any], options: Mapping[str, Any]) -> Optimizer:
        hyper = {k: (tuple(number(b) for b in x) if isinstance(x, (tuple, list)) else number(x))
                 for k, x in v.items() if k != "maximize"}
        opt = self.make(**hyper, **options)
        if not isinstance(opt, Optimizer):
            raise TypeError(f"{self.name}(...) returned a {type(opt).__name__}; TorchOptimizer "
                            "needs a terminal functional_offload Optimizer (e.g. fo.adamw)")
        return opt


def _moment_keys(make: Callable[..., Optimizer]) -> frozenset:
    """The torch keys of the moments of ``make``'s state (laid out for no params); every key
    of torch's algorithms where that state cannot be made with the defaults (none is foreign)."""
    try:
        opt = make()
        if isinstance(opt, Optimizer):
            return frozenset(torch_state_names(opt.init([])).values())
    except (TypeError, ValueError):
        pass
    return TORCH_STATE_KEYS


_KNOWN: dict[Any, Callable[[], Algorithm]] = {
    adamw: lambda: AdamFamily(True),
    adam: lambda: AdamFamily(False),
    sgd: SGDAlgorithm,
}


def algorithm_for(optimizer: Callable[..., Optimizer]) -> tuple[Algorithm, dict[str, Any]]:
    """``(algorithm, preset options)`` for a constructor; a ``functools.partial`` of a known
    constructor keeps its keyword arguments as preset defaults."""
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a functional optimizer constructor such as fo.adamw, "
                        f"got {type(optimizer).__name__}")
    preset: dict[str, Any] = {}
    base = optimizer
    if isinstance(optimizer, functools.partial) and not optimizer.args and optimizer.func in _KNOWN:
        base, preset = optimizer.func, dict(optimizer.keywords)
    algo = _KNOWN[base]() if base in _KNOWN else Generic(optimizer)
    unknown = set(preset) - algo.accepts
    if unknown:
        raise TypeError(f"{algo.name} does not take {sorted(unknown)}")
    return algo, preset
