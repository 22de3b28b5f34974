"""One run of the host pipeline: chunked D2H → CPU kernel → H2D through the device's staging ring.

A :class:`Run` is fed host leaves (:meth:`Run.add`, all at once or as autograd produces their
grads) and driven by a thread of its own, so that nothing the caller's thread does — including
a ``KeyboardInterrupt`` landing in it — can leave the pipeline's bookkeeping half-done. The
driver cuts chunks from what has arrived (:mod:`~functional_offload.executor.chunking`); chunk
``k`` takes ring slot ``k mod S``, which holds its grads (copied in) and its output params (copied
out). While the workers run the kernel on chunk ``k``, the grads of chunks ``k+1 … k+S-1`` copy
in and the params of chunk ``k-1`` copy out:

    D2H stream:  [g k+1][g k+2]…            (up to S chunks in flight)
    CPU workers:        [kernel k  ]         (claiming blocks, GIL released)
    H2D stream:                     [p k]    (issued as soon as chunk k is done)

A lander thread marks each chunk ready once its grads have landed and its slot's output half is
free (a run that copies nothing, host grads and host params, has no ring and no lander: the
driver readies each chunk as it cuts it, its first chunks smaller so that the workers start
early). A slot's grad half is refilled only once every block of its chunk ran, its output half
only after the copy out that read it completed. Grads already in host memory are read where
they are, and host params are written in place: no staging, no copies. A run with two outputs
per element (a look-ahead's base and rate, and for bf16 grads the base's one-byte residual) cuts
chunks of two fifths of the grad bytes: the output half holds the bases, then the rates, then
the residuals.

A run whose leaves are all handed over before it starts may be ``inline``: :meth:`Run.wait`
drives it in the calling thread (a step's shielded work, which no interrupt cuts), and a run
of one chunk and one worker does every stage there, with no thread of its own (unless the
executor pins its workers to cores: the kernel then runs on one of them).
"""

from __future__ import annotations

import atexit
import itertools
import queue as queue_mod
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

import functional_offload.executor.faults as faults
from functional_offload.executor.chunking import ALIGN, HostLeaf, Segment, block_size, cut
from functional_offload.kernels import blockwise
from functional_offload.kernels.work import Kernel, Piece, Work, queue_for

__all__ = ["Run", "HostStepError"]

# Runs whose driver may still be running: waited for at exit, so that the interpreter never
# stops a driver thread inside torch (which aborts the process: "terminate called...").
_live: "weakref.WeakSet[Run]" = weakref.WeakSet()


@atexit.register
def _wait_for_live_runs() -> None:
    for run in list(_live):
        run.wait(60)


class HostStepError(RuntimeError):
    """A host step failed on some leaves: ``leaves``, the paths of every params-tree leaf in
    the work that failed (each member of a packed run of small leaves); the message names
    them, at most ``NAMED`` of them; ``__cause__`` is the error."""

    NAMED = 8

    def __init__(self, leaves: tuple[str, ...], error: BaseException):
        shown = ", ".join(map(repr, leaves[:self.NAMED]))
        more = f" and {len(leaves) - self.NAMED} more" if len(leaves) > self.NAMED else ""
        super().__init__(f"host optimizer step failed on leaf {shown}{more}: "
                         f"{type(error).__name__}: {error}")
        self.leaves = leaves

    def __reduce__(self) -> Any:  # pickled (e.g. to another process) with its message
        return _host_step_error, (str(self), self.leaves)


def _host_step_error(message: str, leaves: tuple[str, ...]) -> HostStepError:
    e = HostStepError.__new__(HostStepError)
    RuntimeError.__init__(e, message)
    e.leaves = leaves
    return e


class Run:
    """One run for leaves of one device. Made by
    :meth:`~functional_offload.executor.HostExecutor.open`; see the module docstring.

    ``chunk_done(leaves, segments)`` is called (from the driver thread) as each chunk's kernel
    completes, in chunk order, and ``chunk_done(leaves, None)`` when the run ends.
    :meth:`wait` blocks until the run ended (its error, if any, is then in :attr:`error`);
    :attr:`started` says whether any chunk's kernel may have run (the leaves may be changed).
    ``inline``: no driver thread; every leaf is handed over and the run closed before
    :meth:`wait`, which runs it in the calling thread.
    """

    def __init__(self, executor: Any, device: torch.device, kernel: Kernel, threads: int,
                 chunk_done: Optional[Callable[[list[HostLeaf], list[Segment]], None]] = None,
                 inline: bool = False, ahead: bool = False, beside: bool = False):
        self.ex, self.device, self.kernel, self.threads = executor, device, kernel, threads
        self.chunk_done = chunk_done
        self.inline = inline
        self.half = executor.chunk(device, beside)  # bytes of a ring slot's half
        # grad bytes per chunk: a slot half, or (a look-ahead's outputs: per bf16 grad 2 bytes
        # of base, 2 of rate, 1 of residual) two fifths of one, the rates starting there in the
        # output half and the residuals at twice it (:meth:`_Pipeline.at`)
        self.budget = self.half * 2 // 5 // ALIGN * ALIGN if ahead else self.half
        self.started = False
        self.settled = False
        self.ended_at: Optional[float] = None  # time.perf_counter() when the run ended
        self.switched: list[HostLeaf] = []  # leaves that ran as their ``settled`` form
        self.error: Optional[BaseException] = None
        self._arrivals: "queue_mod.Queue" = queue_mod.Queue()
        self._cancelled = False
        self._queue: Any = None
        self._lock = threading.Lock()
        self._driven = False
        self._driver: Optional[threading.Thread] = None
        if not inline:
            self._driver = threading.Thread(target=self._drive, name="fo-run", daemon=True)
            _live.add(self)
            self._driver.start()

    # ---- the caller's side ------------------------------------------------------------
    def add(self, leaf: HostLeaf, ready: Any) -> None:
        """Hand over a leaf whose grad is complete once ``ready`` (an event, or None) is."""
        self._arrivals.put((leaf, ready))

    def add_all(self, leaves: Iterable[HostLeaf], ready: Any) -> None:
        """Hand over several leaves at once (chunks are cut across them as if they had all
        arrived together). An inline run takes them as they are cut: a generator's leaves are
        made then, in :meth:`wait`, while the workers run the chunks before."""
        if self.inline:
            self._arrivals.put((leaf, ready) for leaf in leaves)
            return
        batch = [(leaf, ready) for leaf in leaves]
        if batch:
            self._arrivals.put(batch)

    def close(self) -> None:
        """No more leaves: the run ends after those handed over."""
        self._arrivals.put(None)

    def settle(self) -> None:
        """From now on a leaf with a ``settled`` form that has not begun runs as that form (in
        place): a speculative step is known to commit. Those leaves are in :attr:`switched`
        once the run has ended."""
        self.settled = True

    def cancel(self) -> None:
        """Start no further chunk; the run ends as soon as the chunks under way are done."""
        with self._lock:
            self._cancelled = True
            if self._queue is not None:
                self._queue.cancel()
        self._arrivals.put(None)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the run ended — its driver thread has exited, so nothing of the run is
        left running (True) — or ``timeout`` passed (False). An inline run runs now."""
        if self._driver is None:
            if not self._driven:
                self._driven = True
                self._drive()
            return True
        self._driver.join(timeout)
        return not self._driver.is_alive()

    @property
    def done(self) -> bool:
        return self._driven if self._driver is None else not self._driver.is_alive()

    # ---- the driver thread ----------------------------------------------------------------
    @torch.no_grad()  # grad mode is per thread: views of params are cut and written here
    def _drive(self) -> None:
        leaves: list[HostLeaf] = []
        ready: list[Any] = []
        try:
            # copied through no ring (host grads): the first chunks ramp up (chunking.cut), so
            # that the workers start while the driver cuts the rest
            ramp = not self.ex.stages(self.device)
            packer = cut(self._arrivals, self.budget, leaves, ready, ramp)
            first = next(packer, None)
            if first is not None and not self._cancelled:
                with self.ex.holding(self.device):  # the device's ring serves one run at a time
                    _Pipeline(self, leaves, ready).run(first, packer)
        except BaseException as e:  # noqa: BLE001 - handed to the caller through wait()
            self.error = e
        finally:
            leaves.clear()  # the grads go now, in this thread, not at some later exit
            with self._lock:
                self._queue = None  # its chunks hold views of the leaves' buffers
            if self.chunk_done is not None:
                self.chunk_done(leaves, None)
            self.ended_at = time.perf_counter()

    def _set_queue(self, q: Any) -> bool:
        with self._lock:
            self._queue = q
            return not self._cancelled


def _part(x: Optional[torch.Tensor], start: int, stop: int) -> Optional[torch.Tensor]:
    """Elements ``start:stop`` of the 1-D tensor ``x`` (None stays None)."""
    return None if x is None else x[start:stop]


class _Pipeline:
    """The state of one run once its first chunk is cut and the device's ring is held."""

    def __init__(self, run: Run, leaves: list[HostLeaf], ready: list[Any]):
        ex = run.ex
        self.run_, self.leaves, self.ready = run, leaves, ready
        self.device = run.device
        self.t = ex.transport(run.device)
        self.ring = ex.ring(run.device, run.half)
        self.slot_events = ex.slot_events(run.device)
        self.S, self.half = ex.slots, run.half
        self.tl = ex.timeline
        self.before = list(self.slot_events)  # copies out of the previous run, per slot
        self.q = queue_for(run.kernel, run.threads, self.tl is not None)
        self.chunks: list[list[Segment]] = []
        self.begun: set[int] = set()  # leaves whose first segment was issued
        self.in_events: list[Any] = []
        self.in_waits: list[list[Any]] = []  # per chunk: the ready events its copy in waited for
        self.seen: set[Any] = set()  # ready events known to be complete (a copy after them was)
        self.out_events: list[Any] = []  # per chunk: its slot's last copy out once it is done
        self.landing: "queue_mod.Queue" = queue_mod.Queue()  # chunks for the lander; None ends
        # nothing copied through a ring (host grads, params written in place): no copy to wait
        # for, so each chunk is readied here as it is issued, with no lander thread
        self.lands_here = not run.ex.stages(run.device)
        self.failures: list[tuple[int, BaseException]] = []
        self.high_copied: Any = None  # the last copy up from a state's high halves

    # ---- helpers -------------------------------------------------------------------------
    def slot_bytes(self, k: int, which: int, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` from ``offset`` of chunk ``k``'s slot half: grads (``which`` 0) or params."""
        base = (2 * (k % self.S) + which) * self.half + offset
        return self.ring[base: base + nbytes]

    def at(self, seg: Segment, region: int) -> int:
        """Where segment ``seg`` lies in a slot half: its grads or new params (``region`` 0),
        its look-ahead's rates (1) or residuals (2: a byte per element, bf16 grads only)."""
        if region < 2:
            return seg.offset + region * self.run_.budget
        return seg.offset // self.leaves[seg.leaf].grad.element_size() + 2 * self.run_.budget

    def view(self, k: int, which: int, seg: Segment, dtype: torch.dtype,
             region: int = 0) -> torch.Tensor:
        """Segment ``seg``'s bytes in chunk ``k``'s slot half ``which`` (``region``: :meth:`at`)."""
        return self.slot_bytes(k, which, self.at(seg, region),
                               (seg.stop - seg.start) * dtype.itemsize).view(dtype)

    def spans(self, k: int, which: int, segs: list[Segment], region: int = 0,
              high: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(device tensor, slot tensor)`` pairs to copy for ``segs`` of chunk ``k``: their
        grads (``which`` 0) or new params (1; ``region`` 1 and 2: their look-ahead's rates and
        residuals; ``high``: the params' own bits, ``HostLeaf.param_high``, where the new
        params go). Segments that lie end to end in one storage as they do in the slot (a
        delayed step's buffer) are copied as one range of bytes: a copy per small leaf costs a
        call each, and a small copy up waits behind a long kernel."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        last = None  # (storage address, byte after the last span there, byte after it in the slot)
        for seg in segs:
            leaf = self.leaves[seg.leaf]
            x = (leaf.state[0] if high else leaf.grad if which == 0
                 else (leaf.out, leaf.ahead, leaf.residual)[region])
            if x.stride(0) != 1:  # a strided 1-D view: copied as itself
                out.append((x[seg.start:seg.stop], self.view(k, which, seg, x.dtype, region)))
                last = None
                continue
            storage, size = x.untyped_storage(), x.element_size()
            at, offset, nbytes = ((x.storage_offset() + seg.start) * size, self.at(seg, region),
                                  (seg.stop - seg.start) * size)
            if last == (storage.data_ptr(), at, offset):  # extends the last span
                before = out.pop()[0].numel()
                at, offset, nbytes = at - before, offset - before, nbytes + before
            dev = torch.empty(0, dtype=torch.uint8, device=x.device).set_(storage, at, (nbytes,))
            out.append((dev, self.slot_bytes(k, which, offset, nbytes)))
            last = (storage.data_ptr(), at + nbytes, offset + nbytes)
        return out

    def staged_grad(self, leaf: HostLeaf) -> bool:
        return self.ring is not None and (leaf.grad.device.type != "cpu" or self.run_.ex.stage_host_grads)

    def staged_out(self, leaf: HostLeaf) -> bool:
        """Whether the leaf's outputs are copied up from the ring (else written in place, or,
        with ``high``, copied up from there)."""
        return (leaf.out is not None and leaf.high is None and self.ring is not None
                and (leaf.out.device.type != "cpu" or self.run_.ex.stage_host_grads))

    def copied_up(self, leaf: HostLeaf) -> bool:
        """Whether the leaf's new param is copied up at all (staged, or from its high half)."""
        return leaf.out is not None and (self.staged_out(leaf) or (
            leaf.high is not None and leaf.out.device.type != "cpu"))

    def leaf_events(self, segments: list[Segment]) -> list[Any]:
        return list(dict.fromkeys(self.ready[seg.leaf] for seg in segments))

    # ---- stages --------------------------------------------------------------------------
    def issue_in(self, k: int) -> None:
        t, tl, chunk = self.t, self.tl, self.chunks[k]
        for seg in chunk:
            if seg.leaf not in self.begun:  # its form is decided when it begins
                self.begun.add(seg.leaf)
                leaf = self.leaves[seg.leaf]
                if self.run_.settled and leaf.settled is not None:
                    self.leaves[seg.leaf] = leaf.settled
                    self.run_.switched.append(leaf)
        copied = [seg for seg in chunk if self.staged_grad(self.leaves[seg.leaf])]
        grads: dict[int, torch.Tensor] = {}
        waits = self.leaf_events(copied)
        self.in_waits.append(waits)
        if copied:
            # a stream told to wait for an event of the caller's stream can block this thread
            # while the caller's launches fill that stream's queue: only events not yet seen done
            for event in waits:
                if event not in self.seen:
                    t.wait_in(event)
            s0 = tl.stamp(self.device, t.stream_in) if tl else None
            for seg in copied:
                grads[id(seg)] = self.view(k, 0, seg, self.leaves[seg.leaf].grad.dtype)
            for dev, host in self.spans(k, 0, copied):
                t.copy_in(host, dev)
            if tl:
                tl.span("D2H", f"grads c{k}", s0, tl.stamp(self.device, t.stream_in))
        highs = [seg for seg in chunk if self.leaves[seg.leaf].param_high]
        if highs:  # into the slot's new-params half, once its last copy up has read it
            t.wait_in(self.slot_events[k % self.S])
            s0 = tl.stamp(self.device, t.stream_in) if tl else None
            for dev, host in self.spans(k, 1, highs, high=True):
                t.copy_in(host, dev)
            if tl:
                tl.span("D2H", f"params c{k}", s0, tl.stamp(self.device, t.stream_in))
        self.in_events.append(t.mark_in() if copied or highs else None)
        pieces = []
        for seg in chunk:  # (no closures per segment: this runs once per leaf and step)
            leaf = self.leaves[seg.leaf]
            start, stop = seg.start, seg.stop
            whole = start == 0 and stop == leaf.grad.numel()  # no views to cut
            out = rate = residual = None
            if self.staged_out(leaf):
                out = self.view(k, 1, seg, leaf.out.dtype)
                if leaf.ahead is not None:
                    rate = self.view(k, 1, seg, leaf.ahead.dtype, 1)
                if leaf.residual is not None:
                    residual = self.view(k, 1, seg, leaf.residual.dtype, 2)
            elif leaf.out is not None and leaf.out.device.type == "cpu":  # in place
                out, rate, residual = leaf.out, leaf.ahead, leaf.residual
                if not whole:
                    out, rate, residual = (_part(out, start, stop), _part(rate, start, stop),
                                           _part(residual, start, stop))
            if whole:
                state, targets, ema, ema_target = leaf.state, leaf.targets, leaf.ema, leaf.ema_target
            else:
                state = tuple(blockwise.part(x, start, stop) for x in leaf.state)
                targets = tuple(blockwise.part(x, start, stop) for x in leaf.targets)
                ema, ema_target = _part(leaf.ema, start, stop), _part(leaf.ema_target, start, stop)
            if leaf.param_high:  # the high half: the param's bits, copied down; the new param
                #                   is the new high half, stepped in the slot
                if state:
                    state = (self.view(k, 1, seg, torch.int16), *state[1:])
                if targets:
                    targets = (self.view(k, 1, seg, torch.int16), *targets[1:])
                out = None
            grad = grads.get(id(seg))
            if grad is None:
                grad = leaf.grad if whole else leaf.grad[start:stop]
            pieces.append(Piece(grad, state, out, leaf.hyper, targets, ema, leaf.ema_decay,
                                ema_target, rate, leaf.ahead_hyper, residual))
        self.out_events.append(None)
        self.q.add(Work(pieces, block_size(chunk, self.run_.threads)))
        if not self.lands_here:
            self.landing.put(k)
        elif not self.failures:  # as the lander would, in this thread
            self.try_land(k)

    def land_one(self, k: int) -> None:
        """Mark chunk ``k`` ready once its inputs are in place."""
        self.t.wait_host(self.in_events[k])  # grads landed
        if self.in_events[k] is not None:
            self.seen.update(self.in_waits[k])
        self.t.wait_host(self.out_events[k - self.S] if k >= self.S else self.before[k % self.S])
        if faults.active():
            if k > 0:
                self.q.wait(k - 1)
            faults.before_chunk(k, list(dict.fromkeys(
                p for s in self.chunks[k]
                for p in self.leaves[s.leaf].members or (self.leaves[s.leaf].path,))))
        self.run_.started = True
        self.q.ready(k)

    def land(self) -> None:
        """The lander thread: each chunk, as the driver issues it, until one fails."""
        while (k := self.landing.get()) is not None and self.try_land(k):
            pass

    def try_land(self, k: int) -> bool:
        """:meth:`land_one`; a failure is recorded and cancels the queue (the chunks before
        ``k`` still complete and land), and False is returned."""
        try:
            self.land_one(k)
            return True
        except BaseException as e:  # noqa: BLE001 - surfaced by the driver
            self.failures.append((k, e))
            self.q.cancel()
            return False

    def complete(self, k: int) -> None:
        """Chunk ``k``'s kernel is done: copy its params out."""
        t, tl = self.t, self.tl
        error = self.q.wait(k)
        if error is not None:
            raise self.failures[0][1] if self.failures else error
        out = [seg for seg in self.chunks[k] if self.copied_up(self.leaves[seg.leaf])]
        if out:
            for event in self.leaf_events(out):
                if event not in self.seen:  # params on the device have their grads copied in
                    t.wait_out(event)
            s0 = tl.stamp(self.device, t.stream_out) if tl else None
            high = [seg for seg in out if self.leaves[seg.leaf].high is not None]
            staged = [seg for seg in out if self.leaves[seg.leaf].high is None]
            rates = [seg for seg in staged if self.leaves[seg.leaf].ahead is not None]
            residuals = [seg for seg in rates if self.leaves[seg.leaf].residual is not None]
            for dev, host in (self.spans(k, 1, staged) + self.spans(k, 1, rates, 1)
                              + self.spans(k, 1, residuals, 2)):
                t.copy_out(dev, host)
            for seg in high:  # from the state's high half, where the kernel wrote the param
                leaf = self.leaves[seg.leaf]
                t.copy_out(leaf.out[seg.start:seg.stop], leaf.high[seg.start:seg.stop].view(leaf.out.dtype))
            if tl:
                tl.span("H2D", f"params c{k}", s0, tl.stamp(self.device, t.stream_out))
            self.slot_events[k % self.S] = t.mark_out()
            if high:
                self.high_copied = self.slot_events[k % self.S]
        self.out_events[k] = self.slot_events[k % self.S]  # no copy out: the out half is as it was
        if self.run_.chunk_done is not None:
            self.run_.chunk_done(self.leaves, self.chunks[k])

    # ---- the loop ------------------------------------------------------------------------
    def run(self, first: list[Segment], packer: Iterator[list[Segment]]) -> None:
        run = self.run_
        if not run._set_queue(self.q):
            return
        alone = False  # one chunk and one worker: this thread is the worker and the lander
        if run.inline and run.threads == 1 and run.ex.cpus is None:  # (else: a pinned worker)
            second = next(packer, None)  # every leaf has arrived: is there a second chunk?
            alone = second is None
            packer = itertools.chain(() if alone else (second,), packer)
        lander = join = None
        if not alone:
            try:
                join = run.ex.start_workers(self.q, run.threads)
                if not self.lands_here:
                    lander = threading.Thread(target=self.land, name="fo-land", daemon=True)
                    lander.start()
            except BaseException:  # no thread to be had: the workers started leave, unused
                self.q.cancel()
                if join is not None:
                    join()
                raise
        done = at = 0  # chunks completed; the chunk being issued or completed
        try:
            chunk: Optional[list[Segment]] = first
            if alone:
                self.chunks.append(first)
                self.issue_in(0)  # (readies it, or the next line does)
                if not self.lands_here:
                    self.land_one(0)
                self.q.close()
                self.q.work(0)
                chunk = None
            while chunk is not None and not run._cancelled:
                at = len(self.chunks)
                self.chunks.append(chunk)
                self.issue_in(at)
                if at + 1 >= self.S:  # the next chunk takes slot (at+1) mod S: its last user is done
                    at = done
                    self.complete(done)
                    done += 1
                chunk = next(packer, None)
            self.q.close()
            while done < len(self.chunks) and not run._cancelled:
                at = done
                self.complete(done)
                done += 1
        except BaseException as e:  # noqa: BLE001 - raised below, naming the chunk's leaves
            if not self.failures:  # else this follows from the lander's failure (recorded first)
                self.failures.append((at, e))
            self.q.cancel()
        finally:
            self.q.close()
            if lander is not None:
                self.landing.put(None)
                lander.join()
            if join is not None:
                join()
            for ev in self.in_events:  # never return while a copy in still reads the grads
                self.t.wait_host(ev)
            self.t.wait_host(self.high_copied)  # nor a copy up the state's high halves
            if self.tl:
                for w, k, waiting, a, b in self.q.spans():
                    self.tl.span(f"fo-host_{w}", f"{'wait' if waiting else 'kernel'} c{k}", a, b)
        if self.failures and not run._cancelled:
            k, e = self.failures[0]
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: as themselves
                raise e
            paths = tuple(dict.fromkeys(path for s in self.chunks[k] for path in
                                        self.leaves[s.leaf].members or (self.leaves[s.leaf].path,)))
            raise HostStepError(paths, e) from e
