"""The host-step pipeline: chunked D2H → CPU kernel → H2D through a pinned staging ring.

The host leaves' elements are laid end to end and cut into chunks of at most ``chunk_bytes`` of
grads — for a list of leaves up front, or, with grad streaming, from the leaves that have
arrived each time a slot frees. Chunk ``k`` takes ring slot ``k mod S``, which holds its grads
(copied in) and its output params (copied out). While the worker threads run the kernel on
chunk ``k``, the grads of chunks ``k+1 … k+S-1`` are copying in and the params of chunk ``k-1``
are copying out:

    D2H stream:  [g k+1][g k+2]…            (up to S chunks in flight)
    CPU workers:        [kernel k  ]         (chunk split across threads, GIL released)
    H2D stream:                     [p k]    (issued as soon as chunk k is done)

Inside a chunk, work is claimed, not assigned: the ``threads`` workers stay in the loop of the
run's kernel queue (:mod:`functional_offload.kernels.work`) from the first chunk to the last —
for the native kernel in C++, GIL released — take the chunks in order, and claim each one's
blocks (about ``1 / (4·threads)`` of the chunk) with an atomic counter until none is left. A
thread that shares its core with someone else (the training loop, autograd's thread) claims
fewer blocks instead of holding the chunk back, and no worker passes through Python between
chunks (per-chunk Python in 16 threads, serialised on the GIL, cost ~2 ms a chunk). The caller's
thread issues copies and completes chunks; a lander thread marks each chunk ready once its grads
have landed.
A slot's grad half is refilled (chunk k+S) only once every block of chunk k has run; its output
half only after the copy out that read it completed (its event, waited on by the host). Only the
ring is pinned, once; state (masters, moments) stays in ordinary host memory, touched by the CPU
alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import queue as queue_mod
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from functional_offload.executor.timeline import Timeline
from functional_offload.executor.transport import transport_for
from functional_offload.kernels.work import Kernel, Piece, Work, queue_for

__all__ = ["HostLeaf", "HostExecutor", "physical_cores"]

_ALIGN = 64  # bytes; segment offsets in a slot are aligned to this
_MIN_BLOCK = 1 << 14  # elements: smaller blocks cost more to claim than they compute
_BLOCKS_PER_THREAD = 4


class HostLeaf(NamedTuple):
    """One host-resident leaf, flattened to 1-D views."""

    path: str
    grad: torch.Tensor  # 1-D, on the device the copies come from (a GPU, or the CPU)
    param: torch.Tensor  # 1-D: where the new param goes (the param itself, or host staging)
    state: tuple[torch.Tensor, ...]  # host tensors, 1-D: (value, moments...) — value is fp32
    write_param: bool  # the param is a separate (device or low-precision) tensor to write back
    hyper: Any  # per-leaf scalars handed to the kernel


class _Segment(NamedTuple):
    leaf: int
    start: int
    stop: int
    offset: int  # byte offset in the slot half


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads not counted)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        allowed = set(range(os.cpu_count() or 1))
    try:
        cores = set()
        cpu = core = pkg = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cpu = int(val)
                elif key == "physical id":
                    pkg = val.strip()
                elif key == "core id":
                    core = val.strip()
                    if cpu in allowed:
                        cores.add((pkg, core))
        return max(1, len(cores)) if cores else max(1, len(allowed))
    except OSError:
        return max(1, len(allowed))


class HostExecutor:
    """Runs the host part of an update; owns the pinned ring and the worker threads.

    Args:
      chunk_bytes: grad bytes per chunk (and per ring-slot half); MBs to tens of MBs.
      slots: ring slots; ``slots - 1`` chunks of grads copy in ahead of the kernel.
      threads: worker threads for the kernel (default: physical cores).
      timeline: a :class:`Timeline` to record per-chunk spans into (off by default).

    Runs for one device take turns: each holds that device's ring from its first chunk to its
    last (a delayed step, until its host part is done), so optimizers may share an executor,
    also from several threads. Runs for different devices have rings of their own but share
    the worker threads, which stay with one run until it ends.
    """

    def __init__(self, chunk_bytes: int = 32 << 20, slots: int = 4, threads: Optional[int] = None,
                 timeline: Optional[Timeline] = None):
        if chunk_bytes < 4096 or slots < 2:
            raise ValueError(f"executor needs chunk_bytes >= 4096 and slots >= 2, got "
                             f"chunk_bytes={chunk_bytes}, slots={slots}")
        if threads is not None and threads < 1:
            raise ValueError(f"executor threads must be >= 1, got {threads}")
        self.chunk_bytes = int(chunk_bytes)
        self.slots = int(slots)
        self.threads = threads or physical_cores()
        self.timeline = timeline
        self._rings: dict[torch.device, torch.Tensor] = {}
        self._out_events: dict[torch.device, list] = {}
        # delayed: per copy out of host staging, (first byte, end byte, event when it has run)
        self._staged_out: dict[torch.device, list[tuple[int, int, Any]]] = {}
        self._transports: dict[torch.device, Any] = {}
        self._busy: dict[torch.device, threading.Lock] = {}  # held by the run using the ring
        self._reserving = threading.Lock()
        self._pool: Optional[cf.ThreadPoolExecutor] = None

    # ---- resources, allocated once -------------------------------------------------------
    def reserve(self, device: torch.device) -> None:
        """Allocate the staging ring (pinned for CUDA) and streams for params on ``device``."""
        with self._reserving:
            if device in self._rings:
                return
            pin = device.type == "cuda"
            nbytes = self.slots * 2 * self.chunk_bytes
            self._out_events[device] = [None] * self.slots
            self._transports[device] = transport_for(device)
            self._busy[device] = threading.Lock()
            self._rings[device] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (the CUDA rings; nothing else is pinned)."""
        return sum(r.numel() for d, r in self._rings.items() if d.type == "cuda")

    @property
    def staging_bytes(self) -> int:
        return sum(r.numel() for r in self._rings.values())

    def _workers(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="fo-host")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- planning -------------------------------------------------------------------------
    def _pack(self, arrivals: "queue_mod.Queue", leaves: list[HostLeaf],
              ready: list[Any]) -> Iterator[list[_Segment]]:
        """Cut leaves into chunks as they come from ``arrivals`` (``(leaf, ready event)`` items,
        ``None`` at the end), appending each to ``leaves`` and its event to ``ready``. A chunk
        takes what has arrived, up to ``chunk_bytes`` of grads; it waits for an arrival only
        while it holds nothing, so a chunk never waits for leaves to fill it."""
        pos: Optional[tuple[int, int]] = None  # (leaf, first element) of the leaf being cut
        ended = False
        while True:
            cur: list[_Segment] = []
            used = 0
            while True:
                if pos is None:
                    if ended:
                        break
                    try:
                        item = arrivals.get(block=not cur)
                    except queue_mod.Empty:
                        break
                    if item is None:
                        ended = True
                        break
                    leaves.append(item[0])
                    ready.append(item[1])
                    pos = (len(leaves) - 1, 0)
                i, start = pos
                n, size = leaves[i].grad.numel(), leaves[i].grad.element_size()
                room = (self.chunk_bytes - used) // size
                if start < n and room < min(n - start, _ALIGN):  # slot full
                    break
                stop = min(n, start + room)
                if stop > start:
                    cur.append(_Segment(i, start, stop, used))
                    used += -(-(stop - start) * size // _ALIGN) * _ALIGN
                pos = None if stop == n else (i, stop)
            if not cur:
                return
            yield cur

    def _chunks(self, leaves: Sequence[HostLeaf]) -> list[list[_Segment]]:
        """The chunks of a list of leaves (as :meth:`run` cuts them)."""
        return list(self._pack(_arrived(leaves, None), [], []))

    def _block_size(self, chunk: Sequence[_Segment]) -> int:
        """Elements per claimed block: about ``1 / (4·threads)`` of the chunk."""
        size = max(_MIN_BLOCK, math.ceil(sum(s.stop - s.start for s in chunk)
                                         / (self.threads * _BLOCKS_PER_THREAD)))
        return -(-size // _ALIGN) * _ALIGN

    # ---- the step -------------------------------------------------------------------------
    def ready(self, device: torch.device) -> Any:
        """An event marking the work queued so far on this thread's stream (None on the CPU)."""
        self.reserve(device)
        return self._transports[device].ready()

    def order_after_copies(self, device: torch.device) -> None:
        """Make this thread's stream wait for every param copy issued for ``device``."""
        if device in self._transports:
            self._transports[device].end()

    def start(self, leaves: Sequence[HostLeaf], kernel: Kernel,
              targets: Sequence[torch.Tensor]) -> Callable[[], None]:
        """Run :meth:`run` in the background, with each leaf's ``param`` a host staging buffer.

        Returns ``finish()``. It marks the work queued so far on the caller's stream, then copies
        each chunk's staged params into its ``targets`` tensors (on the H2D stream, after that
        mark) as soon as the chunk's kernel is done — so only the last chunk's copy is left
        when the host step ends — re-raises the host step's error, and orders the caller's
        stream after the copies. Calling it again does nothing. This is the delayed parameter
        update: the new params land only when ``finish`` is called, after the work the caller
        queued meanwhile.
        """
        if not leaves:
            return lambda: None
        device = leaves[0].grad.device
        ready = self.ready(device)  # grads are complete here, on the caller's stream
        failure: list[BaseException] = []
        done_chunks: "queue_mod.Queue" = queue_mod.Queue()  # segments of finished chunks; None: end

        def body() -> None:
            try:
                self.run(leaves, kernel, ready, order_caller=False, chunk_done=done_chunks.put)
            except BaseException as e:
                failure.append(e)
            finally:
                done_chunks.put(None)

        driver = threading.Thread(target=body, name="fo-delayed", daemon=True)
        driver.start()
        finished: list[bool] = []

        def finish() -> None:
            if finished:
                return
            finished.append(True)
            t = self._transports[device]
            tl = self.timeline
            t.wait_out(t.ready())  # the caller's reads of the old params come first
            copies = []  # the next step rewrites each staging range only after its copy ran
            while (segments := done_chunks.get()) is not None:
                s0 = tl.stamp(device, t.stream_out) if tl else None
                ranges = []
                for seg in segments:
                    leaf = leaves[seg.leaf]
                    if leaf.write_param:
                        src = leaf.param[seg.start:seg.stop]
                        t.copy_out(targets[seg.leaf][seg.start:seg.stop], src)
                        ranges.append(_byte_range(src))
                event = t.mark_out()
                copies += [(a, b, event) for a, b in ranges]
                if tl:
                    tl.span("H2D", "staged params", s0, tl.stamp(device, t.stream_out))
            driver.join()
            self._staged_out[device] = copies
            t.end()
            if failure:
                raise failure[0]

        return finish

    def run(self, leaves: Sequence[HostLeaf], kernel: Kernel, ready: Optional[Any] = None,
            order_caller: bool = True,
            chunk_done: Optional[Callable[[list[_Segment]], None]] = None) -> None:
        """Update ``leaves`` (all with grads on one device) with ``kernel``; errors re-raise.

        A param in host memory is written by the kernel directly; one on a GPU through the
        ring's output half and the H2D stream. ``ready`` (from :meth:`ready`) orders the copies;
        by default, after the work queued on the calling thread's stream. With
        ``order_caller=False`` (a background thread) the caller's stream is not ordered here:
        the owner calls :meth:`order_after_copies` from its own thread. ``chunk_done(segments)``
        is called as each chunk's kernel completes, in chunk order.

        Returns once every kernel ran and every copy out was issued; with ``order_caller``, the
        caller's stream is then ordered after the copies out, so work queued next sees the new
        params.
        """
        if leaves:
            if ready is None:
                ready = self.ready(leaves[0].grad.device)
            self._pipeline(_arrived(leaves, ready), kernel, order_caller, chunk_done)

    def run_stream(self, arrivals: "queue_mod.Queue", kernel: Kernel) -> None:
        """:meth:`run` on leaves that arrive one by one, as ``(leaf, ready)`` items of
        ``arrivals`` ended by ``None`` (grad streaming: ``ready`` marks that leaf's grad complete
        on its stream). One run for them all: a chunk is cut from what has arrived whenever a
        ring slot frees, so the pipeline does not drain between arrivals; each chunk's copies
        wait for the events of its own leaves only. The caller's stream is not ordered (see
        :meth:`order_after_copies`)."""
        self._pipeline(arrivals, kernel, False, None)

    @torch.no_grad()  # views of the params are cut here, on the caller's or a driver's thread
    def _pipeline(self, arrivals: "queue_mod.Queue", kernel: Kernel, order_caller: bool,
                  chunk_done: Optional[Callable[[list[_Segment]], None]]) -> None:
        """The run. This thread cuts chunks, issues their copies in and adds their work to the
        kernel's queue as ring slots free, and issues each chunk's copy out once it is done; a
        lander thread marks each chunk ready once its grads have landed and its slot's output
        half is free; ``threads`` workers stay in the queue's loop for the whole run."""
        leaves: list[HostLeaf] = []
        ready: list[Any] = []
        packer = self._pack(arrivals, leaves, ready)
        first = next(packer, None)
        if first is None:
            return
        device = leaves[0].grad.device
        self.reserve(device)
        with self._busy[device]:  # the device's ring serves one run at a time
            self._run_chunks(device, first, packer, leaves, ready, kernel, order_caller, chunk_done)

    def _run_chunks(self, device: torch.device, first: list[_Segment], packer: Iterator[list[_Segment]],
                    leaves: list[HostLeaf], ready: list[Any], kernel: Kernel, order_caller: bool,
                    chunk_done: Optional[Callable[[list[_Segment]], None]]) -> None:
        """:meth:`_pipeline` once the first chunk is cut and the device's ring is held."""
        ring, slot_events, t = self._rings[device], self._out_events[device], self._transports[device]
        S, half = self.slots, self.chunk_bytes
        tl = self.timeline
        q = queue_for(kernel, self.threads, tl is not None)
        chunks: list[list[_Segment]] = []
        in_events: list = []
        frees: list[Any] = []  # per chunk: the event its host params wait for
        out_events: list = []  # per chunk: its slot's last copy out once it is done
        staged = self._staged_out.get(device, [])  # host params may still be copying out
        before = list(slot_events)  # copies out of the previous step, per slot
        landing: "queue_mod.Queue" = queue_mod.Queue()  # chunks for the lander; None ends
        failures: list[tuple[int, BaseException]] = []

        def staged_free(pieces: list[Piece]) -> Any:
            """The event after which these pieces' host params are no longer read by a copy out."""
            mine = [_byte_range(p.out) for p in pieces if p.out is not None and p.out.device.type == "cpu"]
            last = None  # events complete in the order recorded: the last overlapping one will do
            for a, b, event in staged:
                if any(a < hi and lo < b for lo, hi in mine):
                    last = event
            return last

        def view(k: int, which: int, seg: _Segment, dtype: torch.dtype) -> torch.Tensor:
            base = (2 * (k % S) + which) * half + seg.offset
            return ring[base: base + (seg.stop - seg.start) * dtype.itemsize].view(dtype)

        def leaf_events(segments: list[_Segment]) -> list[Any]:
            return list(dict.fromkeys(ready[seg.leaf] for seg in segments))

        def issue_in(k: int) -> None:
            for event in leaf_events(chunks[k]):
                t.wait_in(event)
            s0 = tl.stamp(device, t.stream_in) if tl else None
            grads = [view(k, 0, seg, leaves[seg.leaf].grad.dtype) for seg in chunks[k]]
            for seg, grad in zip(chunks[k], grads):
                t.copy_in(grad, leaves[seg.leaf].grad[seg.start:seg.stop])
            if tl:
                tl.span("D2H", f"grads c{k}", s0, tl.stamp(device, t.stream_in))
            in_events.append(t.mark_in())
            pieces = []
            for seg, grad in zip(chunks[k], grads):
                leaf = leaves[seg.leaf]
                out = None if not leaf.write_param else (
                    leaf.param[seg.start:seg.stop] if leaf.param.device.type == "cpu"  # in place
                    else view(k, 1, seg, leaf.param.dtype))
                pieces.append(Piece(grad, tuple(x[seg.start:seg.stop] for x in leaf.state), out,
                                    leaf.hyper))
            frees.append(staged_free(pieces) if staged else None)
            out_events.append(None)
            q.add(Work(pieces, self._block_size(chunks[k])))
            landing.put(k)

        def land() -> None:  # the lander thread
            try:
                while (k := landing.get()) is not None:
                    t.wait_host(in_events[k])  # grads landed
                    t.wait_host(out_events[k - S] if k >= S else before[k % S])  # out half free
                    t.wait_host(frees[k])  # a copy out may still read this chunk's host params
                    q.ready(k)
            except BaseException as e:  # noqa: BLE001 - surfaced by the caller
                failures.append((k, e))
                q.cancel()

        def complete(k: int) -> None:  # chunk k's kernel is done: copy its params out
            error = q.wait(k)
            if error is not None:
                raise failures[0][1] if failures else error
            out = [seg for seg in chunks[k]
                   if leaves[seg.leaf].write_param and leaves[seg.leaf].param.device.type != "cpu"]
            if out:
                for event in leaf_events(out):
                    t.wait_out(event)
                s0 = tl.stamp(device, t.stream_out) if tl else None
                for seg in out:
                    t.copy_out(leaves[seg.leaf].param[seg.start:seg.stop],
                               view(k, 1, seg, leaves[seg.leaf].param.dtype))
                if tl:
                    tl.span("H2D", f"params c{k}", s0, tl.stamp(device, t.stream_out))
                slot_events[k % S] = t.mark_out()
            out_events[k] = slot_events[k % S]  # no copy out: the slot's out half is as it was
            if chunk_done is not None:
                chunk_done(chunks[k])

        lander = threading.Thread(target=land, name="fo-land", daemon=True)
        lander.start()
        pool = self._workers()
        workers = [pool.submit(q.work, i) for i in range(self.threads)]
        done = at = 0  # chunks completed; the chunk being issued or completed
        try:
            chunk: Optional[list[_Segment]] = first
            while chunk is not None:
                at = len(chunks)
                chunks.append(chunk)
                issue_in(at)
                if at + 1 >= S:  # the next chunk takes slot (at+1) mod S: its last user must be done
                    at = done
                    complete(done)
                    done += 1
                chunk = next(packer, None)
            q.close()
            while done < len(chunks):
                at = done
                complete(done)
                done += 1
        except BaseException as e:  # noqa: BLE001 - raised below, naming the chunk's leaves
            if not failures:  # else this follows from the lander's failure (recorded first)
                failures.append((at, e))
            q.cancel()
        finally:
            landing.put(None)
            lander.join()
            cf.wait(workers)
            for ev in in_events:  # never return while a copy in still reads the grads
                t.wait_host(ev)
            if order_caller:
                t.end()
            if tl:
                for w, k, waiting, a, b in q.spans():
                    tl.span(f"fo-host_{w}", f"{'wait' if waiting else 'kernel'} c{k}", a, b)
        if failures:
            k, e = failures[0]
            names = ", ".join(dict.fromkeys(repr(leaves[s.leaf].path) for s in chunks[k]))
            raise RuntimeError(f"host optimizer step failed on leaf {names}: "
                               f"{type(e).__name__}: {e}") from e


def _arrived(leaves: Sequence[HostLeaf], ready: Any) -> "queue_mod.Queue":
    """``leaves`` as arrivals that have all come, each with the event ``ready``."""
    q: "queue_mod.Queue" = queue_mod.Queue()
    for leaf in leaves:
        q.put((leaf, ready))
    q.put(None)
    return q
