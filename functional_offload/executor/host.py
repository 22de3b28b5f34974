"""The host executor: pinned staging rings, copy streams and worker threads, shared by runs.

One process-wide executor (:func:`default_executor`) serves every optimizer built without an
``executor=``, so two optimizers (or two ``TorchOptimizer`` param groups) share one ring and one
set of threads instead of making their own. Runs for one device take turns on its ring; runs for
different devices have rings of their own but share the worker threads.

Local ranks of one node share its cores and memory bandwidth: the default executor gives each
local rank (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, as ``torchrun`` sets them) its own slice of
the physical cores, pins its worker threads to that slice (one thread per core), and divides
the default staging bytes among the local ranks.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from functional_offload.executor.chunking import ALIGN, HostLeaf, Segment
from functional_offload.executor.run import Run
from functional_offload.executor.shield import shielding
from functional_offload.executor.timeline import Timeline
from functional_offload.executor.transport import (CudaTransport, Transport, streams_apart,
                                                   transport_for)
from functional_offload.kernels.work import Kernel

__all__ = ["HostExecutor", "SplitStep", "default_executor", "physical_cores", "node_share"]


class SplitStep(NamedTuple):
    """One step of ``engine="both"``: the leaves each engine stepped, the times predicted for
    them (from the rates measured at that share, else in the step before; None while an
    engine's rate is unknown) and the times they took, in seconds: the GPU engine's from the
    hand-over of the CPU kernel's leaves until its last copy down landed, the CPU kernel's until
    its runs' threads ended (their last copies up may still be in flight). ``gpu_rate``,
    ``cpu_rate``: elements a second, this step's, or the last one measured where an engine
    stepped nothing (0: none yet)."""

    share: float  # of the elements with a grad the GPU engine can step, those it stepped
    gpu: tuple[str, ...]  # the leaves it stepped
    gpu_elements: int
    cpu_elements: int  # the CPU kernel's, small packed leaves and leaves the engine cannot step
    predicted_gpu_s: Optional[float]
    predicted_cpu_s: Optional[float]
    gpu_s: float
    cpu_s: float
    gpu_rate: float
    cpu_rate: float
    phase: str  # how the share was chosen: "fixed" (the executor's gpu_share), "warm-up",
    #             "search", "settled" (see forms/split.py)
    leaves: tuple[tuple[str, str, int], ...]  # (path, "gpu" or "cpu", elements) of each leaf
    #                                           stepped, in the params' order

    def per_leaf(self) -> str:
        """A line per leaf: its path, engine, elements and predicted ms (its part, by elements,
        of its engine's predicted time)."""
        lines = [f"{'leaf':<40} engine  {'elements':>14}  predicted ms"]
        for path, engine, n in self.leaves:
            s, total = ((self.predicted_gpu_s, self.gpu_elements) if engine == "gpu"
                        else (self.predicted_cpu_s, self.cpu_elements))
            ms = "-" if s is None or not total else f"{s * 1e3 * n / total:.2f}"
            lines.append(f"{path:<40} {engine:<6}  {n:>14,}  {ms:>12}")
        return "\n".join(lines)

    def __str__(self) -> str:
        def ms(x: Optional[float]) -> str:
            return "-" if x is None else f"{x * 1e3:.1f}"
        return (f"engine  elements        predicted ms  measured ms   "
                f"(GPU share {self.share:.3f}, {self.phase})\n"
                f"gpu     {self.gpu_elements:>14,}  {ms(self.predicted_gpu_s):>12}  {ms(self.gpu_s):>11}\n"
                f"cpu     {self.cpu_elements:>14,}  {ms(self.predicted_cpu_s):>12}  {ms(self.cpu_s):>11}")

_NODE_STAGING_BYTES = 1 << 30  # pinned staging of the default executors of one node, in all


def _cores() -> list[list[int]]:
    """This process's allowed CPUs grouped by physical core (hyper-threads together)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return [[i] for i in range(os.cpu_count() or 1)]
    cores: dict[tuple[str, str], list[int]] = {}
    try:
        cpu = pkg = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cpu = int(val)
                elif key == "physical id":
                    pkg = val.strip()
                elif key == "core id" and cpu in allowed:
                    cores.setdefault((pkg or "", val.strip()), []).append(cpu)
    except OSError:
        pass
    return sorted(cores.values()) if cores else [[c] for c in allowed]


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads not counted)."""
    return max(1, len(_cores()))


def node_share() -> tuple[int, int, list[int]]:
    """``(local_rank, local_world_size, cpus)``: this local rank's slice of the node's physical
    cores (one CPU id per core), from ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``. Every local rank of
    a node sees the same cores; rank ``r`` of ``L`` takes the ``r``-th of ``L`` equal slices."""
    rank = int(os.environ.get("LOCAL_RANK", 0))
    size = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cores = _cores()
    per = max(1, len(cores) // size)
    mine = cores[rank * per:(rank + 1) * per] if rank * per < len(cores) else cores[-per:]
    return rank, size, [c[0] for c in mine]


ENGINE_CHUNK = 128 << 20  # bytes: the GPU engine's chunks by default
# A delayed step's runs (the CPU kernel's and the GPU engine's, beside the caller's next forward
# and backward) cut chunks this many times as big: while the caller's queue of launches on the
# default stream is full, a CUDA call of any other thread waits about one of its kernels
# (docs/performance.md), and a chunk costs each engine a few calls whatever its size.
BESIDE = 4


class HostExecutor:
    """Runs the host part of updates; owns the staging rings and the worker threads.

    Args:
      chunk_bytes: grad bytes per chunk (and per ring-slot half), a multiple of 64; MBs to tens
        of MBs.
      slots: ring slots; ``slots - 1`` chunks of grads copy in ahead of the kernel.
      threads: worker threads (default: physical cores).
      cpus: pin worker ``i`` to CPU ``cpus[i % len(cpus)]`` (default: no pinning).
      timeline: a :class:`Timeline` to record per-chunk spans into (off by default).
      stage_host_grads: copy grads that are already in host memory, and the new params of host
        params, through the ring too, as a GPU's are (slower; it runs the GPU pipeline's logic
        without a GPU, for tests).
      worker_elements: a run whose size is known when it opens (a step's leaves handed over
        at once) gets one worker per this many elements at most; one worker is then the step's
        own thread (at ~0.3 G elem/s a thread, below ~10^5 elements waking and joining a
        thread costs more than it computes).
      engine: where plain steps, and delayed steps without a look-ahead, of element-wise
        optimizers run the math of host-resident leaves: ``"cpu"`` (the host kernel, the
        default) or ``"gpu"`` (on the params' GPU, the state — pinned at ``init`` — copied up
        and back in place, at most ``engine_chunk_bytes × slots`` of device buffers:
        :mod:`~functional_offload.optimizers.forms.gpu_engine`; in a delayed step in the
        background, :mod:`~functional_offload.optimizers.forms.delayed`), or ``"both"``: each
        step divides the leaves between the two, run at once
        (:mod:`~functional_offload.optimizers.forms.split`). Look-ahead and leaf-granular
        (Adafactor) steps keep their CPU forms.
        ``"gpu"`` and ``"both"`` need every host-resident leaf's param on a CUDA device: a CPU
        param is refused at ``init``.
      gpu_share: with ``engine="both"``, the fraction of the elements the GPU engine can step
        that it steps (leaves in order until it is reached); None (the default): searched for
        over the first steps by the host step's measured time
        (:func:`~functional_offload.optimizers.forms.split.next_share`). The last split is
        :attr:`last_split`.
      engine_chunk_bytes: with ``engine="gpu"`` or ``"both"``, the state bytes per chunk of the
        GPU engine (device buffers: ``engine_chunk_bytes × slots``); default 128 MiB. A chunk has
        a fixed cost (a copy per state tensor each way, its math's kernels), about 2 ms on an
        H100 box whatever its size (measured before the one-pass 8-bit kernels): at 32 MiB that
        bound the engine (2.25 G params/s with the split master and 8-bit moments); it ran 6.1 G
        params/s at 128 MiB and 6.3 at 512 MiB.

    A delayed step's runs for params on a GPU, which run beside the caller's next forward and
    backward, cut chunks :data:`BESIDE` (4) times as big for both engines (:meth:`chunk`,
    :meth:`engine_chunk`): the device's staging ring grows to ``slots × 2 × 4 × chunk_bytes``
    for them, and the GPU engine's device buffers are ``4 × engine_chunk_bytes × slots``.
    """

    def __init__(self, chunk_bytes: int = 32 << 20, slots: int = 4, threads: Optional[int] = None,
                 cpus: Optional[Sequence[int]] = None, timeline: Optional[Timeline] = None,
                 stage_host_grads: bool = False, worker_elements: int = 1 << 17,
                 engine: str = "cpu", gpu_share: Optional[float] = None,
                 engine_chunk_bytes: Optional[int] = None):
        if chunk_bytes < 4096 or chunk_bytes % ALIGN or slots < 2:
            raise ValueError(f"executor needs chunk_bytes >= 4096 and a multiple of {ALIGN} (the "
                             f"ring's regions hold elements of every size), and slots >= 2, got "
                             f"chunk_bytes={chunk_bytes}, slots={slots}")
        if threads is not None and threads < 1:
            raise ValueError(f"executor threads must be >= 1, got {threads}")
        if worker_elements < 1:
            raise ValueError(f"executor worker_elements must be >= 1, got {worker_elements}")
        if engine not in ("cpu", "gpu", "both"):
            raise ValueError(f"executor engine must be 'cpu', 'gpu' or 'both', got {engine!r}")
        if gpu_share is not None and (engine != "both" or isinstance(gpu_share, bool) or not (
                isinstance(gpu_share, (int, float)) and 0.0 <= gpu_share <= 1.0)):
            raise ValueError(f"executor gpu_share must be None or a number in [0, 1], with "
                             f"engine='both'; got gpu_share={gpu_share!r}, engine={engine!r}")
        if engine_chunk_bytes is not None and (
                engine == "cpu" or isinstance(engine_chunk_bytes, bool)
                or not isinstance(engine_chunk_bytes, int) or engine_chunk_bytes < 4096
                or engine_chunk_bytes % ALIGN):
            raise ValueError(f"executor engine_chunk_bytes must be None or an int >= 4096 and a "
                             f"multiple of {ALIGN}, with engine='gpu' or 'both'; got "
                             f"engine_chunk_bytes={engine_chunk_bytes!r}, engine={engine!r}")
        self.chunk_bytes, self.slots = int(chunk_bytes), int(slots)
        self.engine_chunk_bytes = ENGINE_CHUNK if engine_chunk_bytes is None else engine_chunk_bytes
        self.threads = threads or (len(cpus) if cpus else physical_cores())
        self.cpus = list(cpus) if cpus else None
        self.timeline = timeline
        self.stage_host_grads = bool(stage_host_grads)
        self.worker_elements = int(worker_elements)
        self.engine = engine
        self.gpu_share = None if gpu_share is None else float(gpu_share)
        self.last_split: Optional[SplitStep] = None  # engine="both": the last step's split
        self._rings: dict[torch.device, Optional[torch.Tensor]] = {}
        self._slot_events: dict[torch.device, list] = {}
        self._transports: dict[torch.device, Transport] = {}
        self._engine_streams: dict[torch.device, list] = {}
        self._math_streams: dict[torch.device, list] = {}
        self._engine_copies: dict[torch.device, list] = {}  # the engine transport's streams
        self._busy: dict[torch.device, threading.Lock] = {}
        self._reserving = threading.Lock()
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._arenas: dict[torch.device, torch.Tensor] = {}  # leaf-granular staging, per device
        self._arena_free: dict[torch.device, Any] = {}
        self._pinned: dict[int, int] = {}  # pool thread -> its CPU

    # ---- resources, allocated once -------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> "HostExecutor":
        """The executor itself: a pool of pinned rings and threads that copies share (a deep
        copy of an optimizer built with one steps through the same executor)."""
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a HostExecutor (pinned rings, worker threads) cannot be pickled; "
                        "checkpoint optimizer states with fo.save / state_dict instead")

    def chunk(self, device: torch.device, beside: bool = False) -> int:
        """Grad bytes per chunk (a ring slot's half) of a run for params on ``device``:
        ``chunk_bytes``, or ``BESIDE`` times it for a run beside the caller's forward and
        backward (a delayed step's) that copies through the ring (:meth:`stages`)."""
        return self.chunk_bytes * (BESIDE if beside and self.stages(device) else 1)

    def engine_chunk(self, beside: bool = False) -> int:
        """State bytes per chunk of the GPU engine: ``engine_chunk_bytes``, or ``BESIDE`` times
        it beside the caller's forward and backward (a delayed step's)."""
        return self.engine_chunk_bytes * (BESIDE if beside else 1)

    def stages(self, device: torch.device) -> bool:
        """Whether runs for params on ``device`` copy through a staging ring (a GPU's, or any
        with ``stage_host_grads``); host grads and params otherwise are read and written where
        they are."""
        return device.type != "cpu" or self.stage_host_grads

    def reserve(self, device: torch.device, beside: bool = False) -> None:
        """Take the transport for params on ``device`` (on a GPU the process's one, whose
        streams every executor shares) and allocate the staging ring (pinned for CUDA) its runs
        copy through, with slots for a delayed step's chunks where ``beside``
        (:meth:`chunk`): an optimizer's ``init`` calls it, so that no step allocates it."""
        with self._reserving:
            if device not in self._busy:
                self._slot_events[device] = [None] * self.slots
                self._transports[device] = transport_for(device)
                self._busy[device] = threading.Lock()
                self._rings[device] = None
        half = self.chunk(device, beside)
        if self._ring_short(device, half):
            with self._busy[device]:  # (once a run in flight on it has ended)
                self.ring(device, half)

    def _ring_short(self, device: torch.device, half: int) -> bool:
        """Whether runs for params on ``device`` copy through a ring that it lacks, or whose
        slots are smaller than two halves of ``half`` bytes."""
        ring = self._rings[device]
        return self.stages(device) and (ring is None or ring.numel() < self.slots * 2 * half)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held: the CUDA rings and the leaf-granular arenas."""
        return (sum(r.numel() for d, r in self._rings.items() if r is not None and d.type == "cuda")
                + sum(a.numel() for a in self._arenas.values()))

    def leaf_arena(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """Pinned host bytes for leaf-granular runs on ``device`` (grown when too small)."""
        arena = self._arenas.get(device)
        if arena is None or arena.numel() < nbytes:
            arena = self._arenas[device] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return arena

    def leaf_arena_free(self, device: torch.device) -> Any:
        """The event after which the last leaf-granular run's copies out have read the arena."""
        return self._arena_free.get(device)

    def set_leaf_arena_free(self, device: torch.device, event: Any) -> None:
        self._arena_free[device] = event

    def transport(self, device: torch.device) -> Transport:
        self.reserve(device)
        return self._transports[device]

    def engine_transport(self, device: torch.device) -> Transport:
        """The GPU engine's copies on ``device``: on a D2H and an H2D stream of their own (kept),
        apart from :meth:`transport`'s, so that the engine's copies, queued chunks ahead, and
        the CPU kernel's runs' wait for none of each other's."""
        stream_in, stream_out = self._own_streams(self._engine_copies, device, 2)
        return CudaTransport(device, (stream_in, stream_out))

    def engine_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The stream a delayed step's GPU engine runs on (one per device, kept): the caching
        allocator reuses a freed block on the stream it was allocated on, so its buffers,
        allocated on it, are reused step after step."""
        return self._own_streams(self._engine_streams, device, 1)[0]

    def engine_math_streams(self, device: torch.device) -> list["torch.cuda.Stream"]:
        """The GPU engine's two math streams on ``device`` (kept): chunk ``k``'s math runs on
        stream ``k mod 2``, beside the previous chunk's. (Two, not one a slot: the caching
        allocator keeps each stream's temporaries for that stream alone.)"""
        return self._own_streams(self._math_streams, device, 2)

    def _own_streams(self, kept: dict, device: torch.device, n: int) -> list["torch.cuda.Stream"]:
        """``kept[device]``, drawn on first use apart from the transport's copy streams and
        this executor's other streams (:func:`~functional_offload.executor.transport.streams_apart`)."""
        t = self.transport(device)
        with self._reserving:
            if device not in kept:
                taken = [t.stream_in, t.stream_out, *self._engine_streams.get(device, ()),
                         *self._math_streams.get(device, ()), *self._engine_copies.get(device, ())]
                kept[device] = streams_apart(device, n, taken)
            return kept[device]

    def ring(self, device: torch.device, half: int) -> Optional[torch.Tensor]:
        """``device``'s staging ring (pinned for CUDA; None where its runs copy through none):
        ``slots`` slots of two halves of ``half`` bytes at least. A smaller one is replaced,
        once the copies out still reading it are done. Called holding the ring
        (:meth:`holding`) for a device :meth:`reserve` took."""
        if not self._ring_short(device, half):
            return self._rings[device]
        events = self._slot_events[device]
        for event in events:
            self._transports[device].wait_host(event)
        events[:] = [None] * self.slots
        self._rings[device] = None  # (let go of the old one before allocating)
        self._rings[device] = torch.empty(self.slots * 2 * half, dtype=torch.uint8,
                                          pin_memory=device.type == "cuda")
        return self._rings[device]

    def slot_events(self, device: torch.device) -> list:
        return self._slot_events[device]

    def holding(self, device: torch.device) -> Any:
        """Context manager: hold ``device``'s ring for one run."""
        self.reserve(device)
        return self._busy[device]

    def _workers(self) -> cf.ThreadPoolExecutor:
        with self._reserving:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="fo-host")
            return self._pool

    def _pin(self) -> None:
        """Pin the calling pool thread, the first time it works, to the next CPU of ``cpus``."""
        ident = threading.get_ident()
        if self.cpus and ident not in self._pinned:
            with self._reserving:
                self._pinned[ident] = self.cpus[len(self._pinned) % len(self.cpus)]
            os.sched_setaffinity(0, {self._pinned[ident]})

    def start_workers(self, q: Any, threads: int) -> Callable[[], None]:
        """Put ``threads`` workers in ``q``'s loop (see :mod:`functional_offload.kernels.work`):
        a queue with workers of its own (a native one) starts them, pinned as this executor's
        would be; a Python queue gets threads of this executor's pool. Returns ``join()``, which
        waits until they have all left the loop."""
        n = min(threads, self.threads)
        if getattr(q, "start", None) is not None:  # OwnWorkers
            q.start(n, self.cpus or ())
            return q.join
        pool = self._workers()

        def loop(i: int) -> None:
            self._pin()
            q.work(i)

        futures = [pool.submit(loop, i) for i in range(n)]

        def join() -> None:
            cf.wait(futures)

        return join

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- runs -----------------------------------------------------------------------------
    def ready(self, device: torch.device) -> Any:
        """An event marking the work queued so far on this thread's stream (None on the CPU)."""
        return self.transport(device).ready()

    def upload(self, device: torch.device, dsts: list[torch.Tensor],
               srcs: list[torch.Tensor]) -> None:
        """Copy the 1-D host tensors ``srcs`` into the 1-D tensors ``dsts`` on ``device``, each
        cast to its ``dst``'s dtype as ``Tensor.copy_`` casts it (on the host), after the work
        queued so far on this thread's stream, which is then ordered after the copies. A source
        that is pinned and of its destination's dtype is copied from where it is; the others are
        cast into two pinned staging buffers of ``chunk_bytes`` in turn, so that the host's casts
        overlap the copies. Returns once every copy has read its source."""
        t = self.transport(device)
        if device.type != "cuda":
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            return
        t.wait_out(t.ready())  # the stream's reads of what the copies overwrite come first
        stages = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
                  for _ in range(2)]
        events: list[Any] = [None, None]
        slot, used, open_ = 0, 0, False
        for d, s in zip(dsts, srcs):
            if s.dtype == d.dtype and s.is_pinned():
                t.copy_out(d, s)
                continue
            size, lo = d.element_size(), 0
            while lo < s.numel():
                if not open_:  # this buffer's last copies have read it
                    t.wait_host(events[slot])
                    used, open_ = 0, True
                m = min(s.numel() - lo, (self.chunk_bytes - used) // size)
                if m == 0:  # full: its copies are issued; on to the other buffer
                    events[slot], slot, open_ = t.mark_out(), 1 - slot, False
                    continue
                stage = stages[slot][used: used + m * size].view(d.dtype)
                stage.copy_(s[lo: lo + m])
                t.copy_out(d[lo: lo + m], stage)
                used += -(-m * size // ALIGN) * ALIGN
                lo += m
        events[slot] = t.mark_out()
        for event in events:
            t.wait_host(event)
        t.end()

    def order_after_copies(self, device: torch.device) -> None:
        """Make this thread's stream wait for every param copy issued for ``device``."""
        if device in self._transports:
            self._transports[device].end()

    def open(self, device: torch.device, kernel: Kernel, threads: Optional[int] = None,
             chunk_done: Optional[Callable[[list[HostLeaf], list[Segment]], None]] = None,
             elements: Optional[int] = None, ahead: bool = False, threaded: bool = False,
             beside: bool = False) -> Run:
        """Start a run for leaves whose grads are on ``device``; feed it with ``add``.

        ``elements``: the run's total elements, when every leaf is handed over and the run
        closed before ``wait``. It then gets a worker per ``worker_elements`` elements at most,
        and, opened in a step's shielded work (:func:`~functional_offload.executor.shield.shielded`),
        runs in the step's thread (see :class:`~functional_offload.executor.run.Run`): a small run
        starts no thread at all; ``threaded``: in a thread of its own all the same (the step's
        thread has other work meanwhile). ``ahead``: for leaves with a look-ahead
        (``HostLeaf.ahead``). ``beside``: the run goes on beside the caller's next forward and
        backward (a delayed step's): its chunks are :meth:`chunk` (``beside=True``).
        """
        self.reserve(device)
        n = min(threads or self.threads, self.threads)
        if elements is not None:
            n = max(1, min(n, -(-elements // self.worker_elements)))
        return Run(self, device, kernel, n, chunk_done,
                   inline=elements is not None and shielding() and not threaded, ahead=ahead,
                   beside=beside)

    def run(self, leaves: Sequence[HostLeaf], kernel: Kernel, threads: Optional[int] = None) -> None:
        """Update ``leaves`` (grads on one device) and wait; the caller's stream is then ordered
        after the copies out. Errors re-raise (:class:`~functional_offload.executor.run.HostStepError`
        naming the leaf, or an interrupt as itself)."""
        if not leaves:
            return
        device = leaves[0].grad.device
        ready = self.ready(device)
        r = self.open(device, kernel, threads)
        r.add_all(list(leaves), ready)
        r.close()
        r.wait()
        if r.error is not None:
            raise r.error
        self.order_after_copies(device)


_default: Optional[HostExecutor] = None
_default_lock = threading.Lock()


def default_executor() -> HostExecutor:
    """The process-wide executor optimizers share unless given one (created on first use).

    One thread per physical core of this local rank's share of the node, pinned when several
    local ranks share the node; the staging bytes of the node (1 GiB) are divided among them,
    at most 256 MiB per rank.
    """
    global _default
    with _default_lock:
        if _default is None:
            _, size, cpus = node_share()
            chunk = max(4 << 20, min(32 << 20, _NODE_STAGING_BYTES // (size * 8)))
            _default = HostExecutor(chunk_bytes=chunk, slots=4, threads=len(cpus),
                                    cpus=cpus if size > 1 else None)
        return _default

