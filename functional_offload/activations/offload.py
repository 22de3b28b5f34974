"""``ActivationOffload``: mark layer groups; keep, offload or recompute what each saves for backward."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import optree
import torch
from torch.utils.checkpoint import checkpoint

from functional_offload.activations._hooks import copies_cpu
from functional_offload.activations._options import check_options
from functional_offload.activations._recompute import Recomputed
from functional_offload.activations._steps import Budget, Recording
from functional_offload.activations._transfer import Kept, Moved, Mover, Pool
from functional_offload.activations.cost_model import OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD
from functional_offload.activations.planner import ActivationPlan
from functional_offload.tree import check_tensor_leaves, leaves_with_paths

_RECOMPUTING = (RECOMPUTE, RECOMPUTE_OFFLOAD)
_MOVING = (OFFLOAD, RECOMPUTE_OFFLOAD)


class _GroupForward:
    """A module's forward run as one group (what :meth:`ActivationOffload.wrap` installs)."""

    def __init__(self, off: "ActivationOffload", index: int, forward: Callable):
        self.off, self.index, self.forward = off, index, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.off.run(self.index, self.forward, *args, **kwargs)


def _param_like(t: torch.Tensor) -> bool:
    """Parameters (also FSDP2's unsharded ones), leaves that require grad, and their views."""
    base = t._base
    return (isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)
            or (base is not None and base.is_leaf and base.requires_grad))


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
        return None


def _call(fn: Callable[..., Any], leaves: list, spec: Any, *tensors: torch.Tensor) -> Any:
    """``fn(*args, **kwargs)`` of the ``(args, kwargs)`` flattened to ``leaves`` by ``spec``,
    their tensors replaced by ``tensors`` in order."""
    given = iter(tensors)
    args, kwargs = optree.tree_unflatten(spec, [next(given) if isinstance(x, torch.Tensor) else x
                                                for x in leaves])
    return fn(*args, **kwargs)


class ActivationOffload:
    """Keep, offload to pinned host memory, or recompute what each layer group saves for backward.

    The forward marks groups: ``x = off.run(i, fn, *args)`` (or ``off.wrap(blocks)`` for modules)
    runs ``fn`` as group ``i`` and can recompute it; ``with off.group(i):`` marks code that can be
    kept or offloaded only. What each group does comes from a count or from a memory budget:

    Args:
      num_groups: how many groups the forward marks (0 … num_groups-1).
      offload: offload the earliest groups: a count (int) or a fraction of ``num_groups`` (float,
        rounded down); never the last group. Exclusive with ``budget_bytes``.
      budget_bytes: bound on the step's peak device memory above what was allocated when the
        forward began (activations, the loss head, grads, workspace: everything). The first
        step of each input shape profiles memory (every group but the last offloaded, on a
        GPU); unless keeping every group fits, a second one profiles compute times (every group
        marked with ``run`` but the last recomputed; the others offloaded again). Then a plan
        (:attr:`plan`) keeps, offloads or recomputes each group for the least predicted time;
        on a GPU the next steps check the peak and correct the plan until it fits (up to four
        times).
      min_bytes: saved tensors smaller than this stay on the device.
      prefetch: how many groups ahead of the one in backward to reload (>= 1); with
        ``budget_bytes`` the plan chooses it.
      max_inflight_bytes: bound on bytes whose copy to the host has not landed (their sources stay
        alive until it has); past it the forward waits for the oldest copy, a host wait counted in
        ``stats``. ``"auto"``: twice the largest group's offloaded bytes. None: no bound.
      host_cap_bytes: bound on pinned host bytes; tensors past it stay on the device.
      recompute_groups: with ``offload``, groups to recompute (they must run through ``run``).

    Example::

        blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        off = fo.ActivationOffload(len(blocks), budget_bytes=1 << 20)
        off.wrap(blocks)  # block i is group i
        with off.record(exclude=blocks):
            x = torch.randn(512, 64)
            for block in blocks:
                x = torch.tanh(block(x))
        x.square().mean().backward()
        print(off.plan)  # made from this step: keeping every group fits
    """

    def __init__(self, num_groups: int, offload: Union[int, float, None] = None, *,
                 budget_bytes: Optional[int] = None, min_bytes: int = 1 << 20, prefetch: int = 1,
                 max_inflight_bytes: Union[int, str, None] = "auto",
                 host_cap_bytes: Optional[int] = None, recompute_groups: Sequence[int] = ()):
        count, self._fixed = check_options(num_groups, offload, budget_bytes, min_bytes, prefetch,
                                           max_inflight_bytes, host_cap_bytes, recompute_groups)
        n = self.num_groups = num_groups
        self.offloaded_groups, self.budget_bytes = count, budget_bytes
        self.min_bytes, self.prefetch = min_bytes, prefetch
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = {"offloaded_bytes": 0, "reloaded_bytes": 0, "tensors": 0, "waits": 0,
                      "wait_s": 0.0, "inflight_peak_bytes": 0, "recomputed_groups": 0,
                      "measured_steps": 0, "plans": 0}
        self._pool = Pool(host_cap_bytes)
        self._mover = Mover(self._pool, copies_cpu(), self.stats)
        self._budget = None if budget_bytes is None else Budget(
            budget_bytes, n, None if max_inflight_bytes == "auto" else max_inflight_bytes, self.stats)
        self._step: Optional[Recording] = None
        self._group: Optional[int] = None
        self._exclude: set[int] = set()
        self._moved_max, self._moved_for = 0, None

    # ---- the public surface ---------------------------------------------------------------
    @property
    def plan(self) -> Optional[ActivationPlan]:
        """The budget plan for the latest input shape (None before its profiling steps)."""
        return self._budget.plan if self._budget is not None else None

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the pool has allocated (reused every step)."""
        return self._pool.bytes

    @property
    def held_bytes(self) -> int:
        """Host bytes now holding saved tensors: 0 once every recorded graph has run its backward
        or been dropped."""
        return self._pool.bytes - sum(b.numel() for free in self._pool.free.values() for b, _ in free)

    def run(self, index: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as group ``index``: kept, offloaded, or recomputed in backward
        (``torch.utils.checkpoint``, non-reentrant). Outside a recording it is a plain call."""
        self._check_index(index)
        step = self._step
        if step is None or not torch.is_grad_enabled():
            self._check_recording(index)
            return fn(*args, **kwargs)
        leaves, spec = optree.tree_flatten((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        if step.decisions is None:
            self._resolve(step, tuple((tuple(a.shape), a.dtype) for a in tensors),
                          tensors[0].device if tensors else None)
        with self._in_group(step, index, recomputable=True):
            if step.measure is not None:
                seen = {}
                for a in tensors:
                    if not _param_like(a) and _storage_ptr(a) is not None:
                        seen[_storage_ptr(a)] = a.untyped_storage().nbytes()
                step.measure.inputs[index] = sum(seen.values())
            if step.decisions[index] in _RECOMPUTING:
                self.stats["recomputed_groups"] += 1
                # every tensor, keyword or in a container, goes to checkpoint as an argument of
                # its own (it keeps those, checking their versions; fn's other keywords are
                # bound here: checkpoint would take some, debug, context_fn...)
                return checkpoint(Recomputed(functools.partial(_call, fn, leaves, spec), index),
                                  *tensors, use_reentrant=False)
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def group(self, index: int) -> Iterator[None]:
        """Mark the forward code of group ``index`` (kept or offloaded; ``run`` can recompute)."""
        self._check_index(index)
        step = self._step
        if step is None:
            self._check_recording(index)
            yield
            return
        if step.decisions is None:
            self._resolve(step, None, None)
        if step.decisions[index] in _RECOMPUTING:
            raise ValueError(f"group {index} is to be recomputed, which needs its forward as a "
                             f"function: x = off.run({index}, fn, *args) instead of off.group()")
        with self._in_group(step, index, recomputable=False):
            yield

    def wrap(self, modules: Sequence[torch.nn.Module], start: int = 0) -> Sequence[torch.nn.Module]:
        """Make each module's forward a group (``modules[k]`` is group ``start + k``), in place.

        The modules keep their names, parameters and hooks (FSDP2's included); call it once.
        """
        for k, m in enumerate(modules):
            self._check_index(start + k)
            if isinstance(m.__dict__.get("forward"), _GroupForward):
                raise ValueError(f"module {k} ({type(m).__name__}) is already wrapped as group "
                                 f"{m.__dict__['forward'].index}; wrap each module once")
        for k, m in enumerate(modules):
            m.forward = _GroupForward(self, start + k, m.forward)
        return modules

    @contextlib.contextmanager
    def record(self, exclude: Any = None) -> Iterator[None]:
        """Offload during the forward run inside this block (module loops: then ``.backward()``).

        ``exclude``: a module or a pytree of tensors (params, buffers) never to offload;
        parameters and leaves that require grad are never offloaded anyway.
        """
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError("activation offload cannot run while capturing a CUDA graph: its "
                             "copies and host buffers live outside the graph; capture without it")
        if self._step is not None:
            raise RuntimeError("off.record() is already active: one forward records at a time "
                               "(run the inner forward outside it, or use a second ActivationOffload)")
        if isinstance(exclude, torch.nn.Module):
            tensors = [*exclude.parameters(), *exclude.buffers()]
        else:
            tensors = [t for t in optree.tree_leaves(exclude) if isinstance(t, torch.Tensor)]
        self._exclude = {p for p in map(_storage_ptr, tensors) if p is not None}
        self._pool.new_step()
        start = torch.cuda.memory_allocated() \
            if self._budget is not None and torch.cuda.is_available() else 0
        self._step = Recording(self.num_groups, start, self.prefetch)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        except RuntimeError as e:
            if "saved tensor hooks" in str(e):
                raise RuntimeError("activation offload uses saved-tensor hooks, which "
                                   "torch.func.grad/vjp refuse: use off.value_and_grad(loss_fn) "
                                   "instead of torch.func.grad(loss_fn)") from e
            raise
        finally:
            if self._step.measure is not None:
                self._step.measure.fwd_end = self._step.measure.mark()
            self._step, self._group = None, None
            self._mover.close_group()

    def value_and_grad(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
        """``loss_fn(params, *args) -> loss`` to ``(loss, grads)`` with offload in its forward.

        Grads mirror ``params`` (an optree pytree); ``None`` where a leaf does not affect the
        loss. The forward's params are excluded from offload.
        """

        def wrapped(params: Any, *args: Any, **kwargs: Any) -> tuple:
            paths, leaves, spec = leaves_with_paths(params)
            check_tensor_leaves(leaves, paths, "params")
            inputs = [p.detach().requires_grad_() for p in leaves]
            with torch.enable_grad(), self.record(exclude=inputs):
                loss = loss_fn(optree.tree_unflatten(spec, inputs), *args, **kwargs)
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
            return loss.detach(), optree.tree_unflatten(spec, list(grads))

        return wrapped

    # ---- decisions ------------------------------------------------------------------------
    def _check_index(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"a group index is an int in 0 … {self.num_groups - 1}, got "
                            f"{index!r}")
        if not 0 <= index < self.num_groups:
            raise ValueError(f"group {index} is out of range 0 … {self.num_groups - 1}")

    def _check_recording(self, index: int) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError(f"group {index} ran with autograd on but outside off.record() / "
                               "off.value_and_grad, so nothing would be offloaded or recomputed: "
                               "wrap the forward in `with off.record(exclude=model):` (or run it "
                               "under torch.no_grad() to evaluate). If it did run in one, an "
                               "outer torch.utils.checkpoint (gradient checkpointing) re-ran it "
                               "during backward: recompute it through this ActivationOffload "
                               "instead (recompute_groups, off.run), not around its groups")

    def _resolve(self, step: Recording, key: Any, device: Optional[torch.device]) -> None:
        """This step's decisions: fixed counts, a plan for these input shapes, or profiling."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        step.key, step.device = key, device
        if self._budget is None:
            step.decisions = list(self._fixed)
            self._mover.measure = None
        else:
            self._mover.measure = self._budget.decide(step, self._mover.can_move(device))

    def _bound(self, step: Recording, group: Optional[int], nbytes: int) -> Optional[int]:
        if self.max_inflight_bytes != "auto":
            return self.max_inflight_bytes
        now = step.moved[group] + nbytes if group is not None else nbytes
        return 2 * max(self._moved_max, now)

    @contextlib.contextmanager
    def _in_group(self, step: Recording, index: int, recomputable: bool) -> Iterator[None]:
        outer, self._group = self._group, index
        m = step.measure
        if tuple(step.decisions) != self._moved_for:  # a new plan: its own in-flight bound
            self._moved_max, self._moved_for = 0, tuple(step.decisions)
        if m is not None:
            m.group, m.enter[index] = index, m.mark()
            m.recomputable[index] = recomputable
        step.entered = True
        step.seen = set()
        try:
            yield
        finally:
            self._group = outer
            self._mover.close_group()
            self._moved_max = max(self._moved_max, step.moved[index])
            step.seen = set()
            if m is not None:
                m.group, m.exit[index] = outer, m.mark()
                m.sample(("fwd", index), step.held(index + 1))

    # ---- hooks ----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        step, g = self._step, self._group
        if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided
                or t.is_nested or t.is_conj() or t.is_neg() or _param_like(t)):
            return Kept(t, step, g)  # (a conjugate or negative view's flag would not come back)
        ptr = _storage_ptr(t)
        if ptr is None or ptr in self._exclude:
            return Kept(t, step, g)
        nbytes = t.untyped_storage().nbytes()
        big = nbytes >= self.min_bytes
        if (t.device, ptr) not in step.seen:  # count each storage once per group
            step.seen.add((t.device, ptr))
            if g is None:
                step.outside += nbytes
                step.outside_before += 0 if step.entered else nbytes
            elif big:
                step.saved[g] += nbytes
            else:
                step.small[g] += nbytes
        if g is None or not big or step.decisions[g] not in _MOVING or not self._mover.can_move(t.device):
            if g is None and step.measure is not None and step.entered:
                step.measure.sample(("head", None), step.held(self.num_groups))
            return Kept(t, step, g)
        self._mover.make_room(nbytes, self._bound(step, g, nbytes))
        stored = self._mover.offload(t, step, g)
        if stored is None:  # over the host cap
            return Kept(t, step, g)
        if stored.unpacks_left == 0:
            step.moved[g] += stored.nbytes
            step.records[g].append(weakref.ref(stored))
        return Moved(stored, t)

    def _unpack(self, h: Any) -> torch.Tensor:
        if isinstance(h, Kept):
            self._backward_at(h.step, h.group)
            return h.get()
        h.check()
        self._backward_at(h.stored.step, h.stored.group)
        return self._mover.view(h)

    def _backward_at(self, step: Recording, g: Optional[int]) -> None:
        """Backward reached a tensor of group ``g``: start the end callback, prefetch, profile."""
        if step.backward_group == -1:
            step.backward_group = None
            if step.measure is not None:
                step.measure.bwd_start = step.measure.mark()
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._backward_done, step))
            self._mover.retire()
        m = step.measure
        if g is not None and g != step.backward_group:
            step.backward_group = g
            self._mover.retire()
            for j in range(g, max(g - step.prefetch - 1, -1), -1):
                for ref in step.records[j]:
                    s = ref()
                    if s is not None and s.unpacks_left > 0:  # not yet used up
                        self._mover.reload(s)
            if m is not None and m.bwd[g] is None:
                m.bwd[g] = m.mark()
        if m is not None:
            g = step.backward_group
            m.sample(("head", None) if g is None else ("bwd", g),
                     step.held(self.num_groups if g is None else g + 1))

    def _backward_done(self, step: Recording) -> None:
        if self._mover.measure is step.measure:
            self._mover.measure = None
        if self._budget is not None:
            self._budget.backward_done(step)
