"""Host-resident leaves stepped on their params' GPU (``HostExecutor(engine="gpu")``): their
state (value, moments, EMA) goes up to the device in chunks, the spec's device math runs there
on the grads already in HBM (:func:`~functional_offload.optimizers.device_math.run_groups`, as
for device-resident leaves: the same groups, casts and results), the params are written there,
and the new state comes back down. Grads and params never cross PCIe; the state does, both ways.

The engine's host state is pinned (:class:`~functional_offload.optimizers.terminal.Terminal`
allocates it so), so each piece of a chunk is copied up from it and back into it in place, on
copy streams of the engine's own (:meth:`~functional_offload.executor.HostExecutor.
engine_transport`), into and out of one of ``S`` device buffers of the executor's
``engine_chunk_bytes``: the device memory taken is ``engine_chunk_bytes × slots``, and the
temporaries of the math of the chunks in flight, each cached for its math stream (two). Host
DRAM sees each state byte read once (up) and written once (down). Chunk ``k + S`` reuses the
buffer of chunk ``k``: its copies up wait on the GPU for chunk ``k``'s copies down, so the
thread queues every chunk without waiting and waits on the host only at the end (a CUDA call
made while a training loop's backward fills its stream's queue waits for one of its kernels:
calls made before cost none). Chunk ``k``'s math runs on the executor's math stream ``k mod 2``
(:meth:`~functional_offload.executor.HostExecutor.engine_math_streams`), beside the previous
chunk's. Every copy down has landed when :meth:`GpuEngine.finish` returns. (A state tensor that
is not pinned — replaced by the caller — is still copied right, synchronously.)
"""

from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple, Optional

import torch

import functional_offload.executor.faults as faults
from functional_offload.executor import HostStepError
from functional_offload.executor.transport import Transport
from functional_offload.kernels import blockwise
from functional_offload.optimizers.device_math import device_groups, run_groups
from functional_offload.optimizers.forms.base import AtFinish, HostWork, by_device
from functional_offload.kernels.remainder import is_split
from functional_offload.optimizers.layout import Leaf

__all__ = ["GpuEngine", "Chunk", "Piece", "Prepared", "chunks", "steppable", "takes"]

ALIGN = 64  # bytes: where each piece's tensor starts in a chunk


class Piece(NamedTuple):
    """Elements ``lo:hi`` of leaf ``index``'s state in a chunk: one tensor per state tensor
    (value, moments..., EMA), at ``offsets`` (bytes)."""

    index: int
    lo: int
    hi: int
    offsets: tuple[int, ...]


class Chunk(NamedTuple):
    pieces: list[Piece]
    nbytes: int


class Prepared(NamedTuple):
    """One device's part of a step, ready to run: its transport, chunks, grads (1-D, by leaf)
    and device buffers."""

    transport: Transport
    chunks: list[Chunk]
    grads: dict[int, torch.Tensor]
    buffers: list[torch.Tensor]


def state_of(leaf: Leaf) -> tuple[torch.Tensor, ...]:
    """A host leaf's state, 1-D: value (a split master's high half and remainder; of a
    remainder-only one, the high half is the param's bits, copied into the chunk on the device
    and written back as the param), moments (a block-wise 8-bit one's bytes), EMA."""
    return (*leaf.flat, *(() if leaf.ema_flat is None else (leaf.ema_flat,)))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _span(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``lo:hi`` of the 1-D state tensor ``x`` (of a block-wise moment: the bytes of
    their blocks, ``lo`` starting one)."""
    return blockwise.part(x, lo, hi) if blockwise.is_blockwise(x) else x[lo:hi]


def _span_bytes(x: torch.Tensor, lo: int, hi: int) -> int:
    if blockwise.is_blockwise(x):
        return blockwise.nbytes(hi) - lo // blockwise.BLOCK * blockwise.nbytes(blockwise.BLOCK)
    return (hi - lo) * x.element_size()


def _whole(numel: int, split: bool, eight: bool) -> bool:
    """Whether a leaf goes into one chunk whole: of a length not divisible by 4, with a split
    master or block-wise 8-bit moments (whose math runs on fresh fp32 copies, aligned, and an
    8-bit moment is cut on its blocks), a piece could take another path through the
    multi-tensor kernels than the whole leaf (see ``_cut``), whose results may differ."""
    return numel % 4 != 0 and (split or eight)


def _need(sizes: list[int]) -> int:
    """The bytes state tensors of ``sizes`` bytes need of an empty chunk, whole (each padded
    to ``ALIGN``: at most ``ALIGN`` more)."""
    return sum(sizes) + ALIGN * len(sizes)


def takes(numel: int, split: bool, eight: bool, sizes: list[int], capacity: int) -> bool:
    """Whether the engine, with chunks of ``capacity`` bytes, takes a leaf of ``numel`` elements
    (``split``: with a split master; ``eight``: with block-wise 8-bit moments) whose state
    tensors have ``sizes`` bytes (a split master's halves apart, as :func:`state_of` gives
    them): a leaf that goes whole (:func:`_whole`) has to fit one chunk."""
    return not _whole(numel, split, eight) or _need(sizes) <= capacity


def steppable(leaf: Leaf, capacity: int) -> bool:
    """:func:`takes` for a host leaf, from its state."""
    state = state_of(leaf)
    numel = state[0].numel()
    return takes(numel, is_split(leaf.value), any(blockwise.is_blockwise(x) for x in state),
                 [_span_bytes(x, 0, numel) for x in state], capacity)


def _cut(room: int, left: int, numel: int) -> int:
    """How many of the ``left`` elements of a leaf of ``numel`` a piece with ``room`` for them
    takes (all where they fit), so that torch's multi-tensor kernels run each piece on the path
    they run the whole leaf on (their vectorized loads need a length divisible by 4 and 16-byte
    aligned tensors, and the two paths may round differently): a multiple of 64 elements where
    ``numel`` is divisible by 4 (every piece then starts aligned and the last one keeps that
    length), else one more than a multiple of 64 (no piece but the last is divisible by 4, and
    the last starts unaligned)."""
    if room >= left:
        return room
    if numel % 4 == 0:
        return room // 64 * 64
    return (room - 1) // 64 * 64 + 1 if room > 64 else 0


def chunks(leaves: list[Leaf], idx: list[int], capacity: int) -> list[Chunk]:
    """The state of leaves ``idx`` cut into chunks of at most ``capacity`` bytes, in order; a
    leaf that does not fit the rest of a chunk goes on in the next (with block-wise moments: on
    a block's start). (``capacity`` is at least 4096 bytes and a state at most 32 bytes an
    element: an empty chunk has room, but for block-wise moments, which need a block's.)"""
    out: list[Chunk] = []
    pieces: list[Piece] = []
    used = 0
    block = blockwise.BLOCK
    for i in idx:
        state = state_of(leaves[i])
        blocks = any(blockwise.is_blockwise(x) for x in state)
        per = sum(blockwise.nbytes(block) if blockwise.is_blockwise(x) else
                  x.element_size() * block for x in state) / block  # bytes an element
        lo, numel = 0, state[0].numel()
        whole = _whole(numel, is_split(leaves[i].value), blocks)
        while lo < numel:
            free = capacity - used - ALIGN * len(state)
            if sum(_span_bytes(x, lo, numel) for x in state) <= free:  # the rest fits
                room = numel - lo
            elif whole:  # in the next chunk
                room = 0
            elif blocks:  # whole blocks
                room = int(free // per) // block * block
            else:
                room = _cut(int(free // per), numel - lo, numel)
            if room <= 0:
                if not pieces:
                    raise ValueError(f"chunk capacity {capacity} bytes holds no piece of the "
                                     f"state of {leaves[i].path!r} ({per:g} bytes an element)")
                out.append(Chunk(pieces, used))
                pieces, used = [], 0
                continue
            hi = min(numel, lo + room)
            offsets = []
            for x in state:
                offsets.append(used)
                used += _aligned(_span_bytes(x, lo, hi))
            pieces.append(Piece(i, lo, hi, tuple(offsets)))
            lo = hi
    if pieces:
        out.append(Chunk(pieces, used))
    return out


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Where elements ``lo:hi`` of the state tensor ``like`` (as :func:`_span` cuts it) lie in
    ``buf``, from ``offset``."""
    return buf[offset: offset + _span_bytes(like, lo, hi)].view(like.dtype)


class GpuEngine(AtFinish):  # finish leaves nothing in flight: nothing to cancel
    """The GPU engine form (see the module): plain steps of element-wise optimizers whose
    executor has ``engine="gpu"``. It starts nothing ahead: leaves fed by
    :func:`~functional_offload.stream` run at finish. ``touched`` once a chunk's math was queued
    (it writes params, then the state comes back)."""

    def __init__(self, work: HostWork):
        super().__init__(work)
        self.begun = False
        self.strided: dict[int, torch.Tensor] = {}  # strided params' new values, written at commit
        self.outs: dict[int, torch.Tensor] = {}  # where leaves' new params go, if not the params

    def finish(self, gs: list, rest: list[int], ready: dict) -> None:
        self.run_prepared(self.prepare(gs, rest))

    def prepare(self, gs: list, idx: list[int], outs: Optional[dict[int, torch.Tensor]] = None,
                beside: bool = False) -> list["Prepared"]:
        """Leaves ``idx`` cut into chunks and their device buffers allocated, per device: what
        can fail before anything is written. ``outs``: per leaf, a 1-D tensor on its device
        that gets its new params instead of its param (a delayed step's buffer); ``beside``:
        the chunks of a step beside the caller's forward and backward (a delayed step's,
        :meth:`~functional_offload.executor.HostExecutor.engine_chunk`)."""
        self.outs = dict(outs or {})
        out = []
        ex = self.work.ex
        for device, on in by_device(idx, gs).items():
            for i in on:
                leaf = self.work.leaf(i)  # the host views made anew where a storage was replaced
                if i not in self.outs and not leaf.param.is_contiguous():  # its new values'
                    self.strided[i] = torch.empty(leaf.param.numel(), dtype=leaf.param.dtype,
                                                  device=leaf.param.device)
            capacity = ex.engine_chunk(beside)
            todo = chunks(self.work.leaves, on, capacity)
            bufs = [torch.empty(capacity, dtype=torch.uint8, device=device)
                    for _ in range(min(ex.slots, len(todo)))]
            out.append(Prepared(ex.engine_transport(device), todo,
                                {i: gs[i].reshape(-1) for i in on}, bufs))
        return out

    def run_prepared(self, prepared: list["Prepared"],
                     done: Optional[Callable[[Chunk], None]] = None) -> None:
        """Step what :meth:`prepare` made, chunk by chunk, calling ``done`` with each chunk once
        this thread's stream is ordered after its math; every copy down has landed when it
        returns."""
        for p in prepared:
            self._run(p, done)

    def _run(self, p: "Prepared", done: Optional[Callable[[Chunk], None]]) -> None:
        ex, t, todo, bufs, grads = self.work.ex, p.transport, p.chunks, p.buffers, p.grads
        if not todo:
            return
        device = bufs[0].device
        home = torch.cuda.current_stream(device)
        maths = ex.engine_math_streams(device)
        for m in maths:  # the grads, params and buffers are ready where the caller's stream is
            m.wait_stream(home)
        t.wait_out(t.ready())
        landing: deque[tuple[int, object]] = deque()  # (chunk, the event of its copies down)
        at = 0  # the chunk being queued, or whose copies down are being waited for
        try:
            for k, chunk in enumerate(todo):
                if k >= ex.slots:  # its copies up wait for the buffer's last chunk's down
                    t.wait_out(landing.popleft()[1])
                at = k
                with torch.cuda.stream(maths[k % len(maths)]):
                    landing.append((k, self._chunk(t, k, chunk, bufs[k % ex.slots], grads, done,
                                                   home)))
            while landing:
                at, event = landing.popleft()
                t.wait_host(event)
        except Exception as e:
            raise HostStepError(tuple(dict.fromkeys(self.work.leaves[q.index].path
                                                    for q in todo[at].pieces)), e) from e
        finally:  # nothing in flight reads or writes the state or the buffers once this returns
            for m in maths:
                home.wait_stream(m)
            t.wait_in(t.ready())
            t.wait_host(t.mark_in())
            t.wait_host(t.mark_out())

    def _chunk(self, t: Transport, k: int, chunk: Chunk, buf: torch.Tensor,
               grads: dict[int, torch.Tensor], done: Optional[Callable[[Chunk], None]],
               home: "torch.cuda.Stream") -> object:
        """Copy chunk ``k``'s state up, queue its math on the current (math) stream and its
        copies down into the host state; ``done`` is called on the caller's stream ``home``
        once it waits for the math (so for every chunk's before it); the event of the copies
        down."""
        leaves, work = self.work.leaves, self.work
        if faults.active():
            faults.before_chunk(k, list(dict.fromkeys(leaves[p.index].path for p in chunk.pieces)))
        tl = work.ex.timeline
        s0 = tl.stamp(buf.device, t.stream_out) if tl else None
        for p in chunk.pieces:
            for x, offset in zip(state_of(leaves[p.index]), p.offsets):
                t.copy_out(_view(buf, offset, x, p.lo, p.hi), _span(x, p.lo, p.hi))
        if tl:
            tl.span("H2D engine", f"state up c{k}", s0, tl.stamp(buf.device, t.stream_out))
        t.end()  # the caller's stream waits for the state
        self.begun = True
        spec = work.t.spec
        run_groups(device_groups([self._on_device(p, buf) for p in chunk.pieces]),
                   [grads[p.index][p.lo:p.hi] for p in chunk.pieces], True,
                   spec.device or spec.reference, [m.signed for m in spec.moments], work.hyper,
                   work.hyper_no_decay, work.t.ema_decay, tl, [], stored=spec.device_stored)
        if done is not None:
            home.wait_stream(torch.cuda.current_stream(buf.device))
            with torch.cuda.stream(home):
                done(chunk)
        t.wait_in(t.ready())
        s0 = tl.stamp(buf.device, t.stream_in) if tl else None
        for p in chunk.pieces:
            for x, offset in zip(state_of(leaves[p.index]), p.offsets):
                if x.device.type == "cpu":  # (a param's own bits, a high half: written above)
                    t.copy_in(_span(x, p.lo, p.hi), _view(buf, offset, x, p.lo, p.hi))
        if tl:
            tl.span("D2H engine", f"state down c{k}", s0, tl.stamp(buf.device, t.stream_in))
        return t.mark_in()

    def _on_device(self, p: Piece, buf: torch.Tensor) -> Leaf:
        """Piece ``p`` as a device-resident leaf: its state in ``buf``, its param the param's
        elements (a strided param's: its new values' buffer)."""
        leaf = self.work.leaves[p.index]
        state = [_view(buf, offset, x, p.lo, p.hi) for x, offset in zip(state_of(leaf), p.offsets)]
        if is_split(leaf.value):  # its halves, one after the other: as a split master, (2, n)
            hi, lo = state[0], state[1]
            gap = (lo.data_ptr() - hi.data_ptr()) // hi.element_size()
            state[:2] = [hi.as_strided((2, p.hi - p.lo), (gap, 1))]
        k = 1 + len(leaf.moments)
        if p.index in self.outs:
            param = self.outs[p.index][p.lo:p.hi]
        elif leaf.param.is_contiguous():
            param = leaf.param.view(-1)[p.lo:p.hi]
        else:
            param = self.strided[p.index][p.lo:p.hi]
        return Leaf(leaf.path, leaf.live, param, state[0], tuple(state[1:k]),
                    state[k] if leaf.ema is not None else None, True, leaf.decay)

    def commit(self) -> None:
        """Strided params written from their new values."""
        for i, new in self.strided.items():
            param = self.work.leaves[i].param
            param.copy_(new.view(param.shape))

    def touched(self) -> bool:
        return self.begun

    def release(self) -> None:
        self.strided.clear()
        self.outs.clear()
