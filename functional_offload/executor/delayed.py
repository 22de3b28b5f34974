"""The delayed parameter update's step in flight: a run in the background, landed later.

:class:`Landing` first copies the grads into a buffer of its own on their device (one fused copy
on the caller's stream), so the caller may free, zero or accumulate into its grads at once;
grads that are the landing's own (``own``: new tensors nothing else holds, a clip's) stay where
they are, as their own regions. The run then copies each chunk of grads down from its region,
and each chunk's new params up into the same bytes as soon as the chunk's kernel is done —
during the caller's next forward and backward. The step lands when :meth:`Landing.land` is
called (by the next update, or ``flush``): one device-side copy of the new params over the
params, after the work the caller queued meanwhile (which read the old params). Landing is
idempotent and runs to its end even when the caller's thread is interrupted (the caller runs it
through :func:`~functional_offload.executor.shield.shielded`).

With a look-ahead (``ahead``, the optimizer's device side of it) the run leaves two values per
element in place of the new param, the look-ahead's *base* and *rate* (``kernels/host.py``): the
rates take a second region of the buffer (the grads' bytes again), and for a bf16 base the byte
of its fp32 bits below it a third (``kernels/remainder.py``, ``split_base``). Landed with the next
step's grads, each param becomes ``ahead(params, bases, residuals, rates, grads, ...)``: about
the value that step will compute, rounded once, so the forward after it reads what the step it
feeds applies its grads to. Landed
without them (a flush, a checkpoint, a failed run) or for a param without a grad, the params are
set from the new values themselves (fp32 masters, rounded as the step rounds them): exactly.
The look-ahead reads the params the device holds as the last look-ahead's, a prediction of the
new values; a *fresh* param's (the first delayed step, or one after a flush or an exact step:
it is a step behind) are set from the new values first, copied up once.

A leaf of the run may update several params (a packed run of small ones: its elements are
theirs, each from an offset): each lands as a leaf of its own would, with its own grad, and
the leaf's new params are copied to them from the buffer.

Without a look-ahead, an :class:`EngineJob` (the GPU engine) may step some of the leaves on the
device instead: it reads their grads from the buffer and writes their new params into the
same bytes, on a stream of its own in a thread of its own, beside the run; its leaves land as
the run's do, once their math is queued.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from functional_offload.executor.host import HostExecutor
from functional_offload.executor.chunking import ALIGN, HostLeaf, Segment
from functional_offload.kernels.work import Kernel

__all__ = ["EngineJob", "Landing"]


Targets = Optional[Sequence[tuple[int, torch.Tensor]]]  # a leaf's params: (offset, 1-D param)
Pieces = list[tuple[int, int, int]]  # (leaf, first element, end) whose new params are queued


class EngineJob(Protocol):
    """The part of a delayed step the GPU engine steps: ``leaves``, positions in the landing's
    leaves (each with params to write). :meth:`prepare` runs in the caller's thread, before
    anything starts (what can fail before a byte is written: its device buffers); :meth:`run`
    in a thread of its own, on a stream of its own that waits for the grads, calling ``done``
    once that stream is ordered after each chunk's math (on the executor's math streams), with
    the pieces of leaves whose new params it writes."""

    leaves: Sequence[int]

    def prepare(self, grads: dict[int, torch.Tensor], outs: dict[int, torch.Tensor]) -> None:
        """``grads``: each leaf's grad (1-D, in the landing's buffer); ``outs``: where its new
        params go (1-D, the same bytes where the dtypes have one size)."""

    def run(self, done: Callable[[Pieces], None]) -> None: ...


def _regions(leaves: Sequence[HostLeaf], targets: Sequence[Targets],
             device: torch.device, ahead: bool,
             reuse: Optional[list[torch.Tensor]],
             kept: Sequence[bool]) -> tuple[torch.Tensor, list[torch.Tensor],
                                            list[Optional[torch.Tensor]],
                                            list[Optional[torch.Tensor]],
                                            list[Optional[torch.Tensor]]]:
    """One buffer on ``device``: per leaf a region for its grad, one for its new param (or
    look-ahead base) and, with ``ahead``, one for its look-ahead rate (the grad's dtype) and,
    for a bf16 grad, one for its base's residual (``int8``); the first two share their bytes
    when the dtypes have one size (chunk ``k``'s params are copied up only after its grads were
    copied down). A leaf whose grad is ``kept`` has the grad itself as its grad's region (and
    its param's, where they share bytes)."""
    size = 0

    def take(nbytes: int, align: int = ALIGN) -> int:
        nonlocal size
        at, size = size, size + -(-nbytes // align) * align
        return at

    spans = []
    for leaf, target, keep in zip(leaves, targets, kept):
        n, g_size = leaf.grad.numel(), leaf.grad.element_size()
        g_at = None if keep else take(n * g_size)
        spans.append((g_at, g_at if target is None or target[0][1].element_size() == g_size
                      else take(n * target[0][1].element_size())))
    # the rates after every param: the leaves' rates lie end to end, as in a slot (one copy)
    rate_at = [take(leaf.grad.numel() * leaf.grad.element_size()) if ahead and target is not None
               else None for leaf, target in zip(leaves, targets)]
    # the residuals end to end as in a slot too, where a bf16 segment's lie at half its offset
    res_at = [take(leaf.grad.numel(), ALIGN // 2)
              if r is not None and leaf.grad.dtype == torch.bfloat16 else None
              for leaf, r in zip(leaves, rate_at)]
    old = reuse.pop() if reuse else None  # (its holder's reference goes with it)
    if old is not None and old.device == device and size <= old.numel() <= 2 * size:
        buf = old  # (a landed step's: its reads were ordered before the caller's stream)
    else:
        old = None  # let go of it before allocating
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype (size: a multiple of ALIGN)

    def region(at: Optional[int], n: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if at is None:
            return None
        if dtype not in typed:
            typed[dtype] = buf.view(dtype)
        at //= dtype.itemsize  # (every region starts aligned to its dtype)
        return typed[dtype][at: at + n]

    grads, params, rates, residuals = [], [], [], []
    for (g_at, p_at), r_at, e_at, leaf, target in zip(spans, rate_at, res_at, leaves, targets):
        n, dtype = leaf.grad.numel(), leaf.grad.dtype
        grads.append(leaf.grad if g_at is None else region(g_at, n, dtype))
        params.append(None if target is None else leaf.grad.view(target[0][1].dtype)
                      if p_at is None else region(p_at, n, target[0][1].dtype))
        rates.append(region(r_at, n, dtype))
        residuals.append(region(e_at, n, torch.int8))
    return buf, grads, params, rates, residuals


def _alone(grad: torch.Tensor, device: torch.device) -> bool:
    """Whether ``grad`` (1-D) can be a landing's region itself: a dense tensor on ``device``
    whose memory is its bytes alone (not a view into a larger block others may hold)."""
    return (type(grad) is torch.Tensor and grad.device == device and grad.is_contiguous()
            and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size())


def _by_leaf(pairs: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    """``(leaf, param)`` pairs grouped by leaf, in order."""
    out: dict[int, list[int]] = {}
    for j, k in pairs:
        out.setdefault(j, []).append(k)
    return out


def _latest(marks: dict[int, tuple[int, Any]],
            which: Optional[Sequence[int]] = None) -> Optional[Any]:
    """Of the engine's marks of leaves ``which`` (default: all), the event of the chunk queued
    last (None: the engine stepped none of them)."""
    last = max((marks[j] for j in (marks if which is None else which) if j in marks),
               default=None, key=lambda m: m[0])
    return None if last is None else last[1]


def _value(leaf: HostLeaf) -> torch.Tensor:
    """The leaf's new value as its param takes it: the master, or a split master's high half."""
    value = leaf.state[0]
    return value.view(torch.bfloat16) if value.dtype == torch.int16 else value


class Landing:
    """A delayed host step of ``leaves`` (their ``param`` ignored): ``targets[i]`` are leaf
    ``i``'s params, ``(offset, param)`` pairs (each param 1-D, of one dtype, its elements the
    leaf's from ``offset``: ``[(0, param)]`` for a leaf of one), or None when its value is the
    param itself. ``ahead``: the device side of a look-ahead, ``ahead(params, bases, residuals,
    rates, grads, hyper, next_hyper)``, for leaves that carry the next step's hyperparameters
    (``HostLeaf.ahead_hyper``); ``fresh[i][k]``: param ``k`` of leaf ``i`` is not the last
    look-ahead's (default: all); ``engine``: the leaves the GPU engine steps instead of the
    run (without ``ahead`` only); ``own[i]``: leaf ``i``'s grad is the landing's to keep and
    overwrite (nothing else holds it): a dense one on the device is not copied; see the
    module."""

    def __init__(self, executor: HostExecutor, leaves: Sequence[HostLeaf], kernel: Kernel,
                 targets: Sequence[Targets], threads: Optional[int] = None,
                 ahead: Optional[Callable[..., None]] = None,
                 fresh: Optional[Sequence[Sequence[bool]]] = None,
                 engine: Optional[EngineJob] = None,
                 buffer: Optional[list[torch.Tensor]] = None,
                 own: Optional[Sequence[bool]] = None):
        if engine is not None and (ahead is not None or any(targets[j] is None
                                                           for j in engine.leaves)):
            raise ValueError("the GPU engine steps leaves with params to write, without a "
                             "look-ahead")
        self.ex, self.targets, self.ahead = executor, [None if t is None else list(t)
                                                       for t in targets], ahead
        for leaf, t in zip(leaves, self.targets):
            if t is not None and len({p.dtype for _, p in t}) > 1:
                raise ValueError(f"leaf {leaf.path!r}: its params differ in dtype")
        self._fresh = ([list(f) for f in fresh] if fresh is not None
                       else [[True] * len(t or ()) for t in self.targets])
        self.ahead_landed: list[tuple[int, int]] = []  # (leaf, param) landed from a look-ahead
        self.device = leaves[0].grad.device
        self._values = [_value(leaf) for leaf in leaves] if ahead else []
        self._hypers = [(leaf.hyper, leaf.ahead_hyper) for leaf in leaves] if ahead else []
        kept = [bool(own is not None and own[j]) and _alone(leaf.grad, self.device)
                for j, leaf in enumerate(leaves)]
        buf, grads, self._up, self._rates, self._residuals = _regions(
            leaves, self.targets, self.device, ahead is not None, buffer, kept)
        self._buf: Optional[torch.Tensor] = buf  # kept for the next step only if land() is asked
        self._read_on: set[Any] = set()  # streams land_leaves read it on (other than the caller's)
        # the memory the run reads and writes: the buffer and the grads kept
        self._memory = [x for x in (buf, *(g for g, k in zip(grads, kept) if k)) if x.numel()]
        copied = [(g, leaf.grad) for g, leaf, k in zip(grads, leaves, kept) if not k]
        if copied:  # the caller's grads are free now
            torch._foreach_copy_(*map(list, zip(*copied)))
        on_engine = set(engine.leaves) if engine is not None else set()
        stream = executor.engine_stream(self.device) if engine is not None else None
        if engine is not None:  # (a failure here: nothing started) its buffers on its stream
            with torch.cuda.stream(stream):
                engine.prepare({j: grads[j] for j in on_engine},
                               {j: self._up[j] for j in on_engine})
            for on in (stream, *executor.engine_math_streams(self.device)):
                self._used_on(on)  # its math reads the grads and writes the params there
        self.began = time.perf_counter()
        t = executor.transport(self.device)
        for copies in (t.stream_in, t.stream_out):
            if copies is not None:  # the run reads and writes them on the copy streams
                self._used_on(copies)
        self._done: list[Segment] = []  # segments whose new params are copied up (or in place)
        self._lock = threading.Lock()
        self._landed = False
        self._landed_leaves: set[int] = set()  # asked for before the rest (land_leaves)
        self._copied: set[int] = set()  # those and the others land_leaves copied with them
        # per leaf, its elements whose new params are not copied up yet; the run's progress
        self._left = [leaf.grad.numel() for leaf in leaves]
        self._finished: list[int] = []  # the leaves whose copies up are all issued, in order
        self._taken = 0  # how many of them land_leaves has seen
        self._ended = [0]  # the parts (the run, the engine) that ended (or failed)
        self._part_count = 1 if engine is None else 2
        self._progress = threading.Condition()
        ready = executor.ready(self.device)  # the copies above are complete here
        # (not self in the callback: no cycle through the run keeps the buffer past its step)
        done, left, ended, progress = self._done, self._left, self._ended, self._progress
        finished = self._finished

        def chunk_done(_: Any, segs: Optional[list[Segment]]) -> None:
            with progress:
                if segs is None:  # the run's end
                    ended[0] += 1
                for seg in segs or ():
                    done.append(seg)
                    left[seg.leaf] -= seg.stop - seg.start
                    if left[seg.leaf] <= 0:
                        finished.append(seg.leaf)
                progress.notify_all()

        # the run numbers its leaves as it is handed them (those the engine does not step): its
        # segments are counted against the leaves here by their positions in ``leaves``
        at = [j for j in range(len(leaves)) if j not in on_engine]

        def run_done(run_leaves: Any, segs: Optional[list[Segment]]) -> None:
            chunk_done(run_leaves,
                       None if segs is None else [s._replace(leaf=at[s.leaf]) for s in segs])

        self.run = executor.open(self.device, kernel, threads, chunk_done=run_done,
                                 ahead=ahead is not None, beside=True)
        self._engine_ended: list[Optional[float]] = [None]  # time.perf_counter() at its end
        self._engine_error: list[Optional[BaseException]] = [None]
        # per leaf it steps, its last chunk's math: (that chunk's place in the order, event)
        self._engine_marks: dict[int, tuple[int, torch.cuda.Event]] = {}
        self._engine: Optional[threading.Thread] = None
        if engine is not None:  # started before the run has leaves: if it cannot start, the
            try:                # run ends with none, and nothing was written
                self._engine = self._start(engine, stream, ready, chunk_done, self.run)
            except BaseException:
                self.run.close()
                self.run.wait()
                raise
        self.run.add_all([leaf._replace(grad=g, out=p, ahead=r, residual=e,
                                        high=leaf.high if r is None else None)
                          for j, (leaf, g, p, r, e) in enumerate(zip(
                              leaves, grads, self._up, self._rates, self._residuals))
                          if j not in on_engine], ready)
        self.run.close()

    def _used_on(self, stream: Any) -> None:
        """The buffer and the grads kept are used on ``stream`` too: their memory is not
        reused before its work queued so far is done."""
        for t in self._memory:
            t.record_stream(stream)

    def _start(self, engine: EngineJob, stream: "torch.cuda.Stream", ready: Any,
               chunk_done: Callable[[Any, Optional[list[Segment]]], None],
               run: Any) -> threading.Thread:
        """The engine's thread, on the executor's engine stream, which waits for ``ready``;
        each chunk's math queued marks its pieces done (as the run's chunk_done does) and the
        events the landing waits for (each leaf's last chunk's); its end counts as a
        part's. Its error cancels the CPU kernel's ``run`` (the step has failed: the landing
        raises it)."""
        error, ended_at = self._engine_error, self._engine_ended
        device, progress = self.device, self._progress  # (not self: no cycle through the thread)
        marks, counted = self._engine_marks, itertools.count()

        def done(pieces: Pieces) -> None:
            mark = torch.cuda.current_stream(device).record_event()
            with progress:
                n = next(counted)
                for j, _, _ in pieces:
                    marks[j] = (n, mark)
            chunk_done(None, [Segment(j, lo, hi, 0) for j, lo, hi in pieces])

        def body() -> None:
            try:
                with torch.no_grad(), torch.cuda.stream(stream):
                    if ready is not None:
                        stream.wait_event(ready)
                    engine.run(done)
            except BaseException as e:  # noqa: BLE001 - raised by the landing
                error[0] = e
                run.cancel()
            finally:
                ended_at[0] = time.perf_counter()
                chunk_done(None, None)

        thread = threading.Thread(target=body, name="functional_offload GPU engine", daemon=True)
        thread.start()
        return thread

    def take_buffer(self) -> Optional[torch.Tensor]:
        """The device buffer of a step :meth:`land` kept (``keep=True``) and that landed
        without an error, once, for the next delayed step (its size mostly the same: the grads
        of the same params), if nothing read it on another stream than the caller's; None
        otherwise (then it goes)."""
        buf, self._buf = self._buf, None
        here = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if not self._landed or self._failure() is not None or self._read_on - {here}:
            return None
        return buf

    @property
    def engine_ended_at(self) -> Optional[float]:
        """``time.perf_counter()`` when the engine ended (None: none, or not yet)."""
        return self._engine_ended[0]

    def wait(self) -> None:
        """Wait until the run and the engine ended."""
        self.run.wait()
        if self._engine is not None:
            self._engine.join()

    def _failure(self) -> Optional[BaseException]:
        """The run's error, else the engine's (once they ended)."""
        return self.run.error or self._engine_error[0]

    @property
    def landed_early(self) -> set[int]:
        """The leaves :meth:`land_leaves` was asked for (those it copied besides are not)."""
        return self._landed_leaves

    @property
    def error(self) -> Optional[BaseException]:
        """The host step's error once the run and the engine ended (None while they run or when
        they succeeded)."""
        if not self.run.done or (self._engine is not None and self._engine.is_alive()):
            return None
        return self._failure()

    def land(self, ready: Any,
             grads: Optional[Sequence[Sequence[Optional[torch.Tensor]]]] = None,
             keep: bool = False) -> None:
        """Wait for the run, then copy the new params of its finished chunks over the params
        (after ``ready``, the caller's stream's mark) and raise the run's error. With a
        look-ahead: ``grads`` (per leaf, per param of its ``targets``: the next step's grad on
        the device, or None) give the params their look-ahead; without them the params are set
        from the new values. The
        caller's stream is ordered after the copies (:meth:`~functional_offload.executor.
        HostExecutor.order_after_copies`). ``keep``: the device buffer stays for
        :meth:`take_buffer` (else it goes). Idempotent; call from shielded work."""
        with self._lock:
            try:
                if not self._landed:
                    if self.ahead is not None:
                        self._land_ahead(grads)
                    else:
                        self._land(ready)
                    self._landed = True
            finally:
                if not keep:
                    self._buf = None
        failure = self._failure()
        if failure is not None:
            raise failure

    def _parts(self, j: int, region: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """Leaf ``j``'s ``region`` (a region of the buffer, or its new values) cut as its params
        lie in it."""
        return [] if region is None else [region[at: at + p.numel()]
                                          for at, p in self.targets[j]]

    @torch.no_grad()
    def _land_ahead(self, grads: Optional[Sequence[Sequence[Optional[torch.Tensor]]]]) -> None:
        """Each param from its base, rate and next grad on the caller's stream (which then
        holds the grads' lifetime), or from its value, synchronously (the next step changes the
        values in place)."""
        self.run.wait()
        self.ex.order_after_copies(self.device)  # the bases and rates are up
        use = [(j, k) for j, t in enumerate(self.targets) for k in range(len(t or ()))]
        if grads is not None and self.run.error is None:
            moved = [(j, k) for j, k in use if grads[j][k] is not None
                     and grads[j][k].numel() == self.targets[j][k][1].numel()]
            fresh = [(j, k) for j, k in moved if self._fresh[j][k]]
            self._set_values(fresh)  # a step behind: the look-ahead reads the new values
            whole = self._gather(moved, grads)
            # what each landing takes: (leaf, param, base, residual, rate, grad); a gathered
            # leaf's whole regions, else each moving param's slices of them
            units: list[tuple] = []
            for j, ks in _by_leaf(moved).items():
                if j in whole:
                    units.append((j, whole[j][0], self._up[j], self._residuals[j],
                                  self._rates[j], whole[j][1]))
                    continue
                bases, residuals, rates = (self._parts(j, x) for x in
                                           (self._up[j], self._residuals[j], self._rates[j]))
                units += [(j, self.targets[j][k][1], bases[k], residuals[k] if residuals else None,
                           rates[k], grads[j][k].reshape(-1)) for k in ks]
            groups: dict[tuple[int, int], list[tuple]] = {}  # params of one decay share hypers
            for u in units:
                groups.setdefault(tuple(id(h) for h in self._hypers[u[0]]), []).append(u)
            for group in groups.values():
                _, *columns = zip(*group)
                self.ahead(*map(list, columns), *self._hypers[group[0][0]])
            if whole:  # the gathered leaves' new params to their params
                torch._foreach_copy_([p for j in whole for _, p in self.targets[j]],
                                     [x for j in whole for x in self._parts(j, whole[j][0])])
            landed = set(moved)
            use = [jk for jk in use if jk not in landed]
            self.ahead_landed = moved
        self._set_values(use)
        if self.device.type == "cuda":  # the look-ahead read them on the caller's stream
            self._used_on(torch.cuda.current_stream(self.device))
        self._up = self._rates = self._residuals = self._values = self._hypers = []
        self._memory = []

    def _gather(self, moved: list[tuple[int, int]],
                grads: Sequence[Sequence[Optional[torch.Tensor]]]
                ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The leaves of several params that all move (a packed run's) as one tensor each: per
        leaf its params and next grads laid out as its elements are, gathered by one
        multi-tensor copy (its bases, residuals and rates are so already)."""
        out = {}
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for j, ks in _by_leaf(moved).items():
            if len(ks) == len(self.targets[j]) > 1:
                p = torch.empty_like(self._up[j])
                g = torch.empty(p.numel(), dtype=grads[j][0].dtype, device=self.device)
                out[j] = (p, g)
                for (a, t), gk in zip(self.targets[j], grads[j]):
                    dst += [p[a: a + t.numel()], g[a: a + t.numel()]]
                    src += [t, gk.reshape(-1)]
        if dst:
            torch._foreach_copy_(dst, src)
        return out

    def _set_values(self, which: list[tuple[int, int]]) -> None:
        """Params ``which`` ((leaf, param) pairs) set from their leaves' new values, copied up
        (:meth:`~functional_offload.executor.HostExecutor.upload`: done reading the values on
        return, as the next step changes them in place; the caller's stream ordered after)."""
        dsts, srcs = [], []
        for j, ks in _by_leaf(which).items():
            values = self._parts(j, self._values[j])
            dsts += [self.targets[j][k][1] for k in ks]
            srcs += [values[k] for k in ks]
        if dsts:
            self.ex.upload(self.device, dsts, srcs)

    def note_landed(self, which: Sequence[int]) -> bool:
        """Whether leaves ``which`` were all copied by :meth:`land_leaves` already (along with
        others); if so they count as asked for, as if it had been called for them."""
        with self._lock:
            if not self._copied.issuperset(which) or self._failure() is not None:
                return False  # (a failed run: land_leaves raises its error)
            self._landed_leaves.update(which)
            return True

    @torch.no_grad()
    def land_leaves(self, which: Sequence[int]) -> None:
        """Land leaves ``which`` (positions in ``leaves``) before the rest: wait (on the host)
        until the run has issued their new params' copies up, order the caller's stream after
        the copies up issued so far, and copy the new params over the params on the caller's
        stream (after its reads of the old ones). The copy stream is not made to wait for the
        caller's stream, so the run's later copies up go on while the caller computes. Every
        other leaf whose copies up were issued meanwhile (of the GPU engine's, whose math has
        run) lands with them (one copy for all: the later calls for those find them landed).
        Raises the run's error if it failed first. Without a look-ahead only (its params land
        with the next step's grads). A leaf landed here is left out of :meth:`land`'s copies."""
        if self.ahead is not None:
            raise ValueError("a look-ahead's params land with the next step's grads, all at "
                             "once: land leaves early only without one (fo.Delay(lookahead="
                             "False))")
        with self._lock:
            if self._landed:
                return
            want = [j for j in dict.fromkeys(which) if j not in self._landed_leaves]
            with self._progress:
                self._progress.wait_for(lambda: self._ended[0] >= self._part_count or all(
                    self._left[j] <= 0 for j in want))
                more, self._taken = self._finished[self._taken:], len(self._finished)
                marks = dict(self._engine_marks)
            if self._ended[0] >= self._part_count:  # all ended (all done, or failed: raise the error)
                self.wait()
                failure = self._failure()
                if failure is not None:
                    raise failure
            # (the engine queues its chunks ahead: a leaf of it not asked for lands with these
            # only once its math is done, else its own call would wait for it)
            more = [j for j in more if j not in marks or marks[j][1].query()]
            copy = [j for j in dict.fromkeys(want + more) if j not in self._copied]
            last = _latest(marks, copy)
            pairs = [(p, x) for j in copy if self.targets[j] is not None
                     for (_, p), x in zip(self.targets[j], self._parts(j, self._up[j]))]
            if pairs:
                self.ex.order_after_copies(self.device)  # their copies up are issued
                if last is not None:  # and the engine's math of those it stepped
                    torch.cuda.current_stream(self.device).wait_event(last)
                cuda = self.device.type == "cuda"
                here = torch.cuda.current_stream(self.device) if cuda else None
                if here is not None and here not in self._read_on:
                    self._used_on(here)  # read on this stream too (recorded once: the memory's
                    self._read_on.add(here)  # free waits for all the stream's work until then)
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
            self._copied.update(copy)
            self._landed_leaves.update(want)

    @torch.no_grad()
    def _land(self, ready: Any) -> None:
        self.wait()
        t, tl = self.ex.transport(self.device), self.ex.timeline
        early = self._copied
        if self._failure() is None:  # every chunk is done: whole leaves, no slice per segment
            pairs = [(p, x) for j, t in enumerate(self.targets) if t is not None and j not in early
                     for (_, p), x in zip(t, self._parts(j, self._up[j]))]
        else:  # the params' elements in the finished segments
            pairs = [(p[lo - at: hi - at], self._up[s.leaf][lo:hi])
                     for s in self._done if self.targets[s.leaf] is not None
                     and s.leaf not in early for at, p in self.targets[s.leaf]
                     for lo, hi in [(max(at, s.start), min(at + p.numel(), s.stop))] if lo < hi]
        if pairs:
            t.wait_out(ready)  # the caller's reads of the old params come first
            # the engine's params are written: its last chunk's math (None: it stepped none)
            t.wait_out(_latest(self._engine_marks))
            s0 = tl.stamp(self.device, t.stream_out) if tl else None
            t.copy_out_all([d for d, _ in pairs], [s for _, s in pairs])
            if tl:
                tl.span("H2D", "land params", s0, tl.stamp(self.device, t.stream_out))
        self._up = self._memory = []  # the buffer and the grads kept go (once the copies above
        #                                ran: they are recorded on the stream)
