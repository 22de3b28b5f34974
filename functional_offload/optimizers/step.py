"""One step of a terminal optimizer (the step protocol of :mod:`functional_offload.base`).

``begin`` checks the state, lands a delayed step still in flight, computes this step's
hyperparameters and marks the state busy. ``feed`` checks a leaf's grad and, for host-resident
state, hands the leaf to an executor run at once (grad streaming). ``finish`` checks the other
grads, then applies everything shielded from interrupts
(:func:`~functional_offload.executor.shield.shielded`): device-resident leaves with the spec's
fused math (:mod:`.device_math`), host-resident ones in the step's host form (:mod:`.forms`:
in place through the executor, speculative, delayed, leaf by leaf, or on the GPU).

The failure contract:

- A step completes, leaves the state as it was, or marks it :data:`~functional_offload.base.FAILED`:
  errors found before anything changed (bad grads, bad hyperparameters) leave it usable; an error
  after part of the step was applied in place marks it failed (nothing can then update, stream,
  save or checkpoint it until a checkpoint is loaded into it).
- A speculative step (``begin(state, speculative=True)``) writes the host leaves it starts ahead
  into spare buffers (``StepCache.spares``) and their params into device scratch; ``finish``
  swaps the buffers in (``Tensor.set_``, no copy) and copies the params, so ``abort`` leaves the
  state as it was. ``finish`` commits: from then on the leaves fed ahead whose work has not
  begun run in place (``Run.settle``), at the in-place kernel's rate; a failure after that marks
  the state failed if any leaf ran in place.
- ``KeyboardInterrupt`` / ``SystemExit`` during ``finish`` or a landing: the step is completed
  first, then the interrupt is raised; the state passed to ``update`` then holds the step (its
  count says so).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from functional_offload.base import StepBase, StepCache
from functional_offload.state import BUSY, CONSUMED, after_load, claim, mark_failed
from functional_offload.executor.shield import shielded
from functional_offload.optimizers.device_math import run_groups
from functional_offload.optimizers.forms import Case, HostForm, HostWork, Pending, form_for
from functional_offload.optimizers.layout import (Leaf, Static, TerminalLike, check_fits,
                                                 check_master, static)
from functional_offload.tree import check_grad, grads_of, insertion_order, plain_grad

__all__ = ["TerminalStep"]


class TerminalStep(StepBase):
    """A step of a :class:`~functional_offload.optimizers.terminal.Terminal` (see the module)."""

    def __init__(self, t: TerminalLike, state: Any, speculative: bool):
        t.check_state(state, "update")
        self.t, self.state, self.speculative = t, state, bool(speculative)
        ((_, self.n),) = claim(state, "update")  # busy from here: nobody else begins on it
        try:
            cache = state.params.cache
            if cache is not None and (cache.restore_params or cache.adopt_masters):
                after_load(state)  # what a load since the last step left (masters, params)
            self.hyper, self.hyper_no_decay = t.hyper_at(self.n)
            self.hyper_next = self._next_hyper()
            self.leaves: list[Leaf] = t.layout(state)
            cache = state.params.cache if state.params.cache is not None else StepCache()
            if cache.static is None:
                for leaf in self.leaves:  # changed between init and the first step
                    check_fits(leaf, t.spec)
                cache.static = static(self.leaves, cache.packs)
        except BaseException:
            state.count.fill_(self.n)
            raise
        self.fed: dict[int, torch.Tensor] = {}
        self.every_grad = False  # every leaf has a grad this step (the grads check found so)
        self.finished = False
        self.closed = False
        self.delayed = t.delayed
        self.cache = cache
        self.work = HostWork(t, self.leaves, cache, self.hyper, self.hyper_no_decay)
        self.form: HostForm = form_for(Case(t.delayed, t.spec.elementwise, self.speculative,
                                            t.executor.engine), self.work)

    @property
    def static(self) -> Static:
        """What steps of this layout reuse (kept in the state's cache)."""
        return self.cache.static

    # ---- the protocol ---------------------------------------------------------------------
    def feed(self, index: int, grad: torch.Tensor) -> None:
        if self.finished:
            raise RuntimeError("this step already finished; begin a new one for each update")
        leaf = self.leaves[index]
        if index in self.fed:
            raise RuntimeError(f"param {leaf.path!r} got a second gradient in one step; stream "
                               "only the last backward of an accumulation")
        if self.closed:
            raise RuntimeError(f"param {leaf.path!r} fed after close(): feed grads before it")
        g = check_grad(leaf.path, grad, leaf.param)
        if g is None:
            return
        check_master(leaf)
        self.fed[index] = g
        if self.form.starts_ahead(index):
            if not self.form.ahead:  # a param laid out anew is taken or refused before work starts
                grads_of(self.state.params.tree, self.cache).refresh()
                for other in self.leaves:  # every master must still fit its param
                    check_master(other)
            self._land_previous()
            self.form.start(index, g)

    def finish(self, grads: Any = None) -> tuple[Any, Any]:
        if self.finished:
            raise RuntimeError("this step already finished; begin a new one for each update")
        new, interrupt = shielded(self._finish, grads, settle=self._hold)
        if interrupt is not None:  # the step is applied: the state passed in holds it
            raise interrupt
        return self.state.params.tree, new

    def _finish(self, grads: Any) -> Any:
        """Check the grads, apply the step, consume the state (shielded); the new state."""
        try:
            gs = self._grads(grads)
            self._land_previous(gs)
        except BaseException:
            self.abort()
            raise
        self.finished = True
        ex = self.t.executor
        ready = ({d: ex.ready(d) for d in self.static.host_devices}
                 if len(self.form.ahead) < len(self.static.host) else {})
        try:
            new = self._apply(gs, ready)
        finally:
            del gs
            self._release()
            if self.state.params.cache is not None:  # a landed step's buffer no step took
                self.state.params.cache.landing_buffer = None
        self.state.count.fill_(CONSUMED)
        return new

    def _hold(self, new: Any) -> None:
        """An interrupt came once the step was applied: the state passed in holds the step (a
        delayed one landed first), so a checkpoint saved as the interrupt unwinds is whole."""
        if new.params.pending is not None:
            try:
                new.params.pending.land()
            finally:
                self.state.count.copy_(new.count)
        else:
            self.state.count.fill_(self.n + 1)

    def close(self) -> None:
        """No more feeds: the runs of the leaves fed so far end once their chunks are done (and
        release the device's ring); the rest goes to runs of its own at ``finish``."""
        self.closed = True
        self.form.close()

    def abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        _, interrupt = shielded(self.form.cancel)
        if self.form.handed_in_place():
            self._fail(self.form.ahead)
        else:
            self.state.count.fill_(self.n)
        self._release()
        if interrupt is not None:  # the state is in order: now the interrupt goes on
            raise interrupt

    def _release(self) -> None:
        """Drop what the step held (grads, device scratch) once it is over: a finished step
        object may live on in the caller's hands until the next one."""
        self.fed.clear()
        self.form.release()

    # ---- helpers --------------------------------------------------------------------------
    def _next_hyper(self) -> Optional[tuple[Any, Any]]:
        """A delayed step's look-ahead is of the next step: its hyperparameters, or None where
        it has none (not delayed, ``lookahead=False``, or a schedule that ends with this step:
        one that raises, or gives an invalid value, at the next count; it raises there if the
        loop goes on)."""
        t = self.t
        if t.delay is None or not t.delay.lookahead:
            return None
        try:
            return t.hyper_at(self.n + 1)
        except Exception:  # noqa: BLE001 - the next update, if any, raises it
            return None

    def _exact(self) -> bool:
        """Whether this delayed step is to be exact (:class:`~functional_offload.optimizers.
        delay.Delay`): in the warm-up, or its chain's clip scaled the grads."""
        delay = self.t.delay
        return delay is not None and (self.n < delay.warmup or (
            delay.exact_when_clipped and not self.cache.scale_was_one))

    def _lost(self, written: Any) -> list[str]:
        """The paths of the leaves in ``written`` (indices) whose param is the value updated in
        place: no master keeps what a failed step would have to undo."""
        return [self.leaves[i].path for i in sorted(written) if not self.leaves[i].has_master]

    def _fail(self, written: Any) -> None:
        """Mark the state failed; ``written``: the leaves whose step may have run in place."""
        mark_failed(self.state.count, self.state.params.cache, self._lost(written))

    def _land_previous(self, gs: Optional[list] = None) -> None:
        """A delayed step still in flight lands before this one changes anything (not at begin:
        a streamed step begins after the forward, which read the params it would change); with
        this step's grads ``gs``, a look-ahead's params are those this step is about to make."""
        pending = self.state.params.pending
        if pending is not None:
            try:
                pending.land(gs)
            except BaseException:
                self.finished = True
                if int(self.state.count) == BUSY:  # landed, then interrupted: the state is fine
                    self.state.count.fill_(self.n)
                raise  # else the landing failed and marked the state

    def _grads(self, grads: Any) -> list[Optional[torch.Tensor]]:
        """Every leaf's grad: the fed ones, the others from ``grads`` (checked). A param whose
        dtype or shape changed since the step's static part was made (``param.data = ...``,
        ``module.half()``) has it made again (the device groups, the packs' buffers)."""
        of = grads_of(self.state.params.tree, self.cache)
        given = [None] * len(self.leaves) if grads is None else of.flatten(grads)
        fed = self.fed
        if not fed and self.static.taken == of.taken and of.plain(given):
            self.every_grad = True
            return given  # the common case: every grad checked at once
        of.refresh()
        out: list[Optional[torch.Tensor]] = []
        changed = False
        for leaf, g, (dtype, shape) in zip(self.leaves, given, self.static.params):
            p = leaf.param
            same = p.dtype is dtype and p.shape == shape  # (a leaf without a grad too)
            changed = changed or not same
            if not same:
                check_fits(leaf, self.t.spec)
            if fed and len(out) in fed:
                out.append(fed[len(out)])
            elif g is None or (same and plain_grad(g, p)):
                out.append(g)  # checked quickly
            else:
                out.append(check_grad(leaf.path, g, p))
        of.check_apart(out)
        if changed:
            self.cache.invalidate("params")
            self.cache.static = static(self.leaves, self.cache.packs)
        self.cache.static = self.static._replace(taken=of.taken)
        return out

    @torch.no_grad()
    def _apply(self, gs: list, ready: dict) -> Any:
        """Apply the step (shielded, in the caller's thread: its device work is queued on the
        caller's current streams); the new state, or raise after marking this one: failed if
        anything may have been written in place, else as it was."""
        state, t, form = self.state, self.t, self.form
        touched: list = []  # the device groups' devices, once their state is being changed
        try:
            form.settle()  # a speculative step's leaves fed ahead must have succeeded first
            spec = t.spec
            run_groups(self.static.groups, gs, self.every_grad, spec.device or spec.reference,
                       [m.signed for m in spec.moments], self.hyper, self.hyper_no_decay,
                       t.ema_decay, t.executor.timeline, touched, t.device_writes, spec.device_stored)
            rest = [i for i in self.static.host if gs[i] is not None and i not in form.ahead]
            if self.delayed:  # the run takes the leaves in the order the last forward landed
                # them (fo.land), then in the params tree's insertion order (a model's forward
                # order, usually), not in optree's sorted keys
                order = [*self.cache.land_order, *insertion_order(state.params.tree)]
                rank: dict[int, int] = {}
                for k, i in enumerate(order):
                    rank.setdefault(i, k)
                rest.sort(key=rank.__getitem__)
            new_count = torch.tensor(self.n + 1, dtype=torch.int64)
            exact = self._exact()
            if not exact:
                self.work.ahead = self.hyper_next
                landed = state.params.pending  # the step this update landed, if any
                self.work.held_ahead = set() if landed is None else landed.ahead_landed()
            landing = form.finish(gs, rest, ready)
            form.commit()
            refs = state.params._replace(pending=None)  # the step it held landed before this one
            if landing is not None:
                lost = self._lost(i for i, g in enumerate(gs) if g is not None)
                pending = Pending(landing, new_count, state.params.cache, lost)
                if exact:
                    pending.land()  # before update returns: the next forward reads these params
                else:
                    refs = refs._replace(pending=pending)
            return state._replace(count=new_count, params=refs)
        except BaseException:
            form.cancel()
            if touched or form.touched():
                self._fail(i for i, g in enumerate(gs) if g is not None)
            else:
                state.count.fill_(self.n)
            raise
