"""Gradient accumulation: one step of an optimizer on the mean of ``every_k`` grads (optax's
``MultiSteps``)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import optree
import torch

from functional_offload.base import Optimizer, StateError, Step
from functional_offload.checks import is_int
from functional_offload.combine import HeldStep, Wrapped
from functional_offload.state import CONSUMED, check_usable, grads_for, params_of
from functional_offload.tree import (check_grad, flatten_like, is_dtensor,
                                     leaves_with_paths, local)
from functional_offload.typing import OptState, Params, Updates

__all__ = ["MultiStepsState", "MultiSteps"]


class MultiStepsState(NamedTuple):
    """State of :func:`MultiSteps`."""

    mini_step: torch.Tensor  # int64 0-d (CPU): grads summed in this cycle, 0 .. every_k - 1;
    #                          -1 once consumed by an update
    acc_grads: Params  # the sum of this cycle's grads; mirrors the params (a DTensor's local
    #                    shard), acc dtype, on each param's device
    seen: torch.Tensor  # bool [leaves] (CPU): the leaves that got a grad in this cycle
    inner_state: OptState  # the wrapped optimizer's state


def MultiSteps(opt: Optimizer, every_k: int, *,  # noqa: N802 - optax's name
               acc_dtype: Optional[torch.dtype] = None) -> Optimizer:
    r"""Gradient accumulation: one step of ``opt`` on the mean of every ``every_k`` grads.

    With :math:`g_1 \dots g_k` the grads of one cycle (:math:`k` = ``every_k``):

    .. math::

        s_j = s_{j-1} + g_j \quad (s_0 = 0,\ \text{in the accumulation dtype}), \qquad
        \bar g = \operatorname{cast}_{\text{param dtype}}\!\left(s_k / k\right)

    Updates :math:`1 \dots k-1` add their grads to :math:`s` in place, on the grads' device,
    and return the params unchanged; update :math:`k` runs one step of ``opt`` on
    :math:`\bar g` and starts a new cycle. ``opt`` may be any chain: clipping in it applies to
    :math:`\bar g`. A leaf without a grad (``None``) in every update of a cycle gets ``None``
    (no step for it); one with grads in some updates gets their sum over :math:`k`.

    Like every update, ``update`` consumes the state it is given (the sums are updated in
    place): use the state it returns. The state checkpoints at any point of a cycle; under
    FSDP2, :func:`functional_offload.dcp.state_dict` shows the sums as DTensors sharded like
    the params, so a checkpoint taken mid-cycle resumes at any world size.
    Streamed (:func:`~functional_offload.stream`), the last update of a cycle streams: each
    leaf's :math:`\bar g` goes to ``opt``'s step as soon as its grad arrives; the other
    updates hold their grads until ``finish``, which adds them to the sums.

    Args:
      opt: the optimizer to step (an :class:`~functional_offload.Optimizer`: a terminal one or
        a chain ending in one).
      every_k: :math:`k \ge 1`, the grads per step.
      acc_dtype: the dtype of the sums (default fp32 for bf16/fp16 params, else the params'
        dtype).

    Returns:
      An :class:`~functional_offload.Optimizer` whose state is a :class:`MultiStepsState`.

    Example::

        >>> import torch, functional_offload as fo
        >>> opt = fo.MultiSteps(fo.sgd(lr=1.0), every_k=2)
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> params, state = opt.update({"w": torch.tensor([1.0, 2.0])}, state)
        >>> params["w"], int(state.mini_step)
        (tensor([0., 0.]), 1)
        >>> params, state = opt.update({"w": torch.tensor([3.0, 4.0])}, state)
        >>> params["w"]
        tensor([-2., -3.])
    """
    if not isinstance(opt, Optimizer):
        raise TypeError(f"MultiSteps wraps an Optimizer (adamw, sgd..., or a chain ending in "
                        f"one), got a {type(opt).__name__}; wrap the whole chain so that the mean "
                        "grad reaches the optimizer")
    if not is_int(every_k) or every_k < 1:
        raise ValueError(f"MultiSteps needs every_k, an int >= 1, got {every_k!r}")
    if acc_dtype is not None and (not isinstance(acc_dtype, torch.dtype)
                                  or not acc_dtype.is_floating_point):
        raise TypeError(f"acc_dtype must be a floating torch.dtype or None, got {acc_dtype!r}")

    def init(params: Params) -> MultiStepsState:
        inner_state = opt.init(params)
        _, leaves, spec = leaves_with_paths(params)
        acc = [torch.zeros(local(p).shape, device=local(p).device,
                           dtype=acc_dtype or torch.promote_types(p.dtype, torch.float32))
               for p in leaves]
        return MultiStepsState(torch.zeros((), dtype=torch.int64), optree.tree_unflatten(spec, acc),
                               torch.zeros(len(leaves), dtype=torch.bool), inner_state)

    def update(grads: Updates, state: MultiStepsState) -> tuple[Params, MultiStepsState]:
        if _check(state, every_k) < every_k - 1:
            return _accumulate(grads, state)
        return _LastMicroStep(opt, state, every_k, False).finish(grads)

    def begin(state: MultiStepsState, speculative: bool = False) -> Step:
        if _check(state, every_k) < every_k - 1:
            return HeldStep(update, state)
        return _LastMicroStep(opt, state, every_k, speculative)

    return Optimizer(init, update, begin)


def _check(state: Any, every_k: int) -> int:
    """``state``'s ``mini_step``, checked (``state`` usable, made by this ``every_k``)."""
    if not isinstance(state, MultiStepsState):
        raise TypeError(f"MultiSteps expects its MultiStepsState, got {type(state).__name__}")
    n = int(state.mini_step)
    if n == CONSUMED:
        raise StateError("cannot update: this MultiStepsState was consumed by an earlier "
                         "update (its sums were updated in place); use the state that update "
                         "returned")
    if not 0 <= n < every_k:
        raise ValueError(f"MultiStepsState.mini_step is {n}, outside [0, {every_k}): the state "
                         f"was made by a MultiSteps with another every_k than {every_k}")
    check_usable(state.inner_state, "update")
    return n


def _accumulate(grads: Updates, state: MultiStepsState) -> tuple[Params, MultiStepsState]:
    """An update before the last of a cycle: ``grads`` added to the sums; the params unchanged."""
    params = params_of(state.inner_state)
    gs = grads_for(grads, state.inner_state)
    accs = flatten_like(state.acc_grads, params, "state.acc_grads")
    present = [i for i, g in enumerate(gs) if g is not None]
    if present:
        torch._foreach_add_([accs[i] for i in present], [gs[i] for i in present])
        state.seen[present] = True
    new = MultiStepsState(state.mini_step + 1, state.acc_grads, state.seen, state.inner_state)
    state.mini_step.fill_(CONSUMED)
    return params, new


def _like_param(x: torch.Tensor, live: Any) -> Any:
    """``x`` (a local tensor) as a DTensor sharded like the param ``live`` when that is one, so
    that a norm over the mean grads (clipping) spans every rank's shard."""
    if not is_dtensor(live):
        return x
    return type(live).from_local(x, live.device_mesh, live.placements, run_check=False,
                                 shape=live.shape, stride=live.stride())


def _restart(state: MultiStepsState) -> None:
    """Start a new cycle in ``state`` itself: the sums and marks back to zero."""
    torch._foreach_zero_(optree.tree_leaves(state.acc_grads))
    state.seen.zero_()
    state.mini_step.zero_()


class _LastMicroStep(Wrapped):
    """The last update of a cycle: a fed grad's mean goes to the inner step at once; ``finish``
    sends the others' means and, once the inner step is done, starts a new cycle."""

    def __init__(self, opt: Optimizer, state: MultiStepsState, every_k: int, speculative: bool):
        self.state, self.k = state, every_k
        self.params = params_of(state.inner_state)
        self.paths, self.lives, self.spec = leaves_with_paths(self.params)
        self.accs = flatten_like(state.acc_grads, self.params, "state.acc_grads")
        self.seen = state.seen.tolist()
        self.fed: set[int] = set()
        super().__init__(opt, state.inner_state, speculative)

    def _mean(self, i: int, g: Optional[torch.Tensor]) -> torch.Tensor:
        total = self.accs[i] / self.k if g is None else torch.add(self.accs[i], g).div_(self.k)
        return _like_param(total.to(local(self.lives[i]).dtype), self.lives[i])

    def feed(self, index: int, grad: torch.Tensor) -> None:
        g = check_grad(self.paths[index], grad, self.lives[index])
        if g is None:
            return
        self.inner.feed(index, self._mean(index, g))
        self.fed.add(index)

    def inner_grads(self, grads: Updates) -> Updates:
        """The means of the leaves not fed (``None`` for a leaf without a grad all cycle)."""
        n = len(self.lives)
        given = [None] * n if grads is None else flatten_like(grads, self.params, "grads")
        gs = [None if i in self.fed else check_grad(self.paths[i], given[i], self.lives[i])
              for i in range(n)]
        wanted = [i not in self.fed and (gs[i] is not None or self.seen[i]) for i in range(n)]
        return optree.tree_unflatten(self.spec,
                                     [self._mean(i, gs[i]) if wanted[i] else None for i in range(n)])

    def wrap(self, out: Params, inner_state: OptState) -> tuple[Params, MultiStepsState]:
        state = self.state
        new = MultiStepsState(torch.zeros((), dtype=torch.int64), state.acc_grads, state.seen,
                              inner_state)
        _restart(state)
        state.mini_step.fill_(CONSUMED)
        return out, new

    def completed_anyway(self) -> None:
        _restart(self.state)  # the cycle completed too: the state passed in holds it
