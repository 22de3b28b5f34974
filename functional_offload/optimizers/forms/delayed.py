"""The delayed update (``delayed=True``): the host leaves' step runs in the background while
the training loop goes on, their new params waiting in buffers (:class:`~functional_offload.
executor.delayed.Landing`); the next step, a flush or a checkpoint lands them
(:class:`Pending`, the state's ``ParamRefs.pending``). The small leaves run packed
(:mod:`~functional_offload.optimizers.packing`): a run of a pack's members is one leaf of the
landing, whose params are the members' (each landed as a leaf of its own would be, with its own
grad for a look-ahead)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import torch

from functional_offload.base import StepCache
from functional_offload.state import mark_failed, missed_landing
from functional_offload.executor.delayed import Landing
from functional_offload.executor.shield import shielded
from functional_offload.optimizers.forms.base import AtFinish, HostWork
from functional_offload.optimizers.forms.gpu_engine import GpuEngine, Prepared
from functional_offload.optimizers.forms.in_place import packed_leaves
from functional_offload.optimizers.forms.split import Division, divide, engine_steps, record
from functional_offload.optimizers.spec import land
from functional_offload.quantized import write_params
from functional_offload.tree import local

__all__ = ["Delayed", "DelayedEngine", "Flight", "Pending"]


class Flight(NamedTuple):
    """A delayed step's landing and, per leaf of the landing, the state's leaves whose params
    it updates (layout indices: one, or a run of a pack's members, in the order of the
    landing's ``targets``); ``landed``: called once it landed without an error (a split
    step's record)."""

    landing: Landing
    members: list[tuple[int, ...]]
    landed: Optional[Callable[[], None]] = None


class DelayedEngine:
    """The GPU engine's part of a delayed step (:class:`~functional_offload.executor.delayed.
    EngineJob`): the layout's leaves ``idx``, at positions ``leaves`` of the landing."""

    def __init__(self, work: HostWork, idx: list[int], leaves: list[int]):
        self.engine, self.idx, self.leaves = GpuEngine(work), idx, leaves
        self.size = len(work.leaves)
        self.prepared: list[Prepared] = []

    def prepare(self, grads: dict[int, torch.Tensor], outs: dict[int, torch.Tensor]) -> None:
        gs: list[Optional[torch.Tensor]] = [None] * self.size
        for i, j in zip(self.idx, self.leaves):
            gs[i] = grads[j]
        self.prepared = self.engine.prepare(gs, self.idx,
                                            {i: outs[j] for i, j in zip(self.idx, self.leaves)},
                                            beside=True)

    def run(self, done: Callable[[list[tuple[int, int, int]]], None]) -> None:
        at = dict(zip(self.idx, self.leaves))
        try:
            self.engine.run_prepared(self.prepared, lambda chunk: done(
                [(at[p.index], p.lo, p.hi) for p in chunk.pieces]))
        finally:
            self.prepared = []  # the device buffers go once every copy landed
            self.engine.release()


def _elements_of(t: torch.Tensor) -> tuple:
    """Where ``t``'s elements are: its storage, offset, shape and strides (a view of a param, or
    its ``.data``, has the param's)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _memory(t: torch.Tensor) -> tuple:
    """Which memory ``t`` is, whatever its shape: its storage, offset, element count and dtype."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)


class Pending:
    """A delayed step in flight (``ParamRefs.pending``): :meth:`land` applies it, :meth:`settle`
    waits for it and drops its result (before a checkpoint is loaded over the state).
    ``flight``: its landing and the state's leaves (in the layout's order) each of the
    landing's leaves updates."""

    def __init__(self, flight: Flight, count: torch.Tensor, cache: Optional[StepCache],
                 lost: list[str]):
        self.landing, self.count, self.cache, self.lost = flight.landing, count, cache, lost
        self.members, self._landed_fn = flight.members, flight.landed
        # where the landing writes each param (a layout index's): its memory at the step; a
        # param given other memory since gets what was landed there (_land_moved)
        self._targets = {i: p for m, t in zip(self.members, self.landing.targets)
                         if t is not None for i, (_, p) in zip(m, t)}
        self._moved: set[int] = set()  # the params _land_moved copied to
        self.done = False
        self.error: Optional[BaseException] = None
        self._where: Optional[dict[tuple, tuple[int, int]]] = None  # a param's memory -> its
        #                                       landing leaf's position and its layout index
        self._asked: set[int] = set()  # the layout indices land_params was given the params of
        self._early = False  # land_params was called: every leaf read is to land before
        self._on_failure: list[Callable[[], None]] = []

    def land(self, grads: Optional[list] = None) -> None:
        """Apply the step; ``grads``: the next step's grads of every leaf of the layout (a
        look-ahead's landing takes them, :class:`~functional_offload.executor.delayed.Landing`),
        or None (the params land exactly)."""
        if self.done:
            if self.error is not None:
                raise self.error
            return
        ready = self.landing.ex.ready(self.landing.device)  # the caller's reads of the old
        #                                                      params come first
        mine = None if grads is None else [[grads[i] for i in m] for m in self.members]
        missed = [] if grads is None else self.missed(grads)
        keep = grads is not None and self.cache is not None  # an update lands it: its own
        interrupt = self._shielded(self.landing.land, ready, mine, keep)  # delayed step may
        self._land_moved([i for m in self.members for i in m])  # reuse the buffer
        self.done, self._on_failure = True, []  # (the callbacks hold other parts' states)
        if self._landed_fn is not None:
            self._landed_fn, landed = None, self._landed_fn
            landed()
        buf = self.landing.take_buffer() if keep else None
        if buf is not None and interrupt is None and not missed:
            self.cache.landing_buffer = buf
        del buf
        if interrupt is not None:
            raise interrupt
        if missed:  # landed now (the state is whole), but the forward read these params before
            raise missed_landing(missed)

    def missed(self, grads: list) -> list[str]:
        """The paths of the leaves with a grad in ``grads`` (per leaf of the layout) that were
        not landed before the forward, once :meth:`land_params` was used: what :meth:`land`
        with these grads refuses (after landing)."""
        if self.done or not self._early:
            return []
        layout = self.cache.layout if self.cache is not None else None
        return [layout[i].path if layout is not None else f"#{i}"
                for m in self.members for i in m if grads[i] is not None and i not in self._asked]

    def land_params(self, params: list[torch.Tensor]) -> None:
        """Land the leaves of ``params`` (tensors sharing the memory of the params tree's, or of
        their local shards) before the rest, as :meth:`land` would (see
        :meth:`~functional_offload.executor.delayed.Landing.land_leaves`); others are ignored.
        From then on :meth:`land` raises, once it has landed the rest, if a leaf with a grad in
        the next step was not landed here first (the forward read it before it landed)."""
        if self.done:
            if self.error is not None:
                raise self.error
            return
        if self.landing.ahead is not None:
            raise ValueError("the update in flight has a look-ahead, whose params land with the "
                             "next step's grads, all at once: land params before the forward "
                             "only with delayed=fo.Delay(lookahead=False)")
        self._early = True
        if self._where is None:
            layout = self.cache.layout if self.cache is not None else None
            if layout is None:  # which leaf is which is not known here any more: land all
                self.land()
                return
            self._where = {_elements_of(layout[i].param): (j, i)
                           for j, m in enumerate(self.members) for i in m}
        hits = [h for h in (self._where.get(_elements_of(local(p))) for p in params) if h is not None]
        self._asked.update(i for _, i in hits)  # (a packed run's other members are not asked)
        which = [j for j in dict.fromkeys(j for j, _ in hits) if j not in self.landing.landed_early]
        if which:
            if self.cache is not None:  # the next delayed step runs its leaves in this order
                if not self.landing.landed_early:
                    self.cache.land_order = []
                self.cache.land_order.extend(i for j in which for i in self.members[j])
            if not self.landing.note_landed(which):  # (else copied with an earlier module's)
                interrupt = self._shielded(self.landing.land_leaves, which, order=False)
                if interrupt is not None:
                    raise interrupt
        self._land_moved([i for _, i in hits])

    @torch.no_grad()
    def _land_moved(self, which: list[int]) -> None:
        """The params of ``which`` (layout indices) given other memory since the step
        (``param.data = ...``: a cast, a copy, a reshape), whose landing wrote their memory at
        the step: what it wrote copied to them (cast to their dtype), as if the step had landed
        before the change, on the caller's stream (after the landing's copies). A param whose
        element count changed is left to the next update, which refuses it."""
        layout = self.cache.layout if self.cache is not None else None
        if layout is None:
            return
        moved = [i for i in which if i in self._targets and i not in self._moved
                 and _memory(layout[i].param) != _memory(self._targets[i])
                 and layout[i].param.numel() == self._targets[i].numel()]
        if moved:
            self._moved.update(moved)
            write_params([layout[i].param for i in moved],
                         [self._targets[i].view(layout[i].param.shape) for i in moved])

    def _shielded(self, fn: Callable[..., None], *args: Any,
                  order: bool = True) -> Optional[BaseException]:
        """``fn(*args)``, a landing, run shielded: on its error the step is failed (the state
        marked) and the error raised; an interrupt that arrived meanwhile is returned. The
        caller's stream is then ordered after the copies issued (``order=False``: only after an
        error; ``fn`` orders it itself)."""
        ex, device = self.landing.ex, self.landing.device
        try:
            _, interrupt = shielded(fn, *args)
        except BaseException as e:
            ex.order_after_copies(device)
            self.done, self.error = True, e
            mark_failed(self.count, self.cache, self.lost)
            called, self._on_failure = self._on_failure, []
            for fn in called:
                fn()
            raise
        if order:
            ex.order_after_copies(device)
        return interrupt

    def on_failure(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` if the step is found to have failed (once the state is marked)."""
        self._on_failure.append(fn)

    def ahead_landed(self) -> set[int]:
        """The state's leaves whose params its landing set from a look-ahead."""
        return {self.members[j][k] for j, k in self.landing.ahead_landed}

    def settle(self) -> None:
        self.done, self.error = True, None  # dropped: a load overwrites what it would land
        self._on_failure, self._landed_fn = [], None
        _, interrupt = shielded(self.landing.wait)
        self.landing.take_buffer()  # dropped
        if interrupt is not None:
            raise interrupt


class Delayed(AtFinish):
    """The delayed form (see the module): nothing starts before finish, which starts the run
    and returns its :class:`Flight` (with look-aheads where the step's work has the next
    step's hyperparameters, ``HostWork.ahead``); the step's count and lost params make it
    :class:`Pending`. Without a look-ahead, an executor's ``engine="gpu"`` steps every leaf on
    the device (:class:`DelayedEngine`; small ones too, unpacked, as its plain steps do),
    ``"both"`` the leaves of the planned share (:func:`~functional_offload.optimizers.forms.split.divide`, measured at the
    landing as the plain split steps are)."""

    def __init__(self, work: HostWork):
        super().__init__(work)
        self.started = False

    def finish(self, gs: list, rest: list[int], ready: dict) -> Optional[Flight]:
        if not rest:
            return None
        work = self.work
        every = work.ex.engine == "gpu" and work.ahead is None  # the engine steps every leaf
        runs = packed_leaves(work, gs) if work.cache.packs and not every else []
        run_of = {i: k for k, (_, run) in enumerate(runs) for i in run.members}
        owned = work.cache.owned_grads or {}  # grads nothing else holds: the landing's to keep
        leaves, targets, members, own = [], [], [], []
        for i in rest:  # a packed run at its first member's place in the order
            if i in run_of:
                leaf, run = runs[run_of.pop(i)]
                for m in run.members:
                    run_of.pop(m, None)
                leaves.append(leaf._replace(out=None))
                targets.append([(at, work.leaves[m].param.view(-1))
                                for at, m in zip(run.at, run.members)])
                members.append(run.members)
                own.append(False)
            elif every or i not in work.static.packed:
                leaves.append(work.host_leaf(i, gs[i], None))
                targets.append([(0, work.leaves[i].param.view(-1))] if work.leaves[i].has_master
                               else None)
                members.append((i,))
                own.append(owned.get(id(gs[i])) is gs[i])
        division, engine = self._engine(gs, members)
        reuse = [work.cache.landing_buffer] if work.cache.landing_buffer is not None else []
        work.cache.landing_buffer = None  # (the landing takes it from the list, or lets it go)
        landing = Landing(work.ex, leaves, work.kernel(), targets, work.t.threads,
                          ahead=(None if work.ahead is None
                                 else partial(land, work.t.spec.land_ahead)),
                          fresh=[[m not in work.held_ahead for m in run] for run in members],
                          engine=engine, buffer=reuse, own=own)
        self.started = True  # (a failure before, e.g. allocating, changed nothing)
        landed = None
        if division is not None:
            stepped = [None if g is None else True for g in gs]  # (not the grads: they go now)

            def landed() -> None:
                record(work, division, stepped, landing.began, landing.engine_ended_at,
                       landing.run.ended_at)
        return Flight(landing, members, landed)

    def _engine(self, gs: list, members: list[tuple[int, ...]]
                ) -> tuple[Optional[Division], Optional[DelayedEngine]]:
        """The GPU engine's part, with ``engine="gpu"`` or ``"both"`` and no look-ahead: the
        leaves it steps (of the landing's ``members``) and, with ``"both"``, the division."""
        work = self.work
        if work.ex.engine == "cpu" or work.ahead is not None:
            return None, None
        if work.ex.engine == "gpu":  # every leaf, as its plain steps (init refused the others)
            able = [i for i, leaf in enumerate(work.leaves) if leaf.on_host and leaf.has_master]
        else:
            able = [i for i, leaf in enumerate(work.leaves)
                    if leaf.on_host and leaf.has_master and engine_steps(work, i)]
        division = divide(work, able) if work.ex.engine == "both" else None
        on_gpu = set(able) if division is None else division.on_gpu
        at = [(m[0], j) for j, m in enumerate(members)
              if len(m) == 1 and m[0] in on_gpu and gs[m[0]] is not None]
        if not at:
            return division, None
        return division, DelayedEngine(work, [i for i, _ in at], [j for _, j in at])

    def touched(self) -> bool:
        return self.started
