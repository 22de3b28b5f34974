"""One step of a terminal optimizer (the step protocol of :mod:`functional_offload.base`).

``begin`` checks the state, lands a delayed step still in flight, computes this step's
hyperparameters and marks the state busy. ``feed`` checks a leaf's grad and, for host-resident
state, hands the leaf to an executor run at once (grad streaming). ``finish`` checks the other
grads, then applies everything shielded from interrupts
(:func:`~functional_offload.executor.shield.shielded`): device-resident leaves with the spec's
fused math, host-resident ones through the executor (or in the background, for the delayed
update).

The failure contract:

- A step completes, leaves the state as it was, or marks it :data:`~functional_offload.base.FAILED`:
  errors found before anything changed (bad grads, bad hyperparameters) leave it usable; an error
  after part of the step was applied in place marks it failed (nothing can then update, stream,
  save or checkpoint it until a checkpoint is loaded into it).
- A speculative step (``begin(state, speculative=True)``) writes the host leaves it starts ahead
  into spare buffers (``ParamRefs.spare``) and their params into device scratch; ``finish``
  swaps the buffers in (``Tensor.set_``, no copy) and copies the params, so ``abort`` leaves the
  state as it was. ``finish`` commits: from then on the leaves fed ahead whose work has not
  begun run in place (``Run.settle``), at the in-place kernel's rate; a failure after that marks
  the state failed if any leaf ran in place.
- ``KeyboardInterrupt`` / ``SystemExit`` during ``finish`` or a landing: the step is completed
  first, then the interrupt is raised; the state passed to ``update`` then holds the step (its
  count says so).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from functional_offload.base import StepBase
from functional_offload.state import BUSY, CONSUMED, claim, mark_failed, restore_params
from functional_offload.executor import HostLeaf, Run
from functional_offload.executor.delayed import Landing
from functional_offload.executor.leaves import LeafItem, run_leaves
from functional_offload.executor.shield import shielded
from functional_offload.kernels.host import host_kernel
from functional_offload.kernels.work import Kernel
from functional_offload.optimizers.packing import Buffers, Pack, buffers, span
from functional_offload.optimizers.packing import runs as runs_of
from functional_offload.tree import check_grad, grads_of, plain_grad

__all__ = ["Leaf", "TerminalStep"]


class Leaf(NamedTuple):
    """One leaf of a terminal state, as a step sees it."""

    path: str
    live: torch.Tensor  # the param as in the params tree (nn.Parameter, DTensor...)
    param: torch.Tensor  # its local tensor (the data updated)
    value: torch.Tensor  # master or the param itself
    moments: tuple[torch.Tensor, ...]
    ema: Optional[torch.Tensor]
    has_master: bool
    decay: bool  # weight decay applies
    flat: tuple[torch.Tensor, ...] = ()  # host leaves of element-wise math: (value, moments...) 1-D
    ema_flat: Optional[torch.Tensor] = None  # and the EMA, 1-D

    @property
    def on_host(self) -> bool:
        return self.value.device.type == "cpu"


def with_flat_views(leaf: Leaf) -> Leaf:
    """``leaf`` with its 1-D host views (``flat``, ``ema_flat``) made from its tensors (views do
    not follow a tensor whose storage is replaced: they are made anew when that happened)."""
    return leaf._replace(flat=(leaf.value.view(-1), *(m.view(-1) for m in leaf.moments)),
                         ema_flat=None if leaf.ema is None else leaf.ema.view(-1))


def _check_master(leaf: Leaf) -> None:
    """Refuse a leaf whose param changed dtype since ``init`` so that its master no longer
    fits it (an fp32 master made for an fp32 param that is fp64 now: ``module.double()``);
    params without a master, and low-precision params of an fp32 master, are followed."""
    p, v = leaf.param, leaf.value
    if leaf.has_master and p.dtype not in (torch.bfloat16, torch.float16) and p.dtype != v.dtype:
        raise TypeError(f"param {leaf.path!r} is {p.dtype} now, but its state keeps a {v.dtype} "
                        "master made for its dtype at init; convert it back, or make a new state "
                        "for the new dtype with opt.init(params)")


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the storages of ``a`` and ``b`` in place (both keep their identity)."""
    held = torch.empty(0, dtype=a.dtype)
    held.set_(a)
    a.set_(b)
    b.set_(held)


class _Cast:
    """Grads in their values' dtype (bf16 grads of fp32 masters): views of one buffer, shaped like
    the grads, made once. The buffer's memory is taken for a step's math and given back after it
    (its storage is resized), so nothing is held between steps and no view is made per step."""

    def __init__(self, like: list[torch.Tensor], dtype: torch.dtype, device: torch.device):
        numels = [x.numel() for x in like]
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
        self.views = [v.view(x.shape) for v, x in zip(flat.split(numels), like)]
        self.storage = flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.storage.resize_(0)

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` cast into the views (one multi-tensor copy); :meth:`release` once the math
        that reads them is queued."""
        self.storage.resize_(self.nbytes)
        torch._foreach_copy_(self.views, grads)
        return self.views

    def release(self) -> None:
        self.storage.resize_(0)


class _Group(NamedTuple):
    """Device-resident leaves that one call of the spec's device math updates: one device, one
    dtype of values and of each moment, one weight decay."""

    idx: list[int]
    values: list[torch.Tensor]
    moments: list[list[torch.Tensor]]  # per moment
    decay: bool
    device: torch.device
    written: list[int]  # positions (in idx) of the leaves with a master, whose params are written
    params: list[torch.Tensor]  # those params
    news: list[torch.Tensor]  # and their values (masters)
    emas: list[torch.Tensor]  # the leaves' EMAs, or [] without
    cast_at: list[int]  # positions (in idx) whose params' dtype is not the values'
    cast: Optional[_Cast]  # their grads in the values' dtype


class _Static(NamedTuple):
    """What a step reuses while the state's layout stays the same (kept in its notes): which
    leaves are where, the device groups, the packed leaves, the host tensors whose views the
    layout keeps and those views' addresses."""

    host: list[int]  # leaves whose state is on the host
    packed: frozenset[int]
    groups: list[_Group]
    host_devices: frozenset[torch.device]  # the devices of the host leaves' params
    viewed: list[tuple[int, torch.Tensor]]  # (leaf, tensor) per host-view
    view_ptrs: list[int]  # the address each of those views was made at
    pack_runs: list[list[tuple[int, int]]]  # per pack, its runs when every member has a grad
    params: list[tuple[torch.dtype, torch.Size]]  # per leaf, its param's dtype and shape then
    taken: int = 0  # the grads check (GradsOf.taken) that saw the params as these; while it
    #                 is the same, plain grads are checked all at once


def _viewed(leaves: list[Leaf]) -> tuple[list[tuple[int, torch.Tensor]], list[int]]:
    pairs, ptrs = [], []
    for i, leaf in enumerate(leaves):
        if leaf.flat:
            views = (*leaf.flat, *(() if leaf.ema_flat is None else (leaf.ema_flat,)))
            tensors = (leaf.value, *leaf.moments, *(() if leaf.ema is None else (leaf.ema,)))
            pairs += [(i, x) for x in tensors]
            ptrs += [v.data_ptr() for v in views]
    return pairs, ptrs


def _static(leaves: list[Leaf], packs: list[Pack]) -> _Static:
    keyed: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if not leaf.on_host:
            key = (leaf.value.device, leaf.value.dtype,
                   tuple(None if m is None else m.dtype for m in leaf.moments), leaf.decay)
            keyed.setdefault(key, []).append(i)
    groups = []
    for (device, dtype, *_, decay), idx in keyed.items():
        written = [k for k, i in enumerate(idx) if leaves[i].has_master]
        cast_at = [k for k, i in enumerate(idx) if leaves[i].param.dtype != dtype]
        groups.append(_Group(
            idx, [leaves[i].value for i in idx],
            [[leaves[i].moments[j] for i in idx] for j in range(len(leaves[idx[0]].moments))],
            decay, device, written, [leaves[idx[k]].param for k in written],
            [leaves[idx[k]].value for k in written],
            [leaves[i].ema for i in idx if leaves[i].ema is not None], cast_at,
            _Cast([leaves[idx[k]].param for k in cast_at], dtype, device) if cast_at else None))
    host = [i for i, leaf in enumerate(leaves) if leaf.on_host]
    decays = [leaf.decay for leaf in leaves]
    return _Static(host, frozenset(i for pack in packs for i in pack.members), groups,
                   frozenset(leaves[i].param.device for i in host), *_viewed(leaves),
                   [runs_of(pack, [True] * len(leaves), decays) for pack in packs],
                   [(leaf.param.dtype, leaf.param.shape) for leaf in leaves])


class _Pending:
    """A delayed step in flight (``ParamRefs.pending``): :meth:`land` applies it, :meth:`settle`
    waits for it and drops its result (before a checkpoint is loaded over the state)."""

    def __init__(self, landing: Landing, count: torch.Tensor, notes: Optional[dict], lost: list[str]):
        self.landing, self.count, self.notes, self.lost = landing, count, notes, lost
        self.done = False
        self.error: Optional[BaseException] = None

    def land(self) -> None:
        if self.done:
            if self.error is not None:
                raise self.error
            return
        ex, device = self.landing.ex, self.landing.device
        ready = ex.ready(device)  # the caller's reads of the old params come first
        try:
            _, interrupt = shielded(self.landing.land, ready)
        except BaseException as e:
            self.done, self.error = True, e
            mark_failed(self.count, self.notes, self.lost)
            raise
        finally:
            ex.order_after_copies(device)
        self.done = True
        if interrupt is not None:
            raise interrupt

    def settle(self) -> None:
        self.done, self.error = True, None  # dropped: a load overwrites what it would land
        _, interrupt = shielded(self.landing.run.wait)
        if interrupt is not None:
            raise interrupt


class TerminalStep(StepBase):
    """A step of a :class:`~functional_offload.optimizers.terminal.Terminal` (see the module)."""

    def __init__(self, t: Any, state: Any, speculative: bool):
        t.check_state(state, "update")
        self.t, self.state, self.speculative = t, state, bool(speculative)
        ((_, self.n),) = claim(state, "update")  # busy from here: nobody else begins on it
        try:
            if state.params.notes and state.params.notes.get("restore_params"):
                restore_params(state)  # loaded into a failed state in place (DCP) since
            self.hyper, self.hyper0 = t.hyper_at(self.n)
            self.leaves: list[Leaf] = t.layout(state)
        except BaseException:
            state.count.fill_(self.n)
            raise
        self.ex = t.executor
        self.fed: dict[int, torch.Tensor] = {}
        self.ahead: set[int] = set()  # fed host leaves already handed to a run
        self.forms: dict[int, int] = {}  # id of each speculative host leaf handed over -> its leaf
        self.scratch: dict[int, torch.Tensor] = {}  # speculative: new params awaiting commit
        self.strided: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its new values)
        self.runs: dict[torch.device, Run] = {}
        self._kernel: Optional[Kernel] = None
        self._views_checked = False
        self.every_grad = False  # every leaf has a grad this step (the grads check found so)
        self.finished = False
        self.closed = False
        self.delayed = t.delayed
        notes = state.params.notes if state.params.notes is not None else {}
        self.notes = notes
        self.packs: list[Pack] = notes.get("packs", [])
        kept = notes.get("static")
        if kept is None or kept[0] is not self.leaves:
            kept = notes["static"] = (self.leaves, _static(self.leaves, self.packs))
        self.static: _Static = kept[1]
        self.packed = self.static.packed

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
        _check_master(leaf)
        self.fed[index] = g
        if self._starts_ahead(leaf, index):
            if not self.ahead:  # a param laid out anew is taken or refused before work starts
                grads_of(self.state.params.tree, self.notes).refresh()
            self._land_previous()
            form = self._host_leaf(index, g, ahead=True)
            self.forms[id(form)] = index
            self._run(g.device).add(form, self.ex.ready(g.device))
            self.ahead.add(index)

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
            self._land_previous()
        except BaseException:
            self.abort()
            raise
        self.finished = True
        ready = ({d: self.ex.ready(d) for d in self.static.host_devices}
                 if len(self.ahead) < len(self.static.host) else {})
        try:
            new = self._apply(gs, ready)
        finally:
            del gs
            self._release()
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
        for run in self.runs.values():
            run.close()

    def abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        for run in self.runs.values():
            run.cancel()
        _, interrupt = shielded(self._wait_runs, self.runs)
        if self.ahead and not self.speculative:  # handed over in place: whether a run began
            #                                     is timing, so the state is failed either way
            self._fail(self.ahead)
        else:
            self.state.count.fill_(self.n)
        self._release()
        if interrupt is not None:  # the state is in order: now the interrupt goes on
            raise interrupt

    def _release(self) -> None:
        """Drop what the step held (grads, device scratch) once it is over: a finished step
        object may live on in the caller's hands until the next one."""
        self.fed.clear()
        self.scratch.clear()
        self.forms.clear()
        self.strided.clear()
        self.runs.clear()

    # ---- helpers --------------------------------------------------------------------------
    def _lost(self, written: Any) -> list[str]:
        """The paths of the leaves in ``written`` (indices) whose param is the value updated in
        place: no master keeps what a failed step would have to undo."""
        return [self.leaves[i].path for i in sorted(written) if not self.leaves[i].has_master]

    def _fail(self, written: Any) -> None:
        """Mark the state failed; ``written``: the leaves whose step may have run in place."""
        mark_failed(self.state.count, self.state.params.notes, self._lost(written))

    def _land_previous(self) -> None:
        """A delayed step still in flight lands before this one changes anything (not at begin:
        a streamed step begins after the forward, which read the params it would change)."""
        pending = self.state.params.pending
        if pending is not None:
            try:
                pending.land()
            except BaseException:
                self.finished = True
                if int(self.state.count) == BUSY:  # landed, then interrupted: the state is fine
                    self.state.count.fill_(self.n)
                raise  # else the landing failed and marked the state

    def _starts_ahead(self, leaf: Leaf, index: int) -> bool:
        """A fed leaf starts at once if its state is on the host (and, speculatively, if its new
        value can go to spare buffers: it has a master); the delayed update starts at finish,
        leaf-granular math at finish too."""
        return (leaf.on_host and not self.t.delayed and self.t.spec.elementwise
                and (leaf.has_master or not self.speculative) and index not in self.packed)

    def _grads(self, grads: Any) -> list[Optional[torch.Tensor]]:
        """Every leaf's grad: the fed ones, the others from ``grads`` (checked). A param whose
        dtype or shape changed since the step's static part was made (``param.data = ...``,
        ``module.half()``) has it made again (the device groups, the packs' buffers)."""
        of = grads_of(self.state.params.tree, self.notes)
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
                _check_master(leaf)
            if fed and len(out) in fed:
                out.append(fed[len(out)])
            elif g is None or (same and plain_grad(g, p)):
                out.append(g)  # checked quickly
            else:
                out.append(check_grad(leaf.path, g, p))
        if changed:
            for key in [k for k in self.notes if isinstance(k, tuple) and k[0] == "pack"]:
                del self.notes[key]
            self.static = _static(self.leaves, self.packs)
            self.notes["static"] = (self.leaves, self.static)
        self.static = self.static._replace(taken=of.taken)
        self.notes["static"] = (self.leaves, self.static)
        return out

    def _check_views(self) -> bool:
        """Once per step, before a host leaf is handed over: remake the 1-D views of the host
        leaves whose tensors' storages were replaced since (a committed speculative step swaps
        them; ``param.data = ...`` or ``state.mu[k].data = ...`` replace them). True if any was."""
        if self._views_checked:
            return False
        self._views_checked = True
        st = self.static
        if [x.data_ptr() for _, x in st.viewed] == st.view_ptrs:
            return False
        for i in sorted({i for (i, x), ptr in zip(st.viewed, st.view_ptrs) if x.data_ptr() != ptr}):
            self.leaves[i] = with_flat_views(self.leaves[i])  # the layout's list: kept for later steps
        st.viewed[:], st.view_ptrs[:] = _viewed(self.leaves)
        return True

    def _kernel_for_run(self) -> Kernel:
        """The host kernel of these leaves, kept in the state's notes with their layout while
        the leaves' tensors, the spec and ``cpu_kernel`` stay the same."""
        if self._kernel is None:
            replaced = self._check_views()
            key = (self.leaves, self.t.spec, self.t.cpu_kernel)
            kept = self.notes.get("kernel")
            if kept is not None and not replaced and all(a is b for a, b in zip(kept[0], key)):
                self._kernel = kept[1]
            else:
                spec = self.t.spec
                self._kernel = host_kernel(spec.native, spec.scalars, spec.reference,
                                           [lf.flat for lf in self.leaves if lf.on_host],
                                           self.t.cpu_kernel)
                self.notes["kernel"] = (key, self._kernel)
        return self._kernel

    def _run(self, device: torch.device, runs: Optional[dict] = None,
             elements: Optional[dict[torch.device, int]] = None) -> Run:
        """The run of ``device`` in ``runs`` (the streamed runs by default), opened if needed;
        ``elements``: per device, the total of a run whose leaves are all handed over now."""
        runs = self.runs if runs is None else runs
        if device not in runs:
            runs[device] = self.ex.open(device, self._kernel_for_run(), self.t.threads,
                                        elements=None if elements is None else elements[device])
        return runs[device]

    def _spare(self, index: int) -> tuple[torch.Tensor, ...]:
        """Host buffers like the leaf's (value, moments..., ema), kept for later steps."""
        spares = self.state.params.spare
        leaf = self.leaves[index]
        if index not in spares:
            spares[index] = tuple(torch.empty_like(x) for x in (leaf.value, *leaf.moments)
                                  + ((leaf.ema,) if leaf.ema is not None else ()))
        return spares[index]

    def _host_leaf(self, index: int, g: torch.Tensor, ahead: bool) -> HostLeaf:
        self._kernel_for_run()  # first: it checks the leaves' views and picks their kernel
        leaf = self.leaves[index]
        hyper = self.hyper if leaf.decay else self.hyper0
        targets: tuple[torch.Tensor, ...] = ()
        ema_target = settled = None
        if not leaf.has_master or self.t.delayed:
            out = None  # the value is the param; delayed: the landing gives it a buffer
        elif ahead and self.speculative:
            spare = self._spare(index)
            k = 1 + len(leaf.moments)
            targets = tuple(x.view(-1) for x in spare[:k])
            ema_target = spare[k].view(-1) if leaf.ema is not None else None
            out = self.scratch[index] = torch.empty(leaf.param.numel(), dtype=leaf.param.dtype,
                                                    device=leaf.param.device)
            if out.is_cuda:  # freed on abort while a copy out may still write it
                out.record_stream(self.ex.transport(out.device).stream_out)
            if leaf.param.is_contiguous():  # once the step is known to commit: in place
                settled = self._host_leaf(index, g, False)
        elif not leaf.param.is_contiguous():  # written back after the run (a strided copy)
            out = torch.empty(leaf.param.numel(), dtype=leaf.param.dtype, device=leaf.param.device)
            self.strided.append((leaf.param, out))
        else:
            out = leaf.param.view(-1)
        grad = (g.detach() if g.requires_grad else g).reshape(-1)
        if grad.device.type == "cpu" and not grad.is_contiguous():
            grad = grad.contiguous()  # read where it is by the kernel, which takes dense grads
        return HostLeaf(leaf.path, grad, out,
                        leaf.flat, hyper, targets, leaf.ema_flat, self.t.ema_decay or 0.0, ema_target,
                        settled)

    def _packed_leaves(self, gs: list, runs: dict,
                       elements: dict[torch.device, int]) -> list[tuple[tuple[int, ...], Buffers, int, int]]:
        """Each run of packed members with a grad: grads gathered into the pack's buffer (one
        multi-tensor copy), handed to ``runs`` as one host leaf over the arenas. Returns
        ``(members, buffers, first, last)`` per run (its positions in the pack), for
        :meth:`_scatter`."""
        out = []
        for k, pack in enumerate(self.packs):
            pack_runs = self.static.pack_runs[k]
            if any(gs[i] is None for i in pack.members):
                pack_runs = runs_of(pack, [g is not None for g in gs], [leaf.decay for leaf in self.leaves])
            for first, last in pack_runs:
                members = pack.members[first:last + 1]
                lead, g0 = self.leaves[members[0]], gs[members[0]]
                key = ("pack", k, g0.device, g0.dtype)
                if key not in self.notes:
                    self.notes[key] = buffers(pack, g0.device, g0.dtype,
                                              [self.leaves[i].param.shape for i in pack.members])
                bufs = self.notes[key]
                lo, hi = pack.offsets[first], pack.offsets[last] + self.leaves[members[-1]].param.numel()
                torch._foreach_copy_(bufs.grads[first:last + 1], [gs[i] for i in members])
                ready = self.ex.ready(g0.device)  # after the gather, on the caller's stream
                hyper = self.hyper if lead.decay else self.hyper0
                leaf = HostLeaf(f"{lead.path} (and {len(members) - 1} more small leaves)",
                                bufs.grad[lo:hi], bufs.out[lo:hi],
                                tuple(span(x, hi - lo) for x in (lead.value, *lead.moments)), hyper,
                                (), None if lead.ema is None else span(lead.ema, hi - lo),
                                self.t.ema_decay or 0.0)
                self._run(g0.device, runs, elements).add(leaf, ready)
                out.append((members, bufs, first, last))
        return out

    def _scatter(self, packed: list) -> None:
        """The packed runs' new params to the params (after the copies out are ordered)."""
        for members, bufs, first, last in packed:
            torch._foreach_copy_([self.leaves[i].param for i in members], bufs.outs[first:last + 1])

    @staticmethod
    def _by_device(idx: list[int], gs: list) -> dict[torch.device, list[int]]:
        out: dict[torch.device, list[int]] = {}
        for i in idx:
            out.setdefault(gs[i].device, []).append(i)
        return out

    def _leaf_item(self, index: int, g: torch.Tensor) -> LeafItem:
        """A host leaf of a leaf-granular optimizer: its math runs on the whole leaf."""
        leaf = self.leaves[index]
        hyper = self.hyper if leaf.decay else self.hyper0
        spec, decay = self.t.spec, self.t.ema_decay

        def fn(grad: torch.Tensor, out: Optional[torch.Tensor]) -> None:
            spec.reference([leaf.value], [grad], [[m] for m in leaf.moments], hyper)
            if out is not None:
                out.copy_(leaf.value)
            if leaf.ema is not None:
                leaf.ema.lerp_(leaf.value, 1 - (decay or 0.0))

        return LeafItem(leaf.path, g, leaf.param if leaf.has_master else None, fn)

    @staticmethod
    def _wait_runs(runs: dict) -> None:
        for run in runs.values():
            run.close()
        for run in runs.values():
            run.wait()

    @staticmethod
    def _raise_run_errors(runs: dict) -> None:
        for run in runs.values():
            if run.error is not None:
                raise run.error

    def _device_math(self, gs: list) -> bool:
        """Device-resident leaves with a grad, grouped by device, dtypes and weight decay;
        whether any was updated."""
        spec, tl = self.t.spec, self.ex.timeline
        math = spec.device or spec.reference
        touched = False
        for grp in self.static.groups:
            grads = [gs[i] for i in grp.idx]
            values, moments, params, news, emas = grp.values, grp.moments, grp.params, grp.news, grp.emas
            cast = grp.cast
            if not self.every_grad and any(g is None for g in grads):
                # leaves without a grad this step are left out, the others cast one by one
                cast = None
                grads = [g if g is None or g.dtype == v.dtype else g.to(v.dtype) for g, v in zip(grads, values)]
                keep = [k for k, g in enumerate(grads) if g is not None]
                if not keep:
                    continue
                kept = set(keep)
                grads, values = [grads[k] for k in keep], [values[k] for k in keep]
                moments = [[m[k] for k in keep] for m in moments]
                params = [p for k, p in zip(grp.written, grp.params) if k in kept]
                news = [v for k, v in zip(grp.written, grp.news) if k in kept]
                emas = [emas[k] for k in keep] if emas else []
            touched = True
            s0 = tl.stamp(grp.device) if tl else None
            try:
                if cast is not None:
                    if len(grp.cast_at) == len(grads):
                        grads = cast(grads)
                    else:
                        grads = list(grads)
                        for k, g in zip(grp.cast_at, cast([grads[k] for k in grp.cast_at])):
                            grads[k] = g
                math(values, grads, moments, self.hyper if grp.decay else self.hyper0)
            finally:
                if cast is not None:
                    cast.release()  # after the math is queued: the stream orders its reuse
            if params:
                torch._foreach_copy_(params, news)
            if emas:
                torch._foreach_lerp_(emas, [v if v.dtype == e.dtype else v.to(e.dtype)
                                            for v, e in zip(values, emas)],
                                     1 - (self.t.ema_decay or 0.0))
            if tl:
                tl.span("GPU update", f"{len(grads)} leaves", s0, tl.stamp(grp.device))
        return touched

    @torch.no_grad()
    def _apply(self, gs: list, ready: dict) -> Any:
        """Apply the step (shielded, in the caller's thread: its device work is queued on the
        caller's current streams); the new state, or raise after marking this one: failed if
        anything may have been written in place, else as it was."""
        state, t = self.state, self.t
        touched = False
        packed_out: list = []
        rest_runs: dict[torch.device, Run] = {}  # a speculative step's in-place leaves
        try:
            if self.speculative and self.runs:  # what ran ahead must have succeeded first
                for run in self.runs.values():  # finishing commits: what has not begun runs in place
                    run.settle()
                self._wait_runs(self.runs)
                self._raise_run_errors(self.runs)
            touched = self._device_math(gs)
            rest = [i for i in self.static.host if gs[i] is not None and i not in self.ahead]
            new_count = torch.tensor(self.n + 1, dtype=torch.int64)
            refs = state.params
            if rest and t.delayed:
                landing = Landing(self.ex, [self._host_leaf(i, gs[i], False) for i in rest],
                                  self._kernel_for_run(),
                                  [self.leaves[i].param.view(-1) if self.leaves[i].has_master else None
                                   for i in rest], t.threads)
                touched = True  # the run has started (a failure before, e.g. allocating, changed nothing)
                refs = refs._replace(pending=_Pending(landing, new_count, self.notes,
                                                      self._lost(i for i, g in enumerate(gs) if g is not None)))
            elif rest and not t.spec.elementwise:
                begun: list[str] = []
                try:
                    for device, idx in self._by_device(rest, gs).items():
                        run_leaves(self.ex, device, [self._leaf_item(i, gs[i]) for i in idx],
                                   ready[device], begun)
                        self.ex.order_after_copies(device)
                finally:
                    touched = touched or bool(begun)
            else:
                runs = rest_runs if self.speculative or self.closed else self.runs
                elements: dict[torch.device, int] = {}
                for i in rest:
                    device = gs[i].device
                    elements[device] = elements.get(device, 0) + self.static.params[i][1].numel()
                packed_out = self._packed_leaves(gs, runs, elements)
                for device, idx in self._by_device([i for i in rest if i not in self.packed], gs).items():
                    self._run(device, runs, elements).add_all(
                        [self._host_leaf(i, gs[i], False) for i in idx], ready[device])
                self._wait_runs(runs)
            self._wait_runs(self.runs)  # what was fed ahead (a no-op when already waited for)
            self._raise_run_errors(self.runs)
            self._raise_run_errors(rest_runs)
            for device in {*self.runs, *rest_runs}:
                self.ex.order_after_copies(device)
            if packed_out:
                self._scatter(packed_out)
            for param, new in self.strided:
                param.copy_(new.view(param.shape))
            if self.speculative and self.ahead:
                touched = True
                self._commit()
            return state._replace(count=new_count, params=refs)
        except BaseException:
            every = [*self.runs.values(), *rest_runs.values()]
            for run in every:
                run.cancel()
            for run in every:
                run.wait()
            in_place = [*rest_runs.values(), *(r for r in self.runs.values()
                                               if not self.speculative or r.switched)]
            if touched or any(run.started for run in in_place):
                self._fail(i for i, g in enumerate(gs) if g is not None)
            else:
                state.count.fill_(self.n)
            raise

    def _commit(self) -> None:
        """Speculative step: swap the spare buffers in, copy the new params to the device."""
        spares = self.state.params.spare
        switched = {self.forms[id(form)] for run in self.runs.values() for form in run.switched}
        for i in sorted(self.ahead):
            leaf = self.leaves[i]
            if i in switched:  # ran in place
                self.scratch.pop(i, None)
                continue
            mine = (leaf.value, *leaf.moments) + ((leaf.ema,) if leaf.ema is not None else ())
            for a, b in zip(mine, spares[i]):
                _swap(a, b)
        by_device: dict[torch.device, list[int]] = {}
        for i in self.scratch:
            by_device.setdefault(self.leaves[i].param.device, []).append(i)
        for device, idx in by_device.items():
            torch._foreach_copy_([self.leaves[i].param for i in idx],  # strided ones too
                                 [self.scratch[i].view(self.leaves[i].param.shape) for i in idx])
            for i in idx:
                if device.type == "cuda":
                    self.scratch[i].record_stream(torch.cuda.current_stream(device))
        self.scratch.clear()

