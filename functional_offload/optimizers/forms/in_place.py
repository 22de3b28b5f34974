"""Element-wise host math in place, in chunks through the executor: fed leaves start at once
(grad streaming), the others at finish; small leaves run packed (one host leaf over each
pack's arenas, their grads gathered and new params scattered by multi-tensor copies), strided
and quantized params get their new values written back after the run."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_offload.executor import HostLeaf, Run
from functional_offload.optimizers.forms.base import HostWork, by_device, raise_run_errors, wait_runs
from functional_offload.optimizers.packing import Buffers, buffers, span
from functional_offload.optimizers.packing import runs as runs_of
from functional_offload.quantized import write_params, writes_in_place

__all__ = ["InPlace", "packed_leaves"]


class PackedRun(NamedTuple):
    """A run of a pack's members (``first`` to ``last`` in the pack) as one host leaf: its
    members (layout indices), the pack's buffers and where each member's elements start in the
    leaf (``at``)."""

    members: tuple[int, ...]
    buffers: Buffers
    first: int
    last: int
    at: tuple[int, ...]


def packed_leaves(work: HostWork, gs: list) -> list[tuple[HostLeaf, PackedRun]]:
    """Each run of packed members with a grad as one host leaf over its pack's arenas, with its
    :class:`PackedRun`: the members' grads are gathered into the pack's buffer here (one
    multi-tensor copy on the caller's stream); the leaf's new params go to the buffer's ``out``
    (its ``out``, whose member views ``outs[first:last + 1]`` the in-place form copies to the
    members' params once they are complete; a delayed landing gives the leaf a buffer of its
    own), with the next step's hyperparameters where the work has them (a look-ahead)."""
    leaves, out = work.leaves, []
    for k, pack in enumerate(work.cache.packs):
        pack_runs = work.static.pack_runs[k]
        if any(gs[i] is None for i in pack.members):
            pack_runs = runs_of(pack, [g is not None for g in gs], [leaf.decay for leaf in leaves],
                                [leaf.param.dtype for leaf in leaves])
        for first, last in pack_runs:
            members = pack.members[first:last + 1]
            lead, g0 = leaves[members[0]], gs[members[0]]
            key = (k, g0.device, g0.dtype)
            kept = work.cache.pack_buffers
            if key not in kept:
                kept[key] = buffers(pack, g0.device, g0.dtype,
                                    [leaves[i].param.shape for i in pack.members])
            bufs = kept[key]
            lo, hi = pack.offsets[first], pack.offsets[last] + leaves[members[-1]].param.numel()
            torch._foreach_copy_(bufs.grads[first:last + 1], [gs[i] for i in members])
            leaf = HostLeaf(f"{lead.path} (and {len(members) - 1} more small leaves)",
                            bufs.grad[lo:hi], bufs.out[lo:hi],
                            tuple(span(x, hi - lo) for x in (lead.value, *lead.moments)),
                            work.hyper_of(lead), (),
                            None if lead.ema is None else span(lead.ema, hi - lo),
                            work.t.ema_decay or 0.0,
                            ahead_hyper=None if work.ahead is None
                            else work.ahead[0 if lead.decay else 1],
                            members=tuple(leaves[m].path for m in members))
            at = tuple(pack.offsets[m] - lo for m in range(first, last + 1))
            out.append((leaf, PackedRun(members, bufs, first, last, at)))
    return out


class InPlace:
    """The in-place form (see the module)."""

    def __init__(self, work: HostWork):
        self.work = work
        self.ahead: set[int] = set()
        self.runs: dict[torch.device, Run] = {}  # the streamed runs (fed leaves)
        self.rest_runs: dict[torch.device, Run] = {}  # the runs of what finish hands over
        self.written_back: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (path, param, new)
        self.packed_out: list[PackedRun] = []
        self.closed = False

    def starts_ahead(self, index: int) -> bool:
        return self.work.leaves[index].on_host and index not in self.work.static.packed

    def ahead_leaf(self, index: int, g: torch.Tensor) -> HostLeaf:
        return self.in_place_leaf(index, g)

    def start(self, index: int, g: torch.Tensor) -> None:
        self.work.run(g.device, self.runs).add(self.ahead_leaf(index, g), self.work.ex.ready(g.device))
        self.ahead.add(index)

    def in_place_leaf(self, index: int, g: torch.Tensor) -> HostLeaf:
        leaf = self.work.leaf(index)
        out: Optional[torch.Tensor]
        if not leaf.has_master:
            out = None  # the value is the param
        elif not writes_in_place(leaf.param):  # written back after the run (a strided copy,
            #                                      or whole through a quantized param's quantizer)
            out = torch.empty(leaf.param.numel(), dtype=leaf.param.dtype, device=leaf.param.device)
            self.written_back.append((leaf.path, leaf.param, out))
        else:
            out = leaf.param.view(-1)
        return self.work.host_leaf(index, g, out)

    def close(self) -> None:
        self.closed = True
        for run in self.runs.values():
            run.close()

    def settle(self) -> None:
        pass

    def finish_runs(self) -> dict:
        """Where the leaves handed over at finish go: the streamed runs while they are open."""
        return self.rest_runs if self.closed else self.runs

    def finish(self, gs: list, rest: list[int], ready: dict) -> None:
        self.hand_over(gs, rest, ready)
        self.wait_all()

    def hand_over(self, gs: list, rest: list[int], ready: dict, threaded: bool = False) -> None:
        """Hand ``rest`` and the packed leaves with a grad to the runs (``threaded``: runs of
        their own threads, the step's thread having other work until :meth:`wait_all`)."""
        work, runs = self.work, self.finish_runs()
        params = work.static.params
        elements: dict[torch.device, int] = {}
        for i in rest:
            device = gs[i].device
            elements[device] = elements.get(device, 0) + params[i][1].numel()
        self.packed_out = self._packed_leaves(gs, runs, elements, threaded)
        packed = work.static.packed
        leaves = work.leaves
        for device, idx in by_device([i for i in rest if i not in packed], gs).items():
            # A leaf whose making allocates (a grad made contiguous, a param written back
            # whole) is made now, before anything runs, so that a failure leaves the state as
            # it was; the others are made as the run cuts them (in this thread, where the run
            # runs in it: the workers start on the first chunk meanwhile).
            early = {i: self.in_place_leaf(i, gs[i]) for i in idx
                     if not (gs[i].is_contiguous() and writes_in_place(leaves[i].param))}
            work.run(device, runs, elements, threaded).add_all(
                (early[i] if i in early else self.in_place_leaf(i, gs[i]) for i in idx),
                ready[device])

    def end_hand_over(self) -> None:
        """Nothing more is handed over: the runs end once their leaves are done (not when
        :meth:`wait_all` closes them)."""
        for run in self.finish_runs().values():
            run.close()

    def wait_all(self) -> None:
        """Wait for every run, raise the first error, order the caller's stream after the
        copies."""
        work = self.work
        wait_runs(self.finish_runs())
        wait_runs(self.runs)  # what was fed ahead (a no-op when already waited for)
        raise_run_errors(self.runs)
        raise_run_errors(self.rest_runs)
        for device in {*self.runs, *self.rest_runs}:
            work.ex.order_after_copies(device)

    def commit(self) -> None:
        """The packed runs' new params scattered to the params; strided and quantized params
        written back."""
        leaves = self.work.leaves
        for run in self.packed_out:
            torch._foreach_copy_([leaves[i].param for i in run.members],
                                 run.buffers.outs[run.first:run.last + 1])
        for path, param, new in self.written_back:
            try:
                write_params([param], [new.view(param.shape)])
            except Exception as e:  # a quantizer's error (out of memory...): name the param
                raise RuntimeError(f"writing the new values of param {path!r} failed: "
                                   f"{type(e).__name__}: {e}") from e

    def _packed_leaves(self, gs: list, runs: dict, elements: dict[torch.device, int],
                       threaded: bool = False) -> list[PackedRun]:
        """Each run of packed members with a grad (:func:`packed_leaves`) handed to ``runs``."""
        work, out = self.work, []
        for leaf, packed in packed_leaves(work, gs):
            device = leaf.grad.device
            ready = work.ex.ready(device)  # after the gather, on the caller's stream
            work.run(device, runs, elements, threaded).add(leaf, ready)
            out.append(packed)
        return out

    def all_runs(self) -> list[Run]:
        return [*self.runs.values(), *self.rest_runs.values()]

    def cancel(self) -> None:
        every = self.all_runs()
        for run in every:
            run.cancel()
        for run in every:
            run.wait()

    def in_place_runs(self) -> list[Run]:
        """The runs whose leaves write in place."""
        return self.all_runs()

    def touched(self) -> bool:
        return any(run.started for run in self.in_place_runs())

    def handed_in_place(self) -> bool:
        return bool(self.ahead)  # whether a run began is timing: handed over counts

    def release(self) -> None:
        self.written_back.clear()
        self.packed_out.clear()
        self.runs.clear()
        self.rest_runs.clear()
