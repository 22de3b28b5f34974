"""The native host kernels (``csrc/``), built once per machine and CPU capability and cached.

:func:`module` builds and loads the extension on first use: ``queue.cpp`` (the run's queue,
optimizer-agnostic), ``math.cpp`` (one struct per element-wise op, registered by name) and the
headers. Compiler flags follow the architecture and the CPU capability torch reports
(``torch.backends.cpu.get_cpu_capability()``). The build folder is named by :func:`build_key`:
the capability and a hash of the sources' bytes, the flags, the compiler and the torch and
Python versions, not of the sources' path. The sources are copied into it and built from there,
so every checkout (or installed copy) of the same sources loads one build, and a cache shared by
machines with different CPUs never loads a build made for another instruction set. A build
prints one line to stderr before it starts and one with its time; when no compiler is there, a
:class:`RuntimeWarning` says so and :func:`module` returns ``None`` (the callers then use the
torch kernel).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

import torch

from functional_offload.kernels import blockwise
from functional_offload.kernels.work import Work

__all__ = ["module", "build_key", "NativeKernel", "NativeQueue", "ops"]

_DIR = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ["queue.cpp", "math.cpp"]
_HEADERS = ["ops.h", "elements.h"]
_COMMON = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd"]


def _flags(capability: str) -> list[str]:
    """Compiler flags for this architecture and CPU capability (never ``-march=native``: the
    build must run on every CPU of the capability its directory is named after)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        arch = {"AVX512": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
                "AVX2": ["-march=x86-64-v3"]}.get(capability, ["-march=x86-64-v2"])
        return _COMMON + arch + ["-mtune=native"]
    if machine in ("aarch64", "arm64"):
        return _COMMON + ["-march=armv8-a"]
    return list(_COMMON)


def build_key(sources: str = _DIR, capability: Optional[str] = None) -> str:
    """The name of the build folder of the kernel sources in the folder ``sources``:
    ``<machine>-<capability>-<hash>``, the hash over the sources' bytes, the compiler flags of
    ``capability`` (default: this CPU's), the compiler (``$CXX``) and the torch and Python
    versions. The folder's path is not part of it: two copies of the sources share a build."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    config = [*_flags(capability), os.environ.get("CXX", "c++"), torch.__version__,
              sys.implementation.cache_tag or sys.version]
    digest = hashlib.sha256("\0".join(config).encode())
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(sources, name), "rb") as f:
            data = f.read()
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
    return f"{platform.machine()}-{capability}-{digest.hexdigest()[:16]}"


def _build_dir(key: str) -> str:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    return os.path.join(base, "functional_offload", key)


def _copy_sources(folder: str) -> str:
    """The sources copied into ``folder/src`` (a file is written only when it is missing or
    differs, atomically): the build names these paths, the same for every checkout."""
    src = os.path.join(folder, "src")
    os.makedirs(src, exist_ok=True)
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_DIR, name), "rb") as f:
            data = f.read()
        target = os.path.join(src, name)
        try:
            with open(target, "rb") as f:
                if f.read() == data:
                    continue
        except FileNotFoundError:
            pass
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    return src


@functools.lru_cache(maxsize=None)
def module() -> Optional[ModuleType]:
    """The compiled module (built on first use, once per machine and CPU capability), or
    ``None`` with one warning when it cannot be built here (no compiler, no ninja)."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    flags = _flags(capability)
    folder = _build_dir(build_key(_DIR, capability))
    name = "functional_offload_native"
    cached = os.path.exists(os.path.join(folder, name + ".so"))
    start = time.perf_counter()
    try:
        src = _copy_sources(folder)
        if not cached:
            print(f"functional_offload: building the native CPU kernel for {capability} in "
                  f"{folder} (once per machine and CPU capability; about a minute)",
                  file=sys.stderr, flush=True)
        mod = cpp_extension.load(name=name, sources=[os.path.join(src, s) for s in _SOURCES],
                                 extra_cflags=flags, extra_include_paths=[src],
                                 build_directory=folder, verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported flags: fall back, loudly
        warnings.warn(f"functional_offload: native CPU kernel unavailable ({type(e).__name__}: "
                      f"{str(e)[:300]}); using the slower torch kernel", RuntimeWarning,
                      stacklevel=2)
        return None
    if not cached:
        print(f"functional_offload: built the native CPU kernel in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return mod


def ops() -> dict[str, tuple[int, int, int]]:
    """The registered native element-wise ops: ``{name: (moments, scalars, look-ahead
    scalars)}`` (empty without a native build)."""
    mod = module()
    return {} if mod is None else {name: (m, s, a) for name, m, s, a in mod.ops()}


_MAX_MOMENTS = 2  # kMaxMoments (ops.h)
_EMPTY = torch.empty(0)  # "no tensor" in the native lists (no param out, no EMA)


class NativeQueue:
    """The native queue of one run (see :class:`~functional_offload.kernels.work.Queue`)."""

    def __init__(self, queue: Any, kernel: "NativeKernel"):
        self._queue, self._kernel = queue, kernel
        self.ready, self.close, self.cancel = queue.ready, queue.close, queue.cancel
        self.work, self.spans, self.join = queue.work, queue.spans, queue.join

    def start(self, workers: int, cpus: Sequence[int]) -> None:
        """Put ``workers`` threads of the process's native pool in the loop (worker ``i`` on
        ``cpus[i % len(cpus)]``; none: unpinned); :meth:`join` waits for them."""
        self._queue.start(workers, list(cpus))

    def add(self, work: Work) -> int:
        pieces, k = work.pieces, self._kernel
        rows: dict[tuple[int, int], list[float]] = {}  # pieces of one leaf share their hypers
        keys = []
        for p in pieces:
            key = (id(p.hyper), 0 if p.ahead is None else id(p.ahead_hyper))
            if key not in rows:
                ahead = ([0.0] * k.ahead_count if p.ahead is None
                         else k.ahead_scalars(p.hyper, p.ahead_hyper))
                rows[key] = [*k.scalars(p.hyper), *ahead]
            keys.append(key)
        scalars = torch.tensor([rows[key] + [p.ema_decay] for key, p in zip(keys, pieces)],
                               dtype=torch.float64)
        return self._queue.add(k.op, [p.grad for p in pieces],
                               [list(p.state) for p in pieces], [list(p.targets) for p in pieces],
                               [_EMPTY if p.out is None else p.out for p in pieces],
                               [_EMPTY if p.ahead is None else p.ahead for p in pieces],
                               [_EMPTY if p.residual is None else p.residual for p in pieces],
                               [_EMPTY if p.ema is None else p.ema for p in pieces],
                               [_EMPTY if p.ema_target is None else p.ema_target for p in pieces],
                               scalars, k.maps, work.block)

    def wait(self, k: int) -> Optional[BaseException]:
        error = self._queue.wait(k)
        return RuntimeError(error) if error else None


class NativeKernel:
    """A native element-wise op for the executor: ``op`` names it, ``scalars(hyper)`` gives the
    doubles it reads for a piece's hyperparameters (``ahead_scalars(hyper, next_hyper)`` those
    of its look-ahead, for ops with one), ``signed`` per moment whether it may be negative (the
    map of its block-wise 8-bit format). Each run gets its own queue."""

    def __init__(self, mod: ModuleType, op: str, scalars: Callable[[Any], Sequence[float]],
                 signed: Sequence[bool],
                 ahead_scalars: Optional[Callable[[Any, Any], Sequence[float]]] = None):
        self.mod, self.op, self.scalars, self.ahead_scalars = mod, op, scalars, ahead_scalars
        self.ahead_count = next(a for name, _, _, a in mod.ops() if name == op)
        tables = [blockwise.table(sg) for sg in signed]
        tables += [blockwise.table(True)] * (_MAX_MOMENTS - len(tables))  # (unused)
        self.maps = torch.stack(tables)

    def queue(self, threads: int, record: bool = False) -> NativeQueue:
        return NativeQueue(self.mod.Queue(record), self)
