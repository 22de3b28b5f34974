"""Moving saved tensors: a pool of pinned host buffers, copies and events, and the holders
autograd keeps instead of tensors (each checks its tensor's version counter, as autograd does).

The copies go through the process's transport for the tensor's device
(:func:`~functional_offload.executor.transport.transport_for`): on a GPU, the same two copy
streams the host executors use. On the CPU (``testing.copy_on_cpu``) it is the local transport,
whose copies are synchronous; the mover defers its copies there (:class:`CpuCopy`) so that
sources stay in flight as on a GPU.

Ownership: autograd's graph owns the holders, a holder owns its ``Stored`` copy, and a copy owns
its host buffer, which goes back to the pool when the copy is freed — when backward has used it,
or when a graph is dropped without backward. The mover keeps only weak references, so nothing
outlives its graph.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from functional_offload.activations._hooks import now
from functional_offload.executor.transport import Transport, transport_for


class Pool:
    """Free pinned host buffers by size, each with the event of its last read (or None).

    It keeps, of each size, as many buffers as the busier of the last two steps had in use at
    once: a profiling step that offloads everything does not leave its buffers pinned for good.
    """

    def __init__(self, cap_bytes: Optional[int]):
        self.cap_bytes = cap_bytes
        self.free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.bytes = 0  # every buffer the pool made that is still alive
        self.in_use: dict[int, int] = {}
        self.most: dict[int, int] = {}  # this step's most in use at once, per size
        self.most_before: dict[int, int] = {}

    def take(self, nbytes: int, pin: bool) -> tuple[Optional[torch.Tensor], Any]:
        free = self.free.get(nbytes)
        if free:
            buf, last_read = free.pop()
        elif self.cap_bytes is not None and self.bytes + nbytes > self.cap_bytes:
            return None, None
        else:
            self.bytes += nbytes
            buf, last_read = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin), None
        self.in_use[nbytes] = n = self.in_use.get(nbytes, 0) + 1
        self.most[nbytes] = max(self.most.get(nbytes, 0), n)
        return buf, last_read

    def give(self, buf: torch.Tensor, last_read: Any) -> None:
        self.in_use[buf.numel()] -= 1
        self.free.setdefault(buf.numel(), []).append((buf, last_read))

    def new_step(self) -> None:
        """Free what neither this step nor the one before needed."""
        for size, free in self.free.items():
            keep = max(self.most.get(size, 0), self.most_before.get(size, 0))
            extra = max(0, min(len(free), self.in_use.get(size, 0) + len(free) - keep))
            del free[:extra]
            self.bytes -= size * extra
        self.free = {size: free for size, free in self.free.items() if free}
        self.in_use = {size: n for size, n in self.in_use.items() if n}
        self.most_before, self.most = self.most, dict(self.in_use)


class CpuCopy:
    """A copy stream's event on the CPU (tests: ``testing.copy_on_cpu``): the copy runs when it
    is waited for, so sources stay alive, in flight, as they do on a GPU (or at once, where the
    test asks for copies that land as they are issued)."""

    __slots__ = ("dst", "src", "done", "log")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, log: Optional[list]):
        self.dst, self.src, self.done, self.log = dst, src, False, log

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            t0 = now()
            self.dst.copy_(self.src)
            if self.log is not None:
                self.log.append((self.dst.numel(), now() - t0))
            self.done, self.dst, self.src = True, None, None


class Stored:
    """One storage copied to the host, shared by every view of it saved in its group at the
    version it was copied at (``version``: its tensor's then)."""

    __slots__ = ("pool", "step", "group", "key", "version", "host", "nbytes", "device", "stream",
                 "src", "open", "offloaded", "device_copy", "reloaded", "unpacks_left",
                 "__weakref__")

    def __init__(self, pool: Pool, step: Any, group: int, key: tuple, version: int,
                 host: torch.Tensor, src: torch.Tensor, stream: Any):
        self.pool, self.step, self.group, self.key, self.host = pool, step, group, key, host
        self.version = version
        self.nbytes, self.device, self.stream, self.src = host.numel(), src.device, stream, src
        self.open = True  # its group is still running
        self.offloaded: Any = None  # event: the copy to the host is done
        self.device_copy: Optional[torch.Tensor] = None  # uint8 storage back on the device
        self.reloaded: Any = None  # event: the copy back is done
        self.unpacks_left = 0

    def landed(self) -> bool:
        return self.offloaded is None or self.offloaded.query()

    def drop_source(self) -> None:
        """Let the source go; a copy still reading it keeps its memory (GPU) or runs now (CPU)."""
        src, self.src = self.src, None
        if src is not None and not self.landed():
            if isinstance(self.offloaded, CpuCopy):
                self.offloaded.synchronize()
            else:
                src.record_stream(self.stream)

    def __del__(self) -> None:  # the graph let it go: its buffer goes back to the pool
        if self.src is not None and self.stream is not None and not self.landed():
            self.src.record_stream(self.stream)
        if self.host is not None:
            self.pool.give(self.host, self.reloaded)


def version_error(what: str, now: int, then: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} is at version {now}; expected version {then} instead. It was changed "
        "in place after autograd saved it (activation offload checks this as autograd does): use "
        "the out-of-place op (x = x + y, not x += y) or clone the tensor before changing it.")


def describe(shape: Any, dtype: torch.dtype, group: Optional[int]) -> str:
    where = "outside the groups" if group is None else f"in group {group}"
    return f"a tensor saved {where} ({list(shape)}, {str(dtype).replace('torch.', '')})"


_NO_DATA = torch.empty(0)


def version_counter(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter (the one of its base and every view of it)
    and none of its memory, as autograd's saved variables keep the counter: a change in place
    is seen even when it was made before the tensor was freed, or through a detached alias."""
    counter = t.detach()
    counter.data = _NO_DATA  # swaps the storage only: the version counter stays shared
    return counter


class Versioned:
    """What checkpoint's hook packed for a tensor, and that tensor's version counter: a
    recomputed group's saved tensors are checked too (checkpoint itself does not check)."""

    __slots__ = ("packed", "counter", "version", "size", "dtype", "group")

    def __init__(self, packed: Any, t: torch.Tensor, group: int):
        self.packed, self.counter, self.version = packed, version_counter(t), t._version
        self.size, self.dtype, self.group = t.size(), t.dtype, group

    def get(self) -> Any:
        now = self.counter._version
        if now != self.version:
            raise version_error(describe(self.size, self.dtype, self.group), now, self.version)
        return self.packed


class Kept:
    """A saved tensor left on the device (detached: no reference cycle through its grad_fn)."""

    __slots__ = ("tensor", "version", "step", "group")

    def __init__(self, t: torch.Tensor, step: Any, group: Optional[int]):
        self.tensor, self.version, self.step, self.group = t.detach(), t._version, step, group

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise version_error(describe(self.tensor.shape, self.tensor.dtype, self.group),
                                self.tensor._version, self.version)
        return self.tensor


class Moved:
    """A view of an offloaded storage, with the tensor's version counter (not its memory) to
    check in the unpack, as autograd does."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset", "version", "counter")

    def __init__(self, stored: Stored, t: torch.Tensor):
        self.stored, self.dtype, self.size = stored, t.dtype, t.size()
        self.stride, self.offset, self.version = t.stride(), t.storage_offset(), t._version
        self.counter = version_counter(t)
        stored.unpacks_left += 1

    def check(self) -> None:
        now = self.counter._version
        if now != self.version:
            raise version_error(describe(self.size, self.dtype, self.stored.group), now,
                                self.version)


class Mover:
    """Copies storages down on the transport's stream in and back on its stream out; bounds
    bytes in flight."""

    def __init__(self, pool: Pool, copy_on_cpu: Optional[str], stats: dict):
        self.pool, self.copy_on_cpu, self.stats = pool, copy_on_cpu, stats
        self.inflight: list[weakref.ref] = []  # copies whose source is still held, oldest first
        self.live: dict[tuple, Stored] = {}  # (device, storage ptr) -> copy, in the open group
        self.measure: Any = None  # the profiling step's recorder, if any

    def transport(self, device: torch.device) -> Optional[Transport]:
        """The copies' transport for ``device``; None: its tensors stay where they are (the
        CPU, unless made under ``testing.copy_on_cpu``: there is no faster memory to free)."""
        if device.type == "cuda" or (device.type == "cpu" and self.copy_on_cpu):
            return transport_for(device)
        return None

    def can_move(self, device: torch.device) -> bool:
        return self.transport(device) is not None

    def _pending(self) -> list[Stored]:
        alive = [s for s in (r() for r in self.inflight) if s is not None and s.src is not None]
        self.inflight = [weakref.ref(s) for s in alive]
        return alive

    def inflight_bytes(self) -> int:
        return sum(s.nbytes for s in self._pending())

    def _retire(self, s: Stored) -> None:
        s.drop_source()
        if self.live.get(s.key) is s:
            del self.live[s.key]

    def retire(self) -> None:
        """Drop the sources of closed groups whose copies landed (no waiting)."""
        for s in self._pending():
            if not s.open and s.landed():
                self._retire(s)

    def make_room(self, nbytes: int, bound: Optional[int]) -> None:
        """Wait for the oldest copies until ``nbytes`` more stay within ``bound`` (a host wait)."""
        if bound is None:
            return
        self.retire()
        queue = self._pending()
        total = sum(s.nbytes for s in queue)
        while queue and total + nbytes > bound:
            s = queue.pop(0)
            if not s.landed():
                token = self.measure.gap_begin() if self.measure is not None else None
                t0 = now()
                s.offloaded.synchronize()
                self.stats["waits"] += 1
                self.stats["wait_s"] += now() - t0
                if token is not None:
                    self.measure.gap_end(token)
            total -= s.nbytes
            self._retire(s)

    def close_group(self) -> None:
        for s in self.live.values():
            s.open = False
        self.live.clear()
        self.retire()

    def offload(self, t: torch.Tensor, step: Any, group: int) -> Optional[Stored]:
        """The host copy of ``t``'s storage (started now, unless one of its group holds the
        storage at ``t``'s version: changed in place since, it is copied again), or None when
        the host cap is hit."""
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        s = self.live.get(key)
        if s is not None and s.version == t._version:
            return s
        if s is not None:  # no later save shares the earlier copy: it retires as a closed one
            s.open = False
        host, last_read = self.pool.take(storage.nbytes(), pin=t.device.type == "cuda")
        if host is None:
            return None
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        tr = self.transport(t.device)
        down = tr.stream_in
        s = Stored(self.pool, step, group, key, t._version, host, src, down)
        log = self.measure.copies["d2h"] if self.measure is not None else None
        if down is None:
            s.offloaded = CpuCopy(host, src, log)
            if self.copy_on_cpu == "issued":  # (testing.copy_on_cpu)
                s.offloaded.synchronize()
        else:
            tr.wait_in(tr.ready())
            tr.wait_in(last_read)  # the buffer's last copy back went first
            with torch.cuda.stream(down):
                start = self.measure.copy_begin() if log is not None else None
                host.copy_(src, non_blocking=True)
                if log is not None:
                    log.append((s.nbytes, start, self.measure.copy_begin()))
            s.offloaded = tr.mark_in()
        self.live[key] = s
        self.inflight.append(weakref.ref(s))
        self.stats["offloaded_bytes"] += s.nbytes
        self.stats["tensors"] += 1
        inflight = self.inflight_bytes()
        self.stats["inflight_peak_bytes"] = max(self.stats["inflight_peak_bytes"], inflight)
        return s

    def reload(self, s: Stored) -> None:
        """Start bringing ``s`` back (or use its source, when that is still on the device)."""
        if s.device_copy is not None:
            return
        if s.src is not None:
            s.device_copy = s.src
            return
        tr = self.transport(s.device)
        up = tr.stream_out
        self.stats["reloaded_bytes"] += s.nbytes
        log = self.measure.copies["h2d"] if self.measure is not None else None
        if up is None:
            t0 = now()
            s.device_copy = s.host.clone()
            if log is not None:
                log.append((s.nbytes, now() - t0))
            return
        tr.wait_out(s.offloaded)
        # allocated from the reload stream's pool: a block the compute stream just freed may
        # still be read by its queued kernels, which the reload stream is not ordered after
        with torch.cuda.stream(up):
            dev = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device)
            start = self.measure.copy_begin() if log is not None else None
            dev.copy_(s.host, non_blocking=True)
            if log is not None:
                log.append((s.nbytes, start, self.measure.copy_begin()))
        dev.record_stream(torch.cuda.current_stream(s.device))  # freed after compute used it
        s.device_copy = dev
        s.reloaded = tr.mark_out()

    def view(self, h: Moved) -> torch.Tensor:
        """The saved view, on the device, for autograd (the compute stream waits for it)."""
        s = h.stored
        self.reload(s)
        if s.reloaded is not None and s.device_copy is not s.src:
            torch.cuda.current_stream(s.device).wait_event(s.reloaded)
        out = torch.as_strided(s.device_copy.view(h.dtype), h.size, h.stride, h.offset)
        s.unpacks_left -= 1
        if s.unpacks_left <= 0:  # its last view: autograd holds the only reference now
            s.device_copy = None
            s.drop_source()
        return out
