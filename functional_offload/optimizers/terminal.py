"""A terminal optimizer from its spec: state layout and placement, hyperparameters, the step.

:func:`terminal` is what every constructor (``adamw``, ``sgd``...) returns through: it validates
the options, and its ``init`` lays out the state (masters, moments, EMA) where the
placement puts each leaf. ``update`` and ``begin`` run steps (:mod:`.step`).

Per leaf, the *value* is the tensor the math updates: the fp32 master when there is one (low-
precision params; params on a GPU whose state lives on the host; delayed host leaves), else the
param itself.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import optree
import torch

from functional_offload.base import Optimizer, ParamRefs, Step, StepCache
from functional_offload.checks import real
from functional_offload.executor import HostExecutor, default_executor
from functional_offload.executor.pinned import empty_pinned, pin_all
from functional_offload.executor.shield import shielded
from functional_offload.kernels import blockwise, native
from functional_offload.kernels.remainder import is_split, new_split
from functional_offload.optimizers.delay import Delay, as_delay
from functional_offload.optimizers.forms.gpu_engine import takes
from functional_offload.optimizers.packing import PACK_MAX, arrange
from functional_offload.optimizers.spec import OptimizerSpec, check_representable, check_schedule
from functional_offload.optimizers.layout import Leaf, decay_flags, layout
from functional_offload.optimizers.step import TerminalStep
from functional_offload.placement import Placement, on_host, previewing, record_plan
from functional_offload.quantized import is_quantized
from functional_offload.tree import (check_no_aliasing, check_tensor_leaves, check_unique_paths,
                                     grads_of, leaves_with_paths, local)
from functional_offload.typing import Params, ScalarOrSchedule

__all__ = ["terminal", "Terminal", "LOW_PRECISION"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


SUPPORTED = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MOMENT_DTYPES = (*SUPPORTED, torch.uint8)  # uint8: block-wise 8-bit (kernels/blockwise.py)


def _low(p: torch.Tensor) -> bool:
    """Whether ``p`` holds fewer bits than the math needs: bf16, fp16 and quantized params
    (their state is fp32 and their value a master)."""
    return p.dtype in LOW_PRECISION or is_quantized(p)


def _check_dtype(name: str, dt: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if dt is not None and dt not in MOMENT_DTYPES:
        raise TypeError(f"{name} must be one of {[str(d) for d in MOMENT_DTYPES]} or None "
                        f"(torch.uint8: block-wise 8-bit), got {dt!r}")
    return dt


class Terminal:
    """The machinery of one terminal optimizer (see :func:`terminal`)."""

    def __init__(self, spec: OptimizerSpec, hypers: Mapping[str, ScalarOrSchedule], *,
                 moment_dtypes: Mapping[str, Optional[torch.dtype]], placement: Optional[Placement],
                 master_dtype: torch.dtype, weight_decay_mask: Any, ema_decay: Optional[float],
                 executor: Optional[HostExecutor], cpu_kernel: str, delayed: Union[bool, Delay],
                 store_param_remainders: bool = False, device_kernel: str = "torch"):
        if placement is not None and not isinstance(placement, Placement):
            raise TypeError(f"placement must be a functional_offload.placement.Placement, got "
                            f"{type(placement).__name__} (e.g. placement.offload_fraction(0.5))")
        if cpu_kernel not in ("auto", "native", "torch"):
            raise ValueError(f"cpu_kernel must be 'auto', 'native' or 'torch', got {cpu_kernel!r}")
        if cpu_kernel == "native" and spec.native is None:
            raise ValueError(f"cpu_kernel='native': {spec.name} has no native CPU kernel; use "
                             "'auto' or 'torch'")
        if device_kernel not in ("torch", "te"):
            raise ValueError(f"device_kernel must be 'torch' or 'te', got {device_kernel!r}")
        if device_kernel == "te" and spec.device_writes is None:
            raise ValueError(f"device_kernel='te': {spec.name} has no TransformerEngine kernel")
        if master_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"master_dtype must be torch.float32 or torch.float64, got {master_dtype!r}")
        if executor is not None and not isinstance(executor, HostExecutor):
            raise TypeError(f"executor must be a HostExecutor, got {type(executor).__name__}")
        if ema_decay is not None and (real(ema_decay) is None or not 0 <= ema_decay < 1):
            raise ValueError(f"ema_decay must be a number in [0, 1) or None, got {ema_decay!r}")
        if weight_decay_mask is not None and spec.decay is None:
            raise TypeError(f"{spec.name} has no weight decay to mask")
        delay = as_delay(delayed)
        if not isinstance(store_param_remainders, bool):
            raise TypeError(f"store_param_remainders must be True or False, got "
                            f"{store_param_remainders!r}")
        if store_param_remainders and master_dtype != torch.float32:
            raise ValueError("store_param_remainders=True keeps an fp32 master as the bf16 param "
                             f"and a 16-bit remainder; it needs master_dtype=torch.float32, got "
                             f"{master_dtype}")
        if delay is not None and not spec.elementwise:
            raise ValueError(f"{spec.name} does not support delayed=True: its host step runs leaf "
                             "by leaf; hide it with fo.stream, or keep its state on the device")
        if delay is not None and delay.lookahead and spec.ahead is None:
            raise ValueError(f"{spec.name} has no look-ahead for delayed=True: pass "
                             "delayed=fo.Delay(lookahead=False, warmup=100, exact_when_clipped=True) "
                             "to train on one-step-stale gradients with exact warm-up and clipped "
                             "steps, or hide the host step with fo.stream")
        missing = set(spec.hyperparameters) - set(hypers)
        extra = set(hypers) - set(spec.hyperparameters)
        if missing or extra:
            raise TypeError(f"{spec.name}: hyperparameters {sorted(missing)} missing, "
                            f"{sorted(extra)} unknown")
        self.spec = spec
        spec.state.TORCH_NAMES = spec.torch_names()  # what torch_state_names reads
        self.hypers = {k: check_schedule(k, v, spec.hyperparameters[k]) for k, v in hypers.items()}
        if not any(callable(v) for v in self.hypers.values()):  # constants: check them all now
            self.hyper_at(0)
        self.moment_dtypes = {m.name: _check_dtype(m.option, moment_dtypes.get(m.name))
                              for m in spec.moments}
        self.placement = placement or on_host()
        self.master_dtype = master_dtype
        self.weight_decay_mask = weight_decay_mask
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self._executor = executor
        self.cpu_kernel = cpu_kernel
        self.delay = delay  # which delayed updates are exact (None: not delayed)
        self.store_param_remainders = store_param_remainders
        self.device_writes = spec.device_writes if device_kernel == "te" else None
        self._whole: dict[int, int] = {}  # a DTensor shard's id -> its param's elements (init)

    @property
    def delayed(self) -> bool:
        return self.delay is not None

    @property
    def executor(self) -> HostExecutor:
        return self._executor if self._executor is not None else default_executor()

    @property
    def threads(self) -> int:
        """Worker threads per run (one fewer for delayed steps: the training loop runs meanwhile)."""
        n = self.executor.threads
        return max(1, n - 1) if self.delayed else n

    # ---- hyperparameters ----------------------------------------------------------------
    def hyper_at(self, n: int) -> tuple[Any, Any]:
        """The math's values for step count ``n`` (all leaves, and leaves without decay);
        raises ``ValueError`` naming a hyperparameter whose value is out of range."""
        values = {}
        for k, v in self.hypers.items():
            if callable(v):
                x = v(n)
                try:
                    values[k] = self.spec.hyperparameters[k](k, float(x) if isinstance(x, torch.Tensor) else x)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"the {k} schedule returned {x!r} at step {n}: {e}") from None
            else:
                values[k] = v
        hyper = self.spec.hyper(values, n + 1)
        check_representable(self.spec, hyper, sorted(self.hypers))
        if self.spec.decay is None:
            return hyper, hyper
        return hyper, self.spec.hyper({**values, self.spec.decay: 0.0}, n + 1)

    # ---- init -----------------------------------------------------------------------------
    def _elements(self, p: torch.Tensor) -> int:
        """The elements of the param ``p`` (a local tensor), counted over the whole param for a
        DTensor's shard (as :meth:`init` noted them)."""
        return self._whole.get(id(p), p.numel())

    def _small(self, p: torch.Tensor) -> bool:
        """Whether the param ``p`` has at most ``PACK_MAX`` elements (:meth:`_elements`): what
        decides a leaf's format must be the same on every rank."""
        return self._elements(p) <= PACK_MAX

    def _moment_dtype(self, name: str, p: torch.Tensor) -> torch.dtype:
        """The moment's dtype for ``p``: the option's (block-wise 8-bit only for leaves of more
        than ``PACK_MAX`` elements, as bitsandbytes keeps small tensors in 32 bits: their bytes
        are few), else fp32 for low-precision params and the param's dtype for others."""
        dt = self.moment_dtypes[name]
        if dt is None or (dt == torch.uint8 and self._small(p)):
            return torch.float32 if _low(p) else p.dtype
        return dt

    def _value_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.master_dtype if _low(p) else p.dtype

    def _moment_shape(self, m: Any, p: torch.Tensor) -> Optional[tuple[int, ...]]:
        """The moment's shape for ``p``: its own (factored state), the param's, or a block-wise
        moment's bytes (1-D)."""
        if m.shape is not None:
            return m.shape(p.shape)
        if self._moment_dtype(m.name, p) == torch.uint8:
            return (blockwise.nbytes(p.numel()),)
        return tuple(p.shape)

    def _needs_master(self, p: torch.Tensor, host: bool) -> bool:
        """Whether the leaf's value is a master apart from the param: low-precision and
        quantized params; host state of a GPU param; delayed host leaves (the new param waits in
        a buffer); strided host params (a contiguous master, written back with a strided copy)."""
        return _low(p) or (host and (
            p.device.type != "cpu" or self.delayed or not p.is_contiguous()))

    def _split(self, p: torch.Tensor, host: bool) -> bool:
        """Whether the leaf's master is split (kernels/remainder.py): bf16 params with
        ``store_param_remainders``, but for small host leaves, which keep fp32 masters (their
        bytes are few; a pack shares one fp32 arena). In every mode: the delayed forms, which
        pack nothing, give such a leaf the fp32 master too, so that its params round as the
        plain step's (ties to even), bit for bit."""
        return (self.store_param_remainders and p.dtype == torch.bfloat16 and not is_quantized(p)
                and not (host and self._small(p)))

    def _lean(self, p: torch.Tensor, host: bool) -> bool:
        """Whether the leaf's split master is its remainder alone (kernels/remainder.py), the
        param's bits being the high half: the state of a contiguous bf16 param kept where the
        param is (the device math reads and writes those bits in place), and the host state of
        one on a GPU (its bits copied down with the grad, stepped, copied back up) but for
        delayed updates with a look-ahead (whose landing reads the new values apart from the
        params). A CPU param's host state keeps both halves, as does the host state of a math
        that is not element-wise (each leaf joined, stepped and split whole on the host)."""
        if not (p.is_contiguous() and self._needs_master(p, host) and self._split(p, host)):
            return False
        return not host or (p.device.type != "cpu"  # (meta: a plan's preview)
                            and self.spec.elementwise
                            and not (self.delay is not None and self.delay.lookahead))

    def _state_bytes(self, p: torch.Tensor, host: bool) -> int:
        """State bytes of a leaf as init makes them: moments, master (if it gets one), EMA."""
        total = 0
        for m in self.spec.moments:
            shape = self._moment_shape(m, p)
            if shape is not None:
                total += math.prod(shape) * self._moment_dtype(m.name, p).itemsize
        value = self._value_dtype(p)
        per = value.itemsize if self._needs_master(p, host) else 0
        if self._lean(p, host):  # the remainder; the param holds the high half
            per = torch.int16.itemsize
        if self.ema_decay is not None:
            per += torch.promote_types(value, torch.float32).itemsize
        return total + p.numel() * per

    def _check_params(self, paths: list[str], locals_: list[torch.Tensor]) -> None:
        for path, p in zip(paths, locals_):
            if not p.dtype.is_floating_point:
                raise TypeError(f"param {path!r} has dtype {p.dtype}; only floating params can "
                                "be optimized (leave integer buffers out of the params tree)")
            if p.dtype not in SUPPORTED:
                raise TypeError(f"param {path!r} has dtype {p.dtype}; params must be fp32, bf16, "
                                "fp16 or fp64, or a TransformerEngine quantized tensor (fp8 "
                                "weights from fp8_model_init)")
            if is_quantized(p) and (p.dtype == torch.float64 or self.master_dtype != torch.float32):
                raise TypeError(f"param {path!r} is a quantized {type(p).__name__} of nominal "
                                f"dtype {p.dtype}: quantized params keep an fp32 master (their "
                                "formats dequantize to fp32 at most); use "
                                "master_dtype=torch.float32 and an fp32, bf16 or fp16 params_dtype")
            if is_quantized(p) and not self.spec.elementwise:
                raise TypeError(f"param {path!r} is a quantized {type(p).__name__}, which "
                                f"{self.spec.name}'s leaf-by-leaf step does not write; use an "
                                "element-wise optimizer (adamw, adam, sgd, lion) for it, or "
                                "keep it out of this one with fo.partition")
            eight = [m.option for m in self.spec.moments if self._moment_dtype(m.name, p) == torch.uint8]
            if eight and self._value_dtype(p) != torch.float32:
                raise TypeError(f"param {path!r} would have a {self._value_dtype(p)} value; "
                                f"{eight[0]}=torch.uint8 (block-wise 8-bit) runs the math in fp32 "
                                "(use an fp32 master_dtype, or keep this param out of the 8-bit "
                                "optimizer with fo.partition)")
        check_no_aliasing(paths, locals_)

    def _check_host(self, paths: list[str], locals_: list[torch.Tensor], on_host: list[bool]) -> None:
        """Refuse host leaves that the executor's engine, ``cpu_kernel`` or ``delayed`` cannot
        step."""
        first: dict[torch.device, str] = {}  # a host leaf per device of their params
        for path, p, host in zip(paths, locals_, on_host):
            if host:
                first.setdefault(p.device, path)
            if host and self.delayed and len(first) > 1:
                (a, da), (b, db) = [(q, d) for d, q in first.items()][:2]
                raise ValueError(f"delayed=True: params {a!r} ({da}) and {b!r} ({db}) are on "
                                 "different devices, but a delayed update lands the host-resident "
                                 "leaves of one device; give each device's params an optimizer "
                                 "of their own (fo.partition), or keep one device's state on it "
                                 "with placement.select")
            if host and self.executor.engine != "cpu" and p.device.type not in ("cuda", "meta"):
                raise ValueError(f"param {path!r} is on {p.device}, but "
                                 f"HostExecutor(engine={self.executor.engine!r}) steps "
                                 "host-resident state on its params' GPU; use engine='cpu' (the "
                                 "default) for params off a GPU")
            moment_dtypes = {self._moment_dtype(m.name, p) for m in self.spec.moments}
            if host and self.cpu_kernel == "native" and (
                    self._value_dtype(p) != torch.float32 or len(moment_dtypes) > 1
                    or not moment_dtypes <= {torch.float32, torch.bfloat16, torch.uint8}):
                small = torch.uint8 in self.moment_dtypes.values() and self._small(p)
                why = (f" (8-bit moments are for leaves of more than {PACK_MAX} elements; its "
                       f"{self._elements(p)} keep fp32 ones)" if small else "")
                raise ValueError(f"cpu_kernel='native': param {path!r} would have a "
                                 f"{self._value_dtype(p)} value and {sorted(map(str, moment_dtypes))} "
                                 f"moments{why}; the native kernel takes fp32 values and fp32, bf16 "
                                 "or block-wise 8-bit moments of one format (use cpu_kernel='auto', "
                                 "or one moment dtype)")
            if host and self.delayed and is_quantized(p):
                raise ValueError(f"param {path!r} is a quantized {type(p).__name__}, which the "
                                 "delayed update cannot land (it is written whole, through its "
                                 "quantizer); keep its state on the device with placement.select, "
                                 "or use delayed=False")
            if host and self.delayed and not p.is_contiguous():
                raise ValueError(f"param {path!r} is not contiguous; the delayed update lands "
                                 "params as flat copies (call .contiguous() on "
                                 "it, or keep its state on the device with placement.select)")
            if host and self.executor.engine == "gpu" and self.spec.elementwise:
                whole = not is_quantized(p) and not self._engine_takes(p)
                built = [what for what, on in (
                    ("a quantized param", is_quantized(p)),
                    ("a split master or block-wise 8-bit moments of a length not divisible by 4 "
                     f"whose state is over the executor's engine_chunk_bytes "
                     f"({self.executor.engine_chunk_bytes})",
                     whole)) if on]
                if built:
                    raise ValueError(f"param {path!r}: HostExecutor(engine='gpu') does not step "
                                     f"{built[0]} yet; use engine='cpu' (the default) for it")
            if (host and self.delay is not None and self.delay.lookahead
                    and self.spec.ahead_dtypes is not None and p.dtype not in self.spec.ahead_dtypes):
                raise ValueError(f"param {path!r} is {p.dtype}: {self.spec.name}'s look-ahead for "
                                 "delayed=True keeps its values in the param's dtype, whose range "
                                 f"only {', '.join(map(str, self.spec.ahead_dtypes))} cover; use "
                                 "bf16 params, or delayed=fo.Delay(lookahead=False)")

    def _specs(self, p: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shapes and dtypes of a host leaf's state tensors as :meth:`_make_state` makes
        them (``p`` not quantized): value (a split master's two halves), moments, EMA."""
        out: list[tuple[tuple[int, ...], torch.dtype]] = []
        split = self._needs_master(p, True) and self._split(p, True)
        if split:
            out.append(((1 if self._lean(p, True) else 2, *p.shape), torch.int16))
        elif self._needs_master(p, True):
            out.append((tuple(p.shape), self._value_dtype(p)))
        for m in self.spec.moments:
            shape = self._moment_shape(m, p)
            if shape is not None:
                out.append((tuple(shape), self._moment_dtype(m.name, p)))
        if self.ema_decay is not None:
            value = p.dtype if split or not self._needs_master(p, True) else self._value_dtype(p)
            out.append((tuple(p.shape), torch.promote_types(value, torch.float32)))
        return out

    def _engine_takes(self, p: torch.Tensor) -> bool:
        """Whether the GPU engine steps host leaf ``p`` (not quantized), from the state
        :meth:`_make_state` makes it (:func:`~functional_offload.optimizers.forms.gpu_engine.
        takes`)."""
        specs = self._specs(p)
        split = bool(specs) and specs[0][1] == torch.int16  # a split master's halves, first
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
        if split:  # its halves apart, as the engine takes them (the param's own bits first)
            sizes[:1] = [sizes[0] // specs[0][0][0]] * 2
        return takes(p.numel(), split, any(dtype == torch.uint8 for _, dtype in specs), sizes,
                     self.executor.engine_chunk_bytes)

    @torch.no_grad()
    def _make_state(self, locals_: list[torch.Tensor], on_host: list[bool], preview: bool,
                    pinned: list[bool]) -> tuple[list, dict[str, list], list]:
        """Per leaf, its master (or None), moments and EMA, where the placement put it (on the
        meta device for a preview). The state of the ``pinned`` host leaves is made in pinned
        arenas (:func:`~functional_offload.executor.pinned.empty_pinned`), never in pageable
        memory first: a GPU engine's state of a large model would otherwise need twice its
        bytes of host memory at init."""
        masters, emas = [], []
        moments: dict[str, list] = {m.name: [] for m in self.spec.moments}
        views = iter(empty_pinned([x for p, pin in zip(locals_, pinned) if pin
                                   for x in self._specs(p)]))
        for p, host, pin in zip(locals_, on_host, pinned):
            where = torch.device("meta") if preview else (torch.device("cpu") if host else p.device)

            def new(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool = False,
                    pin: bool = pin, where: torch.device = where) -> torch.Tensor:
                if pin:
                    return next(views)
                return torch.empty(shape, dtype=dtype, device=where, pin_memory=pin_memory)

            master = None
            if self._needs_master(p, host) and self._split(p, host):
                rows = 1 if self._lean(p, host) else 2  # pinned where the element-wise forms
                master = new_split(p, new((rows, *p.shape), torch.int16,  # copy it up
                                          not preview and host and p.device.type == "cuda"
                                          and self.spec.elementwise))
            elif is_quantized(p) and preview:
                master = torch.empty(p.shape, dtype=self._value_dtype(p), device=where)
            elif is_quantized(p):  # read through its format: a master apart, always
                master = p.dequantize(dtype=self._value_dtype(p)).to(where).contiguous()
            elif self._needs_master(p, host):
                master = new(tuple(p.shape), self._value_dtype(p)).copy_(p.detach())
            masters.append(master)
            for m in self.spec.moments:
                shape = self._moment_shape(m, p)
                moments[m.name].append(None if shape is None else new(
                    tuple(shape), self._moment_dtype(m.name, p)).zero_())
            if self.ema_decay is not None:
                src = master if master is not None and not is_split(master) else p.detach()
                emas.append(new(tuple(p.shape), torch.promote_types(src.dtype, torch.float32))
                            .copy_(src))  # fp32, fp64 for fp64 values
        return masters, moments, emas

    def init(self, params: Params) -> Any:
        try:
            return self._init(params)
        finally:
            self._whole = {}  # (ids of tensors that may be gone by the next init)

    def _init(self, params: Params) -> Any:
        paths, leaves, spec = leaves_with_paths(params)
        check_tensor_leaves(leaves, paths, "params")
        check_unique_paths(paths, "params", "checkpoints name each leaf's state by its path")
        locals_ = [local(p) for p in leaves]  # DTensor params: state for this rank's shard
        self._whole = {id(x): p.numel() for p, x in zip(leaves, locals_)}  # (see _small)
        self._check_params(paths, locals_)
        tree = optree.tree_unflatten(spec, locals_)
        plan = self.placement.plan(tree, [self._state_bytes(p, False) for p in locals_],
                                   host_bytes=[self._state_bytes(p, True) for p in locals_])
        on_host = plan.host_mask()
        preview = previewing()
        if preview:
            record_plan(plan)
        self._check_host(paths, locals_, on_host)
        if any(on_host) and not preview:
            if self.cpu_kernel != "torch" and self.spec.native is not None:
                native.module()  # build now (once per machine and CPU capability), not mid-step
            for p, host in zip(locals_, on_host):
                if host:
                    self.executor.reserve(p.device, beside=self.delay is not None)
        # the GPU engine runs in plain and delayed steps (its leaves' params are on a GPU)
        engine = not preview and self.spec.elementwise and self.executor.engine != "cpu"
        # small leaves are packed for plain and delayed steps
        pack = not preview and self.spec.elementwise
        packable = [host and self._needs_master(p, True) and not self._split(p, True)
                    and not is_quantized(p) and self._small(p)
                    for p, host in zip(locals_, on_host)]
        # the GPU engine copies its host state in place: pinned (with "both", of the leaves it
        # can step; packed leaves run on the CPU kernel there)
        own = [engine and host and not is_quantized(p)
               and (self.executor.engine == "gpu" or self._engine_takes(p))
               for p, host in zip(locals_, on_host)]
        masters, moments, emas = self._make_state(
            locals_, on_host, preview, [o and not k for o, k in zip(own, packable)])
        fields = [masters, *moments.values(), *([emas] if self.ema_decay is not None else [])]
        packs = arrange([i for i, k in enumerate(packable) if k], fields,
                        decay_flags(tree, self.weight_decay_mask), locals_,
                        pin=engine and self.executor.engine == "gpu") if pack else []
        packed = {i for pack in packs for i in pack.members}
        small = [(f, i) for f in fields for i in range(len(locals_))  # packable, not packed
                 if own[i] and packable[i] and i not in packed and f[i] is not None]
        for (f, i), x in zip(small, pin_all([f[i] for f, i in small])):
            f[i] = x
        unflat = lambda xs: optree.tree_unflatten(spec, xs)  # noqa: E731
        fields = {name: unflat(xs) for name, xs in moments.items()}
        absent = {f: () for f in self.spec.state._fields
                  if f not in fields and f not in ("count", "master", "ema", "params")}
        cache = StepCache(packs=packs,
                          wants_scale=self.delay is not None and self.delay.exact_when_clipped)
        grads_of(params, cache)  # the params as laid out now: a change before the first step is seen
        return self.spec.state(
            count=torch.zeros((), dtype=torch.int64), **fields, **absent,
            master=unflat(masters), ema=unflat(emas) if self.ema_decay is not None else (),
            params=ParamRefs(params, cache=cache),
        )

    # ---- steps ----------------------------------------------------------------------------
    def check_state(self, state: Any, action: str) -> None:
        if not isinstance(state, self.spec.state):
            raise TypeError(f"{self.spec.name}.{action} expects the {self.spec.state.__name__} "
                            f"from its init, got {type(state).__name__}")

    def layout(self, state: Any) -> list[Leaf]:
        """The leaves of ``state``, in the params' flatten order. Built once and kept in the
        state's cache while its trees, this spec and this weight-decay mask are the same objects
        (an update keeps them); the mask is evaluated when the layout is built."""
        cache = state.params.cache
        key = (self.spec, self.weight_decay_mask, state.params.tree, state.master, state.ema,
               *(getattr(state, m.name) for m in self.spec.moments))
        if cache is not None and len(cache.key) == len(key) and all(
                a is b for a, b in zip(cache.key, key)):
            return cache.layout
        leaves = layout(state, self.spec, lambda params: decay_flags(params, self.weight_decay_mask),
                        self.ema_decay is not None)
        if cache is not None:
            cache.invalidate("layout")
            cache.key, cache.layout = key, leaves
        return leaves

    def begin(self, state: Any, speculative: bool = False) -> Step:
        return TerminalStep(self, state, speculative)

    def update(self, grads: Any, state: Any) -> tuple[Params, Any]:
        if grads is None:  # (a leaf's grad may be None: that leaf is not updated)
            raise ValueError(f"{self.spec.name}: grads is None; pass a tree like the params")
        # begun and finished in one shielded call: no signal lands between claiming the state
        # and marking it (the step's own settle makes the state passed in hold the step)
        out, interrupt = shielded(lambda: self.begin(state).finish(grads))
        if interrupt is not None:
            raise interrupt
        return out


def terminal(spec: OptimizerSpec, hypers: Mapping[str, ScalarOrSchedule], *,
             moment_dtypes: Mapping[str, Optional[torch.dtype]], placement: Optional[Placement] = None,
             master_dtype: torch.dtype = torch.float32, weight_decay_mask: Any = None,
             ema_decay: Optional[float] = None, executor: Optional[HostExecutor] = None,
             cpu_kernel: str = "auto", delayed: Union[bool, Delay] = False,
             store_param_remainders: bool = False, device_kernel: str = "torch") -> Optimizer:
    """The :class:`~functional_offload.Optimizer` of ``spec`` with these hyperparameters and
    options (see :func:`~functional_offload.adamw` for what each option does). Everything is
    validated here, before any state exists."""
    t = Terminal(spec, hypers, moment_dtypes=moment_dtypes, placement=placement,
                 master_dtype=master_dtype, weight_decay_mask=weight_decay_mask,
                 ema_decay=ema_decay, executor=executor, cpu_kernel=cpu_kernel, delayed=delayed,
                 store_param_remainders=store_param_remainders, device_kernel=device_kernel)
    return Optimizer(t.init, t.update, t.begin)

