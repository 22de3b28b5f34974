"""Activation offload: tensors saved for backward go to pinned host memory and come back in time.

Layer groups are marked in the forward (``with off.group(i):``). Tensors that autograd saves in
an offloaded group are copied device→host on a side stream into pinned buffers from a reusable
pool; in backward, reaching group ``k`` reloads groups ``k-1 … k-prefetch`` on a second stream
while group ``k`` computes, and the compute stream waits on a reload's event only when it needs
that tensor. Parameters, buffers and small tensors stay where they are; views of one storage are
copied once (within a group, whose sources stay alive until it ends and their copies are done);
everything is released when backward ends.

Functional loops use :meth:`ActivationOffload.value_and_grad` (``torch.func.grad`` refuses
saved-tensor hooks); module loops wrap the forward in :meth:`ActivationOffload.record`. On a
machine without a GPU the hooks run as a pass-through (``copy_on_cpu=True`` makes them copy
anyway, which is how the CPU tests exercise the bookkeeping).

Example::

    off = fo.activations.ActivationOffload(num_groups=len(blocks), offload=len(blocks) - 1)

    def loss_fn(params, x):
        for i, block in enumerate(blocks):
            with off.group(i):
                x = block(params, x)
        return x.square().mean()

    loss, grads = off.value_and_grad(loss_fn)(params, x)
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import optree
import torch

__all__ = ["ActivationOffload"]


class _Stored:
    """One storage copied to the host (shared by every view of it saved in the forward)."""

    __slots__ = ("group", "host", "nbytes", "device", "src", "open", "offloaded", "device_copy",
                 "reloaded", "unpacks_left")

    def __init__(self, group: int, host: torch.Tensor, nbytes: int, device: torch.device,
                 src: torch.Tensor):
        self.group = group
        self.host = host  # pinned uint8 buffer (from the pool)
        self.nbytes = nbytes
        self.device = device
        self.src = src  # keeps the source alive until its group ended and its copy completed
        self.open = True  # its group is still running (its storage cannot be reused yet)
        self.offloaded: Any = None  # event: the copy to the host is done
        self.device_copy: Optional[torch.Tensor] = None  # uint8 storage back on the device
        self.reloaded: Any = None  # event: the copy back is done
        self.unpacks_left = 0  # saved views not yet handed back to autograd in this backward


class _Handle:
    """What autograd keeps instead of an offloaded tensor: the storage and the view on it."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset")

    def __init__(self, stored: _Stored, t: torch.Tensor):
        self.stored = stored
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()


class ActivationOffload:
    """Offload the activations of the earliest layer groups during the forward pass.

    Args:
      num_groups: how many groups the forward marks with :meth:`group` (0 … num_groups-1).
      offload: how many of the earliest groups to offload (int), or their fraction (float in
        [0, 1], rounded down). The last group is never offloaded: its activations are needed
        first in backward.
      min_bytes: tensors smaller than this stay on the device.
      prefetch: how many groups ahead of the one in backward to reload (>= 1).
      max_inflight_bytes: bound on bytes whose copy to the host has not completed; past it the
        forward waits for the oldest copy (a host wait, only then). None: no bound.
      host_cap_bytes: bound on pinned host bytes; tensors past it stay on the device.
      recompute_groups: groups whose activations are recomputed (activation checkpointing);
        offloading them too is an error.
      copy_on_cpu: copy CPU tensors through the pool too (for tests; default pass-through).
    """

    def __init__(self, num_groups: int, offload: Union[int, float], *, min_bytes: int = 1 << 20,
                 prefetch: int = 1, max_inflight_bytes: Optional[int] = None,
                 host_cap_bytes: Optional[int] = None, recompute_groups: Sequence[int] = (),
                 copy_on_cpu: bool = False):
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
        if isinstance(offload, float):
            if not 0 <= offload <= 1:
                raise ValueError(f"offload as a fraction must be in [0, 1], got {offload}")
            count = min(math.floor(offload * num_groups), num_groups - 1)
        elif isinstance(offload, int) and not isinstance(offload, bool):
            count = offload
        else:
            raise ValueError(f"offload is a group count (int) or a fraction (float), got {offload!r}")
        if not 0 <= count <= num_groups - 1:
            raise ValueError(f"can offload 0 … {num_groups - 1} of {num_groups} groups (never the "
                             f"last), got {count}; lower `offload`")
        both = sorted(set(range(count)) & set(recompute_groups))
        if both:
            raise ValueError(f"groups {both} are both offloaded and recomputed; recomputed groups "
                             "save no activations to offload — offload fewer groups or recompute "
                             "others")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.num_groups, self.offloaded_groups = num_groups, count
        self.min_bytes, self.prefetch = int(min_bytes), int(prefetch)
        self.max_inflight_bytes, self.host_cap_bytes = max_inflight_bytes, host_cap_bytes
        self.copy_on_cpu = copy_on_cpu
        self._group: Optional[int] = None
        self._exclude: set[int] = set()
        self._records: list[_Stored] = []  # every copy of this forward
        self._live: dict[tuple, _Stored] = {}  # (device, storage ptr) -> copy, in the open group
        self._inflight: list[_Stored] = []
        # free pinned buffers by size, each with the event of its last copy back (or None): a
        # reused buffer is rewritten only after that copy read it
        self._pool: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._pooled_bytes = 0
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._end_queued = False
        self.stats = {"offloaded_bytes": 0, "tensors": 0}

    # ---- marking --------------------------------------------------------------------------
    @contextlib.contextmanager
    def group(self, index: int) -> Iterator[None]:
        """Mark the forward code of layer group ``index``."""
        if not 0 <= index < self.num_groups:
            raise ValueError(f"group {index} is out of range 0 … {self.num_groups - 1}")
        outer, self._group = self._group, index
        try:
            yield
        finally:
            self._group = outer
            for stored in self._live.values():  # sources may go once their copies are done
                stored.open = False
            self._live.clear()
            self._retire()

    @contextlib.contextmanager
    def record(self, exclude: Any = None) -> Iterator[None]:
        """Offload during the forward run inside this block (module loops: then ``.backward()``).

        ``exclude``: a module or a pytree of tensors (params, buffers) never to offload.
        """
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError("activation offload cannot run while capturing a CUDA graph: its "
                             "copies and host buffers live outside the graph; capture without it")
        self._release()  # a forward without backward (eval) left its copies: drop them
        if isinstance(exclude, torch.nn.Module):
            tensors = [*exclude.parameters(), *exclude.buffers()]
        else:
            tensors = [t for t in optree.tree_leaves(exclude) if isinstance(t, torch.Tensor)]
        self._exclude = {t.untyped_storage().data_ptr() for t in tensors}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        except RuntimeError as e:
            if "saved tensor hooks" in str(e):
                raise RuntimeError("activation offload uses saved-tensor hooks, which "
                                   "torch.func.grad/vjp refuse: use off.value_and_grad(loss_fn) "
                                   "instead of torch.func.grad(loss_fn)") from e
            raise

    def value_and_grad(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
        """``loss_fn(params, *args) -> loss`` to ``(loss, grads)`` with offload in its forward.

        Grads mirror ``params`` (an optree pytree); ``None`` where a leaf does not affect the
        loss. The forward's params are excluded from offload.
        """

        def wrapped(params: Any, *args: Any, **kwargs: Any) -> tuple:
            leaves, spec = optree.tree_flatten(params)
            inputs = [p.detach().requires_grad_() for p in leaves]
            with torch.enable_grad(), self.record(exclude=inputs):
                loss = loss_fn(optree.tree_unflatten(spec, inputs), *args, **kwargs)
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
            self._release()
            return loss.detach(), optree.tree_unflatten(spec, list(grads))

        return wrapped

    # ---- hooks ----------------------------------------------------------------------------
    def _offloads(self, t: torch.Tensor) -> bool:
        g = self._group
        if g is None or g >= self.offloaded_groups or t.is_sparse or t.layout != torch.strided:
            return False
        if t.device.type == "cpu" and not self.copy_on_cpu:
            return False
        if t.device.type not in ("cuda", "cpu"):
            return False
        storage = t.untyped_storage()
        return storage.nbytes() >= self.min_bytes and storage.data_ptr() not in self._exclude

    def _streams_for(self, device: torch.device) -> tuple[Any, Any]:
        if device.type != "cuda":
            return None, None
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _host_buffer(self, nbytes: int, pin: bool) -> tuple[Optional[torch.Tensor], Any]:
        """A pinned buffer and the event its previous reader set (None: free at once)."""
        free = self._pool.get(nbytes)
        if free:
            return free.pop()
        if self.host_cap_bytes is not None and self._pooled_bytes + nbytes > self.host_cap_bytes:
            return None, None
        self._pooled_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin), None

    def _retire(self) -> None:
        """Drop the sources of closed groups whose copies completed (no waiting)."""
        keep = []
        for s in self._inflight:
            if not s.open and (s.offloaded is None or s.offloaded.query()):
                s.src = None
            else:
                keep.append(s)
        self._inflight = keep
        if self.max_inflight_bytes is not None:
            closed = [s for s in self._inflight if not s.open]
            while closed and sum(s.nbytes for s in self._inflight) > self.max_inflight_bytes:
                oldest = closed.pop(0)
                if oldest.offloaded is not None:
                    oldest.offloaded.synchronize()
                oldest.src = None
                self._inflight.remove(oldest)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._offloads(t):
            return t
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        stored = self._live.get(key)
        if stored is None:
            nbytes = storage.nbytes()
            host, last_read = self._host_buffer(nbytes, pin=t.device.type == "cuda")
            if host is None:
                return t  # over the host cap: keep it on the device
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            stored = _Stored(self._group, host, nbytes, t.device, src)
            offload_stream, _ = self._streams_for(t.device)
            if offload_stream is None:
                host.copy_(src)
            else:
                offload_stream.wait_stream(torch.cuda.current_stream(t.device))
                if last_read is not None:  # the last step's copy back of this buffer went first
                    offload_stream.wait_event(last_read)
                with torch.cuda.stream(offload_stream):
                    host.copy_(src, non_blocking=True)
                stored.offloaded = offload_stream.record_event()
            self._live[key] = stored
            self._records.append(stored)
            self._inflight.append(stored)
            self.stats["offloaded_bytes"] += nbytes
            self.stats["tensors"] += 1
            self._retire()
        stored.unpacks_left += 1
        return _Handle(stored, t)

    def _reload(self, stored: _Stored) -> None:
        if stored.device_copy is not None:
            return
        _, reload_stream = self._streams_for(stored.device)
        if reload_stream is None:
            stored.device_copy = stored.host.clone()
            return
        # allocated from the reload stream's pool: a block the compute stream just freed may
        # still be read by its queued kernels, which the reload stream is not ordered after
        with torch.cuda.stream(reload_stream):
            if stored.offloaded is not None:
                reload_stream.wait_event(stored.offloaded)
            dev = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
            dev.copy_(stored.host, non_blocking=True)
        dev.record_stream(torch.cuda.current_stream(stored.device))  # freed after compute used it
        stored.device_copy = dev
        stored.reloaded = reload_stream.record_event()

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _Handle):
            return x
        if not self._end_queued:  # backward started: release everything once it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._release)
            self._end_queued = True
            self._retire()  # the forward's last sources whose copies are done go now
        stored = x.stored
        self._reload(stored)
        for s in self._records:  # prefetch the next groups backward will reach
            if stored.group - self.prefetch <= s.group < stored.group:
                self._reload(s)
        if stored.reloaded is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.reloaded)
        typed = stored.device_copy.view(x.dtype)
        out = torch.as_strided(typed, x.size, x.stride, x.offset)
        stored.unpacks_left -= 1
        if stored.unpacks_left <= 0:  # the last view of it: autograd's reference is the only one
            stored.device_copy = None
        return out

    def _release(self) -> None:
        """Return the host buffers to the pool and forget this forward's copies."""
        for s in self._records:
            if s.offloaded is not None:
                s.offloaded.synchronize()  # the buffer is reused: its copy must be done
            s.src = s.device_copy = None
            self._pool.setdefault(s.nbytes, []).append((s.host, s.reloaded))
        self._records.clear()
        self._live.clear()
        self._inflight.clear()
        self._end_queued = False

    @property
    def pinned_bytes(self) -> int:
        """Host bytes held by the pool (allocated once, reused every step)."""
        return self._pooled_bytes
