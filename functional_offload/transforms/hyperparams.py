"""Hyperparameters in the state, changeable between steps (optax's ``inject_hyperparams``)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, NamedTuple, Optional, Union

import torch

from functional_offload.base import GradientTransformation, Optimizer, StateError, Step
from functional_offload.combine import HeldStep
from functional_offload.state import CONSUMED, check_usable, stepped, terminal_counts
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
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)

    @functools.wraps(inner_factory)
    def factory(*args: Any, **kwargs: Any) -> AnyT:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        numbers: dict[str, float] = {}
        schedules: dict[str, Callable[[int], Any]] = {}
        for k, v in bound.arguments.items():
            if (sig.parameters[k].kind not in named or k in static or isinstance(v, bool)
                    or (k in ints and isinstance(v, int))):
                continue
            if callable(v):
                schedules[k] = v
            elif isinstance(v, (int, float)):
                numbers[k] = float(v)

        def at(k: str, n: int) -> float:
            """Schedule ``k``'s value at step ``n``, checked to be a number."""
            try:
                x = schedules[k](n)
            except Exception as e:
                raise TypeError(f"{name}: {k!r} is a callable, so it is taken as a schedule of the "
                                f"step count, but {k}({n}) raised {type(e).__name__}: {e}. If it "
                                f"is not a schedule, name it in static_args") from e
            if isinstance(x, torch.Tensor) and x.dim() == 0:
                x = x.item()
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise TypeError(f"{name}: the schedule {k!r} returned {x!r} at step {n}, not a "
                                f"number. If {k!r} is not a schedule, name it in static_args")
            return float(x)

        def build(values: dict[str, float]) -> AnyT:
            call = sig.bind(*args, **kwargs)
            call.apply_defaults()
            call.arguments.update(values)
            return inner_factory(*call.args, **call.kwargs)

        start = {**numbers, **{k: at(k, 0) for k in schedules}}
        first = build(start)  # the constructor validates every value now
        if not isinstance(first, (Optimizer, GradientTransformation)):
            raise TypeError(f"inject_hyperparams: {name} returned a {type(first).__name__}, not "
                            "an Optimizer or a GradientTransformation")
        terminal = isinstance(first, Optimizer)
        names = sorted(start)
        scheduled = tuple(schedules)

        def init(params: Params) -> InjectHyperparamsState:
            return InjectHyperparamsState(
                torch.zeros((), dtype=torch.int64),
                {k: torch.tensor(start[k], dtype=torch.float64) for k in names}, first.init(params))

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
            values = {k: hp[k].item() for k in numbers}
            values.update({k: at(k, n) for k in schedules})
            return build(values), values

        def update(updates: Updates, state: InjectHyperparamsState) -> tuple[Any, OptState]:
            inner, values = current(state)
            return _complete(state, values, scheduled, terminal_counts(state.inner_state),
                             lambda: inner.update(updates, state.inner_state))

        if not terminal:
            return GradientTransformation(init, update)

        def begin(state: InjectHyperparamsState, speculative: bool = False) -> Step:
            inner, values = current(state)
            counts = terminal_counts(state.inner_state)
            step = (inner.begin(state.inner_state, speculative) if inner.begin is not None
                    else HeldStep(inner.update, state.inner_state))
            return _Injected(step, state, values, scheduled, counts)

        return Optimizer(init, update, begin)

    return factory


def _complete(state: InjectHyperparamsState, values: dict[str, float], scheduled: tuple[str, ...],
              counts: list[int], run: Callable[[], tuple[Any, OptState]]) -> tuple[Any, OptState]:
    """``run()`` the inner update and return the new state (the scheduled values written, the
    count advanced); ``state`` is consumed. An interrupt after the inner step completed (its
    counts moved) leaves ``state`` holding the step, as a terminal optimizer does."""
    try:
        out, inner_state = run()
    except BaseException:  # a signal's handler may raise once the inner step completed
        if stepped(state.inner_state, counts):
            state.count.add_(1)
            for k in scheduled:
                state.hyperparams[k].fill_(values[k])
        raise
    written = {k: torch.tensor(values[k], dtype=torch.float64) for k in scheduled}
    new = InjectHyperparamsState(state.count + 1, {**state.hyperparams, **written}, inner_state)
    state.count.fill_(CONSUMED)
    return out, new


class _Injected:
    """A step of the rebuilt inner optimizer; ``finish`` wraps its state in the new
    :class:`InjectHyperparamsState`."""

    def __init__(self, inner: Step, state: InjectHyperparamsState, values: dict[str, float],
                 scheduled: tuple[str, ...], counts: list[int]):
        self.inner, self.state, self.values, self.scheduled, self.counts = (
            inner, state, values, scheduled, counts)
        self.delayed = getattr(inner, "delayed", False)
        self.committed: Optional[bool] = None

    def feed(self, index: int, grad: torch.Tensor) -> None:
        self.inner.feed(index, grad)

    def finish(self, grads: Updates = None) -> tuple[Params, InjectHyperparamsState]:
        out = _complete(self.state, self.values, self.scheduled, self.counts,
                        lambda: self.inner.finish(grads))
        self.committed = getattr(self.inner, "committed", None)
        return out

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()
