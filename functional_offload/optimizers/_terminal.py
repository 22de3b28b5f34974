"""What every terminal optimizer shares: state layout and placement, validation, donation, and
dispatch of one step to the device-resident kernels and the host executor.

An optimizer module (``adam.py``, ``sgd.py``) supplies its math as two kernels and its state
NamedTuple; this module decides where each leaf's state lives and moves the data.

Per leaf, the *value* is the tensor the math updates: the fp32 master when there is one (low-
precision params, or params on a GPU whose state lives on the host), else the param itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import optree
import torch

from functional_offload.base import ParamRefs
from functional_offload.executor import HostExecutor, HostLeaf, physical_cores
from functional_offload.kernels import cpu as cpu_kernels
from functional_offload.kernels.work import Kernel, Work
from functional_offload.placement import Placement, on_host
from functional_offload.tree import check_tensor_leaves, flatten_like, leaves_with_paths, local
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["Terminal", "check_scalar_or_schedule", "at_step", "check_beta", "check_nonneg", "LOW_PRECISION"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
MaskOrFn = Any  # a pytree of bools mirroring params, or a callable params -> such a tree


def check_scalar_or_schedule(name: str, x: ScalarOrSchedule) -> ScalarOrSchedule:
    """A float >= 0, or a callable of the step (checked when called, at each update)."""
    if not callable(x):
        check_nonneg(name, x)
    return x


def at_step(name: str, x: ScalarOrSchedule, n: int) -> float:
    """The value of a scalar or schedule for step count ``n``; raises if it is not >= 0."""
    v = float(x(n)) if callable(x) else float(x)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"the {name} schedule returned {v} at step {n}; it must be finite and >= 0")
    return v


def check_nonneg(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
    return float(x)


def check_beta(name: str, b: Any) -> float:
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
        raise ValueError(f"{name} must be in [0, 1), got {b!r} (e.g. betas=(0.9, 0.999))")
    return float(b)


def _check_dtype(name: str, dt: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
        raise TypeError(f"{name} must be a floating torch.dtype or None, got {dt!r}")
    return dt


class _Leaf(NamedTuple):
    path: str
    param: torch.Tensor
    value: torch.Tensor  # master or the param itself
    moments: tuple[torch.Tensor, ...]
    has_master: bool

    @property
    def on_host(self) -> bool:
        return self.value.device.type == "cpu"


class Terminal:
    """The machinery of a terminal optimizer, parameterized by its math.

    Args:
      state_cls: NamedTuple with fields ``count``, the moment fields, ``master``, ``params``.
      moments: ``(field name, dtype or None)`` per moment (None: fp32 for low-precision
        params, the param dtype otherwise).
      lr, weight_decay: floats or schedules of the step count.
      hyper: ``(lr, weight_decay, step) -> hyper NamedTuple`` (with a ``weight_decay`` field).
      device_math: ``(values, grads, [moment lists], hyper)`` for device-resident groups.
      host_math: ``(value, grad, moments, out, hyper)`` on 1-D slices, in torch ops.
      native_math: ``(native_queue, work) -> index``: adds a chunk's
        :class:`~functional_offload.kernels.work.Work` to a native queue
        (:func:`~functional_offload.kernels.cpu.add_adam`).
    """

    def __init__(self, name: str, state_cls: type, moments: Sequence[tuple[str, Optional[torch.dtype]]],
                 lr: ScalarOrSchedule, weight_decay: ScalarOrSchedule,
                 hyper: Callable[[float, float, int], Any],
                 device_math: Callable[..., None], host_math: Callable[..., None],
                 native_math: Callable[..., int], *,
                 placement: Optional[Placement], master_dtype: torch.dtype,
                 weight_decay_mask: MaskOrFn, executor: Optional[HostExecutor], cpu_kernel: str,
                 delayed: bool = False):
        if placement is not None and not isinstance(placement, Placement):
            raise TypeError(f"placement must be a functional_offload.placement.Placement, got "
                            f"{type(placement).__name__} (e.g. placement.offload_fraction(0.5))")
        if cpu_kernel not in ("auto", "native", "torch"):
            raise ValueError(f"cpu_kernel must be 'auto', 'native' or 'torch', got {cpu_kernel!r}")
        if master_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"master_dtype must be torch.float32 or torch.float64, got {master_dtype!r}")
        self.name = name
        self.state_cls = state_cls
        self.moments = [(f, _check_dtype(f"{f}_dtype", d)) for f, d in moments]
        self.lr = check_scalar_or_schedule("lr", lr)
        self.weight_decay = check_scalar_or_schedule("weight_decay", weight_decay)
        self.hyper = hyper
        self.device_math = device_math
        self.host_math = host_math
        self.native_math = native_math
        self.placement = placement or on_host()
        self.master_dtype = master_dtype
        self.weight_decay_mask = weight_decay_mask
        # delayed: the host step runs beside the training loop, whose thread needs a core
        self.executor = executor or HostExecutor(
            threads=max(1, physical_cores() - 1) if delayed else None)
        self.cpu_kernel = cpu_kernel
        self.delayed = bool(delayed)

    # ---- init -----------------------------------------------------------------------------
    def _moment_dtype(self, dt: Optional[torch.dtype], p: torch.Tensor) -> torch.dtype:
        return dt or (torch.float32 if p.dtype in LOW_PRECISION else p.dtype)

    def _value_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.master_dtype if p.dtype in LOW_PRECISION else p.dtype

    def init(self, params: Params) -> Any:
        paths, leaves, spec = leaves_with_paths(params)
        check_tensor_leaves(leaves, paths, "params")
        leaves = [local(p) for p in leaves]  # DTensor params: state for this rank's shard
        for path, p in zip(paths, leaves):
            if not p.dtype.is_floating_point:
                raise TypeError(f"param {path!r} has dtype {p.dtype}; only floating params can "
                                "be optimized (leave integer buffers out of the params tree)")
        state_bytes = [p.numel() * (sum(self._moment_dtype(d, p).itemsize for _, d in self.moments)
                                    + (self._value_dtype(p).itemsize if p.dtype in LOW_PRECISION else 0))
                       for p in leaves]
        plan = self.placement.plan(optree.tree_unflatten(spec, leaves), state_bytes)
        masters, moments = [], [[] for _ in self.moments]
        with torch.no_grad():
            staging = self._staging(leaves, plan.on_host)
            for path, p, host in zip(paths, leaves, plan.on_host):
                where = torch.device("cpu") if host else p.device
                if host and p.device.type != "cpu":
                    if not p.is_contiguous():
                        raise ValueError(f"param {path!r} is not contiguous; host-resident state "
                                         "needs contiguous params (call .contiguous() on it, or "
                                         "keep it on the device with a placement.select)")
                    self.executor.reserve(p.device)
                # delayed: the new param waits in host staging, so the value must be separate
                need_master = p.dtype in LOW_PRECISION or where != p.device or (host and self.delayed)
                masters.append(p.detach().to(where, self._value_dtype(p), copy=True).contiguous()
                               if need_master else None)
                for lst, (_, d) in zip(moments, self.moments):
                    lst.append(torch.zeros(p.shape, dtype=self._moment_dtype(d, p), device=where))
        unflat = lambda xs: optree.tree_unflatten(spec, xs)  # noqa: E731
        fields = {f: unflat(lst) for (f, _), lst in zip(self.moments, moments)}
        absent = {f: () for f in self.state_cls._fields  # e.g. SGD's momentum, without momentum
                  if f not in fields and f not in ("count", "master", "params")}
        return self.state_cls(
            count=torch.zeros((), dtype=torch.int64), **fields, **absent,
            master=unflat(masters),
            params=ParamRefs(params, unflat(staging) if self.delayed else None),
        )

    def _staging(self, leaves: list[torch.Tensor], on_host: Sequence[bool]) -> list[Optional[torch.Tensor]]:
        """Delayed mode: one host buffer per param dtype (pinned for GPU params), cut into a
        1-D view per host-resident leaf; the new params wait there until the next update."""
        out: list[Optional[torch.Tensor]] = [None] * len(leaves)
        if not self.delayed:
            return out
        groups: dict[tuple, list[int]] = {}
        for i, (p, host) in enumerate(zip(leaves, on_host)):
            if host:
                groups.setdefault((p.dtype, p.device.type == "cuda"), []).append(i)
        for (dtype, pin), idx in groups.items():
            arena = torch.empty(sum(leaves[i].numel() for i in idx), dtype=dtype, pin_memory=pin)
            offset = 0
            for i in idx:
                out[i] = arena[offset: offset + leaves[i].numel()]
                offset += leaves[i].numel()
        return out

    # ---- update ---------------------------------------------------------------------------
    def _leaves(self, state: Any) -> list[_Leaf]:
        params = state.params.tree
        paths, ps, _ = leaves_with_paths(params)
        ps = [local(p) for p in ps]
        masters = flatten_like(state.master, params, "state.master")
        moms = [flatten_like(getattr(state, f), params, f"state.{f}") for f, _ in self.moments]
        return [_Leaf(paths[i], ps[i], masters[i] if masters[i] is not None else ps[i],
                      tuple(m[i] for m in moms), masters[i] is not None)
                for i in range(len(ps))]

    def _check_grads(self, grads: Any, params: Params, leaves: list[_Leaf]) -> list[Optional[torch.Tensor]]:
        gs = [local(g) for g in flatten_like(grads, params, "grads")]
        for leaf, g in zip(leaves, gs):
            if g is None:
                continue
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"grad {leaf.path!r} is a {type(g).__name__}; expected a tensor or None")
            p = leaf.param
            if g.shape != p.shape:
                raise ValueError(f"grad {leaf.path!r} has shape {tuple(g.shape)} but its param has "
                                 f"shape {tuple(p.shape)}; pass the gradient of that param")
            if g.dtype != p.dtype:
                raise TypeError(f"grad {leaf.path!r} has dtype {g.dtype} but its param is {p.dtype}; "
                                f"cast the grad with .to({p.dtype})")
            if g.device != p.device:
                raise ValueError(f"grad {leaf.path!r} is on {g.device} but its param is on "
                                 f"{p.device}; move the grad to {p.device}")
        return gs

    def _decay_flags(self, params: Params) -> list[bool]:
        mask = self.weight_decay_mask
        if mask is None:
            return [True] * len(optree.tree_leaves(params))
        tree = mask(params) if callable(mask) else mask
        return [bool(m) for m in flatten_like(tree, params, "weight_decay_mask")]

    def _begin(self, state: Any) -> int:
        """Check ``state`` can be updated, land a delayed step still in flight; the count."""
        if not isinstance(state, self.state_cls):
            raise TypeError(f"{self.name}.update expects the {self.state_cls.__name__} from its "
                            f"init, got {type(state).__name__}")
        n = int(state.count)
        if n < 0:
            raise RuntimeError(f"this {self.state_cls.__name__} was consumed by an earlier update "
                               "(its buffers were reused in place); use the state that update "
                               "returned")
        if state.params.pending is not None:
            state.params.pending()  # delayed: the previous step's params land now
        return n

    def _hypers(self, n: int) -> tuple[Any, Any]:
        hyper = self.hyper(at_step("lr", self.lr, n), at_step("weight_decay", self.weight_decay, n),
                           n + 1)
        return hyper, hyper._replace(weight_decay=0.0)

    @staticmethod
    def _host_leaf(leaf: _Leaf, g: torch.Tensor, out: torch.Tensor, h: Any) -> HostLeaf:
        return HostLeaf(leaf.path, g.detach().reshape(-1), out,
                        (leaf.value.view(-1), *(m.view(-1) for m in leaf.moments)), leaf.has_master, h)

    def update(self, grads: Any, state: Any) -> tuple[Params, Any]:
        n = self._begin(state)
        refs = state.params
        params = refs.tree
        leaves = self._leaves(state)
        gs = self._check_grads(grads, params, leaves)
        return params, self._apply(state, leaves, gs, self._decay_flags(params), *self._hypers(n))

    def _apply(self, state: Any, leaves: list[_Leaf], gs: list, decay: list[bool], hyper: Any,
               hyper0: Any) -> Any:
        """Update the leaves with a grad (device-resident first, then the host part); return the
        new state and consume the old one."""
        refs = state.params
        staged = flatten_like(refs.staging, refs.tree, "staging") if self.delayed else [None] * len(leaves)
        with torch.no_grad():
            groups: dict[tuple, list[tuple[_Leaf, torch.Tensor]]] = {}
            host: list[HostLeaf] = []
            targets: list[torch.Tensor] = []  # delayed: where the staged params land later
            for leaf, g, d, st in zip(leaves, gs, decay, staged):
                if g is None:
                    continue  # no gradient: neither the param nor its state changes
                h = hyper if d else hyper0
                if leaf.on_host:
                    out = leaf.param.detach().view(-1)
                    if st is not None:
                        targets.append(out)
                        out = st
                    host.append(self._host_leaf(leaf, g, out, h))
                else:
                    key = (leaf.value.device, leaf.value.dtype,
                           tuple(m.dtype for m in leaf.moments), h)
                    groups.setdefault(key, []).append((leaf, g))
            tl = self.executor.timeline
            for key, items in groups.items():  # device-resident: queued first, runs concurrently
                s0 = tl.stamp(key[0]) if tl else None
                values = [lf.value for lf, _ in items]
                self.device_math(values, [g for _, g in items],
                                 [[lf.moments[j] for lf, _ in items] for j in range(len(self.moments))],
                                 key[-1])
                written = [(lf.param, lf.value) for lf, _ in items if lf.has_master]
                if written:
                    torch._foreach_copy_([p for p, _ in written], [v for _, v in written])
                if tl:
                    tl.span("GPU update", f"{len(items)} leaves", s0, tl.stamp(key[0]))
            if host:
                kernel = self._host_kernel(any(h.grad.is_cuda for h in host), [h.state for h in host])
                if self.delayed:
                    refs = refs._replace(pending=self.executor.start(host, kernel, targets))
                else:
                    self.executor.run(host, kernel)
            elif self.delayed:
                refs = refs._replace(pending=None)  # nothing in flight (the last step has landed)
        new_count = torch.tensor(int(state.count) + 1, dtype=torch.int64)
        state.count.fill_(-1)  # donation: the old state is consumed
        return state._replace(count=new_count, params=refs)

    def _host_kernel(self, gpu: bool, states: Sequence[Sequence[torch.Tensor]]) -> Kernel:
        """The kernel for host leaves with ``states`` ``(value, moments...)``; ``gpu``: some of
        them belong to GPU params. The native one when it is built and takes every leaf's
        dtypes (fp32 value, fp32/bf16 moments), else the torch one."""
        mod = None
        # "auto" builds the native kernel for offloaded GPU params, where it is the step's floor;
        # CPU-only training keeps the torch kernel and skips the one-time build.
        if self.cpu_kernel == "native" or (self.cpu_kernel == "auto" and gpu):
            mod = cpu_kernels.native()
            if mod is None and self.cpu_kernel == "native":
                raise RuntimeError("cpu_kernel='native' but the native CPU kernel could not be "
                                   "built here (needs a C++ compiler and ninja); use 'auto'")
        supported = (torch.float32, torch.bfloat16)
        if mod is not None and all(st[0].dtype == torch.float32 and all(m.dtype in supported for m in st[1:])
                                   for st in states):
            return cpu_kernels.NativeKernel(mod, self.native_math)

        def kernel(work: Work) -> None:
            for p, a, b in work.claims():
                out = p.out[a:b] if p.out is not None else None
                self.host_math(p.state[0][a:b], p.grad[a:b], tuple(m[a:b] for m in p.state[1:]),
                               out, p.hyper)

        return kernel
