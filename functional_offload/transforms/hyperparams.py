"""Hyperparameters in the state, changeable between steps (optax's ``inject_hyperparams``)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, NamedTuple, Union

import torch

from functional_offload.base import GradientTransformation, Optimizer, StateError, Step
from functional_offload.checks import real
from functional_offload.combine import Wrapped, run_inner
from functional_offload.state import CONSUMED, check_usable, terminal_counts
from functional_offload.tree import describe
from functional_offload.typing import OptState, Params, Updates

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]

AnyT = Union[Optimizer, GradientTransformation]


class InjectHyperparamsState(NamedTuple):
    """State of a transformation made by :func:`inject_hyperparams`."""

    count: torch.Tensor  # int64 0-d (CPU): updates applied (the schedules' n); -1 once consumed
    hyperparams: dict[str, torch.Tensor]  # name -> float64 0-d (CPU): the value the next update
    #                                       uses; a scheduled one's value at the last update
    inner_state: OptState  # the inner transformation's state

    def check(self) -> None:
        """Raise ``TypeError`` naming a hyperparameter that is not a 0-d float64 tensor (a value
        written by hand in another dtype would step, then not load into a fresh ``init``)."""
        if not isinstance(self.hyperparams, dict):
            raise TypeError(f"state.hyperparams must be a dict of 0-d float64 tensors, got "
                            f"{type(self.hyperparams).__name__}")
        for k, t in self.hyperparams.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != torch.float64:
                raise TypeError(f"state.hyperparams[{k!r}] is a {describe(t)}; it must be a "
                                "0-d float64 tensor: torch.tensor(value, dtype=torch.float64)")


def _int_params(sig: inspect.Signature) -> set[str]:
    """Parameters declared ``int`` (by annotation or default): structural, never injected."""
    return {name for name, p in sig.parameters.items()
            if p.annotation in (int, "int") or isinstance(p.default, int)}


def inject_hyperparams(inner_factory: Callable[..., AnyT],
                       static_args: Union[str, Iterable[str]] = ()) -> Callable[..., AnyT]:
    r"""Make the numeric arguments of ``inner_factory`` hyperparameters held in the state.

    ``inject_hyperparams(fo.adamw)(lr=..., weight_decay=...)`` is ``fo.adamw`` whose numeric
    arguments live in ``state.hyperparams`` (0-d float64 tensors, so Python floats round-trip
    exactly) instead of in the optimizer. Each update rebuilds the inner transformation from
    them — a value the constructor refuses raises before anything changes — and continues its
    state:

    .. math::

        h_k(n) = \begin{cases} f_k(n) & \text{if argument } k \text{ is a schedule } f_k \\
                 \text{state.hyperparams}[k] & \text{otherwise} \end{cases}
        \qquad \text{update}_n = \text{inner\_factory}(\dots, h(n))\text{.update}

    with :math:`n` = ``state.count``, the updates already applied. A schedule's value is
    written into ``state.hyperparams`` at every update (and at ``init``, :math:`f_k(0)`); the
    others are read from there, so a loop can change them between updates::

        state = state._replace(hyperparams={**state.hyperparams,
                                            "lr": torch.tensor(1e-4, dtype=torch.float64)})

    and checkpoints keep them. Which arguments are injected (as optax): numbers (``int`` /
    ``float``, not ``bool``; an ``int`` for a parameter declared ``int`` stays static) and
    callables (schedules of :math:`n`), except those named in ``static_args``. Everything
    else — ``betas`` and other tuples, bools, dtypes, placements, executors — is static, fixed
    at construction (schedules inside ``betas`` still work: ``adamw`` takes them). An argument
    that decides the state's layout (``sgd``'s ``momentum`` between 0 and non-zero) must not
    change after ``init``. Streamed (:func:`~functional_offload.stream`), the rebuilt inner
    optimizer's own step streams.

    Args:
      inner_factory: a constructor of an :class:`~functional_offload.Optimizer` or a
        :class:`~functional_offload.GradientTransformation` (``fo.adamw``, ``fo.sgd``,
        ``fo.clip_by_global_norm``...).
      static_args: names of arguments never injected: callables that are not schedules
        (``weight_decay_mask=lambda p: ...``) or numbers to keep fixed.

    Returns:
      A function taking ``inner_factory``'s arguments and returning a transformation of the
      same kind whose state is an :class:`InjectHyperparamsState`. It builds the inner one at
      once (schedules at :math:`n = 0`), so bad arguments raise there.

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.inject_hyperparams(fo.sgd)(lr=0.1)
        >>> state = opt.init({"w": torch.zeros(1)})
        >>> state.hyperparams["lr"]
        tensor(0.1000, dtype=torch.float64)
        >>> lr = torch.tensor(1.0, dtype=torch.float64)
        >>> state = state._replace(hyperparams={**state.hyperparams, "lr": lr})
        >>> params, state = opt.update({"w": torch.ones(1)}, state)
        >>> params["w"]
        tensor([-1.])
    """
    name = getattr(inner_factory, "__name__", repr(inner_factory))
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    sig = inspect.signature(inner_factory)
    if not static <= set(sig.parameters):
        raise ValueError(f"static_args {sorted(static - set(sig.parameters))} are not parameters "
                         f"of {name}, which takes {list(sig.parameters)}")
    ints = _int_params(sig)

    @functools.wraps(inner_factory)
    def factory(*args: Any, **kwargs: Any) -> AnyT:
        call = _Call(inner_factory, name, sig, static, ints, args, kwargs)
        first = call.build(call.start)  # the constructor validates every value now
        if not isinstance(first, (Optimizer, GradientTransformation)):
            raise TypeError(f"inject_hyperparams: {name} returned a {type(first).__name__}, not "
                            "an Optimizer or a GradientTransformation")
        return _injected(call, first)

    return factory


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class _Call:
    """One call of an injected factory: the numbers and schedules it was given (its injected
    arguments), and the inner transformation rebuilt from values of them."""

    def __init__(self, factory: Callable[..., AnyT], name: str, sig: inspect.Signature,
                 static: set[str], ints: set[str], args: tuple, kwargs: dict[str, Any]):
        self.factory, self.name, self.sig, self.args, self.kwargs = factory, name, sig, args, kwargs
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        self.numbers: dict[str, float] = {}
        self.schedules: dict[str, Callable[[int], Any]] = {}
        for k, v in bound.arguments.items():
            if (sig.parameters[k].kind not in _NAMED or k in static or isinstance(v, bool)
                    or (k in ints and isinstance(v, int))):
                continue
            if callable(v):
                self.schedules[k] = v
            elif isinstance(v, (int, float)):
                self.numbers[k] = float(v)
        self.start = {**self.numbers, **{k: self.at(k, 0) for k in self.schedules}}
        self.names = sorted(self.start)
        self.scheduled = tuple(self.schedules)

    def at(self, k: str, n: int) -> float:
        """Schedule ``k``'s value at step ``n``, checked to be a number."""
        name = self.name
        try:
            x = self.schedules[k](n)
        except Exception as e:
            raise TypeError(f"{name}: {k!r} is a callable, so it is taken as a schedule of the "
                            f"step count, but {k}({n}) raised {type(e).__name__}: {e}. If it "
                            f"is not a schedule, name it in static_args") from e
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            x = x.item()
        if real(x) is None:
            raise TypeError(f"{name}: the schedule {k!r} returned {x!r} at step {n}, not a "
                            f"number. If {k!r} is not a schedule, name it in static_args")
        return float(x)

    def build(self, values: dict[str, float]) -> AnyT:
        """The inner transformation with the injected arguments set to ``values``."""
        call = self.sig.bind(*self.args, **self.kwargs)
        call.apply_defaults()
        call.arguments.update(values)
        return self.factory(*call.args, **call.kwargs)


def _injected(call: _Call, first: AnyT) -> AnyT:
    """The transformation ``inject_hyperparams`` returns for ``call`` (``first``: the inner one
    built from the values at ``init``)."""
    name, names, terminal = call.name, call.names, isinstance(first, Optimizer)

    def init(params: Params) -> InjectHyperparamsState:
        return InjectHyperparamsState(
            torch.zeros((), dtype=torch.int64),
            {k: torch.tensor(call.start[k], dtype=torch.float64) for k in names}, first.init(params))

    def current(state: Any) -> tuple[AnyT, dict[str, float]]:
        """The inner transformation for this update, and the values it was built from."""
        if not isinstance(state, InjectHyperparamsState):
            raise TypeError(f"inject_hyperparams({name}) expects its InjectHyperparamsState, "
                            f"got {type(state).__name__}")
        n = int(state.count)
        if n == CONSUMED:
            raise StateError("cannot update: this InjectHyperparamsState was consumed by an "
                             "earlier update; use the state that update returned")
        if terminal:
            check_usable(state.inner_state, "update")
        hp = state.hyperparams
        if not isinstance(hp, dict) or sorted(hp) != names:
            got = sorted(hp) if isinstance(hp, dict) else type(hp).__name__
            raise ValueError(f"state.hyperparams must hold exactly {names} (the injected "
                             f"arguments of {name}); got {got}")
        state.check()
        values = {k: hp[k].item() for k in call.numbers}
        values.update({k: call.at(k, n) for k in call.schedules})
        return call.build(values), values

    def update(updates: Updates, state: InjectHyperparamsState) -> tuple[Any, OptState]:
        inner, values = current(state)
        out, inner_state = run_inner(lambda: inner.update(updates, state.inner_state),
                                     state.inner_state, terminal_counts(state.inner_state),
                                     lambda: _held(state, values, call.scheduled))
        return out, _advanced(state, values, call.scheduled, inner_state)

    if not terminal:
        return GradientTransformation(init, update)

    def begin(state: InjectHyperparamsState, speculative: bool = False) -> Step:
        inner, values = current(state)
        return _Injected(inner, state, values, call.scheduled, speculative)

    return Optimizer(init, update, begin)


def _held(state: InjectHyperparamsState, values: dict[str, float],
          scheduled: tuple[str, ...]) -> None:
    """The inner step completed but what ran it raised: ``state`` itself holds the step (the
    scheduled values written, the count advanced), as a terminal optimizer's state does."""
    state.count.add_(1)
    for k in scheduled:
        state.hyperparams[k].fill_(values[k])


def _advanced(state: InjectHyperparamsState, values: dict[str, float], scheduled: tuple[str, ...],
              inner_state: OptState) -> InjectHyperparamsState:
    """The new state after a step (the scheduled values written, the count advanced); ``state``
    is consumed."""
    written = {k: torch.tensor(values[k], dtype=torch.float64) for k in scheduled}
    new = InjectHyperparamsState(state.count + 1, {**state.hyperparams, **written}, inner_state)
    state.count.fill_(CONSUMED)
    return new


class _Injected(Wrapped):
    """A step of the rebuilt inner optimizer; ``finish`` wraps its state in the new
    :class:`InjectHyperparamsState`."""

    def __init__(self, opt: Optimizer, state: InjectHyperparamsState, values: dict[str, float],
                 scheduled: tuple[str, ...], speculative: bool):
        self.state, self.values, self.scheduled = state, values, scheduled
        super().__init__(opt, state.inner_state, speculative)

    def wrap(self, out: Params, inner_state: OptState) -> tuple[Params, InjectHyperparamsState]:
        return out, _advanced(self.state, self.values, self.scheduled, inner_state)

    def completed_anyway(self) -> None:
        _held(self.state, self.values, self.scheduled)
