"""Grad streaming: feed each leaf's grad to the optimizer's step as autograd produces it."""

from __future__ import annotations

import threading
from typing import Any, Optional

import optree
import torch

from functional_offload.base import Optimizer, Step
from functional_offload.combine import begin_step
from functional_offload.executor.shield import shielded
from functional_offload.quantized import same_memory
from functional_offload.state import check_usable, params_of
from functional_offload.tree import flatten_like, leaves_with_paths, local, paths_of
from functional_offload.typing import Params

__all__ = ["GradStream", "stream"]


def _live_params(state: Any, params: Any) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` autograd fills, one per leaf of the state's params."""
    held = params_of(state)
    paths, mine, _ = leaves_with_paths(held)
    if params is None:
        if mine and not any(p.requires_grad and p.is_leaf for p in mine):
            raise ValueError(
                "fo.stream: no param in this state is a leaf tensor that requires grad, so "
                "autograd never fills their .grad (the state was built from v.detach() copies, "
                "or from DTensor local shards). Pass the live parameters: fo.stream(opt, state, "
                "params=model) or params=dict(model.named_parameters())")
        live = mine
    elif isinstance(params, torch.nn.Module):
        live = flatten_like(dict(params.named_parameters()), held, "fo.stream params")
    else:
        live = flatten_like(params, held, "fo.stream params")
    for path, a, b in zip(paths, mine, live):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"fo.stream params leaf {path!r} is a {type(b).__name__}, expected "
                            "the live parameter")
        x, y = local(a), local(b)
        if x.shape != y.shape or not same_memory(x, y):
            raise ValueError(f"fo.stream params leaf {path!r} is not the tensor the state "
                             "updates (it must share its memory: pass the model's parameters "
                             "the state was built from)")
        if b.requires_grad and not b.is_leaf:
            raise ValueError(f"fo.stream: param {path!r} requires grad but is not a leaf tensor "
                             "(it is computed from another, e.g. a DTensor's to_local()), so "
                             "autograd never fills its .grad; pass the parameters themselves "
                             "(params=model)")
    return live


class GradStream:
    """One streamed step; made by :func:`stream`, used as a context manager around backward.

    Inside the ``with`` block a hook on each live parameter hands its grad to the optimizer's
    :class:`~functional_offload.Step` as soon as autograd (or FSDP2's reduce-scatter) has
    produced it; host-resident state starts its copies and CPU kernel at once. :meth:`finish`
    feeds the rest and returns ``(params, state)``, bit for bit what ``opt.update`` returns for
    the grads ``{path: p.grad}``. An exception inside the block aborts the step: the state is
    left as it was, or marked failed if a host leaf was already handed to work that applies it
    in place (a step not run ahead speculatively; whether that work had begun does not matter,
    so the outcome does not depend on timing). A grad
    changed (or replaced) after it was streamed makes :meth:`finish` abort the same way and
    raise ``ValueError`` naming it: its step ran on the old values.

    Attributes:
      arrived: the leaves (flatten indices) handed over during backward.
      committed: for a chain with clipping in front, whether the step that ran ahead was kept
        (``True``: the clip factor was 1) or redone with the true factor (``False``); ``None``
        otherwise.
    """

    def __init__(self, opt: Optimizer, state: Any, live: list[torch.Tensor]):
        self.opt, self.state, self.live = opt, state, live
        self.step: Optional[Step] = None
        self.spec = optree.tree_structure(params_of(state))
        self.arrived: set[int] = set()
        self.versions: dict[int, tuple[torch.Tensor, int]] = {}  # each fed grad, its version
        self.committed: Optional[bool] = None
        self.handles: list[Any] = []
        self.finished = False
        # autograd runs each device's backward in a thread of its own: their grads are fed one
        # at a time (a step's feed opens runs and remakes views, which no two threads may race)
        self.feeding = threading.Lock()

    def __enter__(self) -> "GradStream":
        if self.step is not None or self.finished:
            raise RuntimeError("this GradStream was already entered; start a new one per step")
        def begun() -> None:  # the step is held by self once the shield ends
            self.step = begin_step(self.opt, self.state)

        try:  # begun shielded, so a Ctrl-C now cannot lose the step (and its busy state)
            _, interrupt = shielded(begun)
            step = self.step
            if interrupt is not None:
                raise interrupt
            if step.delayed:
                raise ValueError("grad streaming and delayed=True are two ways to hide the host "
                                 "step; build the optimizer with one of them")
            for i, p in enumerate(self.live):
                if p.requires_grad and p.is_leaf:
                    self.handles.append(p.register_post_accumulate_grad_hook(
                        lambda p, i=i: self._arrive(i, p.grad)))
        except BaseException:  # nothing may outlive a failed enter: no hook, no busy state
            self._unhook()
            self.finished = True
            if self.step is not None:
                self.step.abort()
            raise
        return self

    def _arrive(self, i: int, grad: Optional[torch.Tensor]) -> None:
        if grad is None:
            return
        with self.feeding:
            self.step.feed(i, grad)
            self.versions[i] = (grad, grad._version)
            self.arrived.add(i)

    def _check_unchanged(self) -> None:
        """Raise if a grad fed during backward was changed or replaced since (its step ran on
        the old values: e.g. grads unscaled or clipped by hand after backward)."""
        for i, (grad, version) in self.versions.items():
            if self.live[i].grad is not grad or grad._version != version:
                path = paths_of(self.spec)[i]
                raise ValueError(
                    f"fo.stream: the grad of {path!r} was changed after autograd produced it; "
                    "its step already ran on the old values, so this step is aborted. Change "
                    "grads before they are streamed (scale the loss instead of the grads; put "
                    "clip_by_global_norm in the chain), or call opt.update(grads, state)")

    def _unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._unhook()
        if exc is not None and not self.finished:
            self.finished = True
            self.step.abort()
        elif not self.finished:
            self.step.close()  # backward is over: what was fed finishes and frees the ring

    def finish(self) -> tuple[Params, Any]:
        """Feed the leaves not streamed, wait for the step; return ``(params, new state)``."""
        if self.step is None:
            raise RuntimeError("use fo.stream(...) as a context manager around backward, then "
                               "call finish() after the with block")
        if self.finished:
            raise RuntimeError("this GradStream already finished (or was aborted); start a new "
                               "one per step")
        self.finished = True
        self._unhook()
        try:
            self._check_unchanged()
        except ValueError:
            self.step.abort()  # the state as it was, or marked failed if applied in place
            raise
        grads = optree.tree_unflatten(self.spec, [p.grad for p in self.live])
        out = self.step.finish(grads)
        self.committed = self.step.committed
        return out


def stream(opt: Optimizer, state: Any, params: Any = None) -> GradStream:
    r"""Stream the next backward's grads into the update of ``opt``.

    The host step can only start once grads exist; streaming starts each host-resident leaf's
    step as soon as autograd has accumulated its grad, so the copies and the CPU kernel of the
    last layers run while backward computes the first ones, and :meth:`GradStream.finish` waits
    only for the tail. The result equals ``opt.update({path: p.grad}, state)`` bit for bit.

    Usage::

        with fo.stream(opt, state) as s:
            loss.backward()
        params, state = s.finish()

    Args:
      opt: a terminal optimizer or a chain ending in one. With ``clip_by_global_norm`` (and
        ``apply_if_finite``) in front the step runs ahead speculatively — as if the clip factor
        were 1 and every grad finite — into spare host buffers; ``finish`` keeps it when that
        holds and otherwise redoes (clip) or skips (non-finite) the step exactly as ``update``
        would. Other transforms in front hold the grads until ``finish`` runs ``update``.
      state: the optimizer's state.
      params: the live parameters whose ``.grad`` autograd fills (a module, or a tree like the
        state's params), when the state was built from other tensors sharing their memory
        (``{k: v.detach() ...}``, DTensor local shards). By default the state's own params.

    Stream one backward per step (the last micro-batch of an accumulation); a second grad for a
    leaf raises in backward.
    """
    if not isinstance(opt, Optimizer):
        raise TypeError(f"fo.stream takes an Optimizer (adamw, adam, sgd, or a chain ending in "
                        f"one), got a {type(opt).__name__}")
    check_usable(state, "stream")
    return GradStream(opt, state, _live_params(state, params))
