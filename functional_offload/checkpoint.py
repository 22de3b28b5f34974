"""Exact, pickle-free optimizer-state checkpoints, restored into a ``like`` state.

The state tree is flattened to dotted-path keys (``"1.mu.layer.weight"``, ``"1.count"``); the
:class:`~functional_offload.base.ParamRefs` node (the model's own params) is left out. Files are
safetensors with a CRC-32 per tensor in the header. A save writes a temporary file next to the
target, fsyncs it, renames it over the target and fsyncs the directory, so a crash mid-save
leaves the previous checkpoint readable; the temporary file of a killed save is removed by the
next save of that path. A load reads through one open file, so a save renaming a new file over
the path meanwhile yields the old or the new checkpoint, whole. Restoring is strict and exact:
every key, shape and dtype must match ``like`` — a fp32 master is never silently cast — and the
values are copied into ``like``'s tensors, so they keep ``like``'s placement (re-placement on
load).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import math
import os
import secrets
import zlib
from typing import Any, BinaryIO, Optional, Union

import torch

from functional_offload.base import (BUSY, CONSUMED, GradientTransformation, Optimizer, ParamRefs,
                                     check_recoverable, check_states, check_usable, claim, flush,
                                     mark_tensors, release, restore_params, terminal_states)
from functional_offload.checks import is_int
from functional_offload.executor.shield import shielded
from functional_offload.tree import leaves_with_paths
from functional_offload.typing import OptState

__all__ = ["state_dict", "load_state_dict", "save", "load", "CheckpointError"]

_FORMAT = "functional_offload/1"
_is_refs = lambda x: isinstance(x, ParamRefs)  # noqa: E731


class CheckpointError(ValueError):
    """A checkpoint does not match the state it is loaded into, or is truncated or corrupt."""


def _some(keys: list[str], n: int = 8) -> str:
    """``keys`` for a message: how many, and the first ``n`` of them."""
    return (f"{_keys(len(keys))} {keys}" if len(keys) <= n
            else f"{_keys(len(keys))}, the first {n} {keys[:n]}")


def _keys(n: int) -> str:
    return f"{n} key{'' if n == 1 else 's'}"


def check_state(x: Any, what: str) -> None:
    """Raise ``TypeError`` if ``x`` is an optimizer (or a function) where a state is expected;
    ``what`` names the argument ("like", "state")."""
    if isinstance(x, (Optimizer, GradientTransformation)):
        kind = "an Optimizer" if isinstance(x, Optimizer) else "a GradientTransformation"
        raise TypeError(f"{what} is {kind}, not a state: pass its state, e.g. opt.init(params) or "
                        "the state an update returned")
    if isinstance(x, torch.optim.Optimizer):
        raise TypeError(f"{what} is a {type(x).__name__} (a torch.optim.Optimizer), not a state: "
                        "pass tuple(opt.fo_states) (its functional states), or use its "
                        "state_dict() and load_state_dict()")
    if callable(x):
        raise TypeError(f"{what} is a function ({getattr(x, '__qualname__', type(x).__name__)}), "
                        "not a state: pass what it returns, e.g. opt.init(params)")


def _state_leaves(state: OptState) -> tuple[list[str], list[Any]]:
    paths, leaves, _ = leaves_with_paths(state, is_leaf=_is_refs)
    keep = [(p, x) for p, x in zip(paths, leaves) if not _is_refs(x)]
    for p, x in keep:
        if callable(x):  # e.g. an optimizer's init inside the tree given as a state
            raise TypeError(f"state leaf {p!r} is a function "
                            f"({getattr(x, '__qualname__', type(x).__name__)}); a checkpointable "
                            "state holds tensors only: pass states (opt.init(params)), not "
                            "optimizers")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"state leaf {p!r} is a {type(x).__name__}; a checkpointable state "
                            "holds tensors only")
    return [p for p, _ in keep], [x for _, x in keep]


def ready_for_load(like: OptState) -> None:
    """Make ``like`` ready to be overwritten: wait for a delayed step in flight (its result is
    dropped); a failed state may be loaded into (that is how it recovers; its params are then
    set from the masters loaded), unless its failed step changed params it keeps no master of;
    a consumed one or one in a step may not (:class:`~functional_offload.StateError`)."""
    for s in terminal_states(like):
        n = int(s.count) if isinstance(s.count, torch.Tensor) and s.count.dim() == 0 else 0
        if n in (CONSUMED, BUSY):
            check_usable(s, "load into it")
    check_recoverable(like)  # a failed step's params: restored from the masters loaded
    for s in terminal_states(like):
        if s.params.pending is not None:
            s.params.pending.settle()


def state_dict(state: OptState) -> dict[str, torch.Tensor]:
    """Flat ``{dotted path: tensor}`` of the state (the params references excluded).

    A delayed update still in flight is finished first (:func:`~functional_offload.flush`).

    The tensors are the state's own (not copies); ``torch.save`` of the result loads with
    ``weights_only=True``.
    """
    return _landed(state, "take a state_dict")


def _landed(state: OptState, action: str) -> dict[str, torch.Tensor]:
    """:func:`state_dict` for ``action`` (named in the errors for a consumed, failed or busy
    state)."""
    check_state(state, "state")
    check_usable(state, action)
    flush(state)  # a delayed update still in flight lands first
    check_usable(state, action)
    check_states(state)  # values a loop wrote into the state that a load would refuse
    return state_tensors(state)


def state_tensors(state: OptState) -> dict[str, torch.Tensor]:
    """:func:`state_dict` without its checks and without landing work in flight (for loading
    into the state, after :func:`ready_for_load`)."""
    paths, leaves = _state_leaves(state)
    if len(set(paths)) != len(paths):
        raise ValueError("two state leaves share a dotted path; use keys without dots")
    return dict(zip(paths, leaves))


def load_state_dict(sd: dict[str, torch.Tensor], like: OptState) -> OptState:
    """Copy ``sd`` into the tensors of ``like`` (e.g. ``opt.init(params)``) and return it.

    Strict: missing or unexpected keys, or a shape or dtype that differs from ``like``'s, raise
    :class:`CheckpointError` naming the leaf; nothing is copied then. Values land on ``like``'s
    devices, bit for bit.
    """
    check_state(like, "like")
    paths, leaves = _state_leaves(like)
    missing = [p for p in paths if p not in sd]
    known = set(paths)
    unexpected = [k for k in sd if k not in known]
    if missing or unexpected:
        found = ([f"missing {_some(missing)}"] if missing else []) + (
            [f"unexpected {_some(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"checkpoint does not match the state (the state has "
                              f"{_keys(len(paths))}, the checkpoint {len(sd)}): "
                              f"{'; '.join(found)}; build `like` with the same optimizer chain "
                              "and params as the saved state")
    for p, x in zip(paths, leaves):
        y = sd[p]
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
            got = (tuple(y.shape), y.dtype) if isinstance(y, torch.Tensor) else type(y).__name__
            raise CheckpointError(f"leaf {p!r}: checkpoint has {got}, the state expects "
                                  f"{(tuple(x.shape), x.dtype)}; values are never cast on load")
    counts = {id(t) for t in mark_tensors(like)}
    for p, x in zip(paths, leaves):
        if id(x) in counts and int(sd[p]) < 0:
            raise CheckpointError(f"leaf {p!r} is {int(sd[p])} in the checkpoint; counts are >= 0 "
                                  "(the state was taken while consumed, failed or in a step)")
    ready_for_load(like)

    @torch.no_grad()
    def copy_all() -> None:
        for p, x in zip(paths, leaves):
            x.copy_(sd[p])
        restore_params(like)

    _, interrupt = shielded(copy_all)  # all of it, or an interrupt would leave it torn
    if interrupt is not None:
        raise interrupt
    return like


# safetensors dtype names (the format's spec)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _bytes(t: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, as a writable buffer sharing its memory."""
    return (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(_bytes(t.detach().contiguous().cpu()))


def _locked_temp(path: str) -> tuple[BinaryIO, str]:
    """Create and lock a new temporary file next to ``path``; ``(file, name)``.

    The lock marks the file as being written until the file is closed: the kernel releases it
    when the writer dies, however it dies, which is how a later save tells a stale file from a
    live one.
    """
    folder, base = os.path.split(path)
    while True:
        tmp = os.path.join(folder, f".{base}.tmp-{secrets.token_hex(8)}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without locks (Lustre without flock): stale files then stay
        if _names(fd, tmp):
            return os.fdopen(fd, "wb"), tmp
        os.close(fd)  # a cleaner removed it between creation and locking: take another name


def _names(fd: int, name: str) -> bool:
    """Whether ``name`` is (still) the file open as ``fd``."""
    try:
        st = os.stat(name)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


def _remove_stale_temps(path: str) -> None:
    """Remove the temporary files of saves of ``path`` that died (whose lock nobody holds)."""
    folder, base = os.path.split(path)
    for entry in os.listdir(folder):
        if not entry.startswith(f".{base}.tmp-"):
            continue
        name = os.path.join(folder, entry)
        try:
            fd = os.open(name, os.O_RDWR)  # writable: NFS locks a file only so
        except OSError:
            continue  # gone meanwhile, or not ours to remove
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _names(fd, name):
                os.unlink(name)
        except OSError:
            pass  # a live save holds the lock (or the file system has no locks): keep it
        finally:
            os.close(fd)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(f: BinaryIO, sd: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write contiguous CPU tensors to ``f`` as safetensors: the header's length (8 bytes,
    little-endian), the JSON header padded to 8 bytes, the tensors' bytes (largest elements
    first, so that every tensor is aligned)."""
    for k, v in sd.items():
        if v.dtype not in _NAMES:
            raise TypeError(f"state leaf {k!r} has dtype {v.dtype}, which a checkpoint cannot hold "
                            f"(it holds {sorted(map(str, _NAMES))})")
    order = sorted(sd, key=lambda k: (-sd[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": meta}
    at = 0
    for k in order:
        end = at + sd[k].numel() * sd[k].element_size()
        header[k] = {"dtype": _NAMES[sd[k].dtype], "shape": list(sd[k].shape),
                     "data_offsets": [at, end]}
        at = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little") + raw)
    for k in order:
        f.write(_bytes(sd[k]))


def save(state: OptState, path: Union[str, os.PathLike]) -> None:
    """Write the state to ``path`` (safetensors), atomically: temp file, fsync, rename.

    The temporary file ``.<name>.tmp-<random>`` sits next to ``path``; temporary files that
    killed saves of ``path`` left behind are removed first.

    Example::

        fo.save(state, "ckpt/opt.safetensors")
        state = fo.load("ckpt/opt.safetensors", like=opt.init(params))
    """
    live = _landed(state, "save")
    scalars = {k: v.detach().clone() for k, v in live.items() if v.dim() == 0}  # counts, as they are
    marks = claim(state, "save")  # busy while it is read: no step may begin and tear it
    try:
        sd = {k: scalars[k] if k in scalars else v.detach().cpu().contiguous() for k, v in live.items()}
        meta = {"format": _FORMAT, "crc32": json.dumps({k: _crc(v) for k, v in sd.items()})}
        path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        _remove_stale_temps(path)
        f, tmp = _locked_temp(path)
        with f:  # closing it releases the lock
            try:
                _write_safetensors(f, sd, meta)
                f.flush()
                os.fsync(f.fileno())
                os.replace(tmp, path)
                _fsync_dir(folder)
            except BaseException:
                if _names(f.fileno(), tmp):
                    os.unlink(tmp)
                raise
    finally:
        release(marks)


def _read_safetensors(f: BinaryIO, size: int) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of the safetensors file open as ``f`` (``size`` bytes); raises
    ``ValueError`` saying what is wrong with it."""
    raw = f.read(8)
    if len(raw) < 8:
        raise ValueError(f"{size} bytes, too short to hold the 8-byte header length")
    n = int.from_bytes(raw, "little")
    if n > size - 8:
        raise ValueError(f"header length {n} is more than the {size - 8} bytes after it")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ in the header is not a map of strings")
    entries = []
    for key, e in header.items():
        if not (isinstance(e, dict) and isinstance(e.get("dtype"), str)
                and isinstance(e.get("shape"), list)
                and all(is_int(d) and d >= 0 for d in e["shape"])
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(is_int(o) for o in e["data_offsets"])):
            raise ValueError(f"tensor {key!r} has an invalid header entry {str(e)[:80]}")
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {key!r} has dtype {e['dtype']!r}, which a checkpoint never "
                             "holds")
        dtype = _DTYPES[e["dtype"]]
        begin, end = e["data_offsets"]
        if end - begin != math.prod(e["shape"]) * dtype.itemsize:
            raise ValueError(f"tensor {key!r}: data_offsets {e['data_offsets']} do not span its "
                             f"shape {e['shape']} of {e['dtype']}")
        entries.append((begin, end, key, dtype, e["shape"]))
    entries.sort()
    held, at = size - 8 - n, 0
    for begin, end, key, _, _ in entries:
        if begin != at:
            raise ValueError(f"tensor {key!r} starts at byte {begin} of the data, expected {at} "
                             "(tensors overlap or leave a gap)")
        at = end
    if at != held:
        raise ValueError(f"the header describes {at} bytes of tensor data but the file holds "
                         f"{held}")
    tensors = {}
    for _, _, key, dtype, shape in entries:
        t = torch.empty(shape, dtype=dtype)
        if f.readinto(_bytes(t)) != t.numel() * dtype.itemsize:
            raise ValueError(f"tensor {key!r} ends past the end of the file (truncated)")
        tensors[key] = t
    return meta, tensors


def _check_crcs(meta: dict[str, str], sd: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless the ``crc32`` metadata holds each tensor's CRC-32."""
    if "crc32" not in meta:
        raise ValueError("its metadata has no crc32 entry")
    try:
        crcs = json.loads(meta["crc32"])
    except ValueError as e:
        raise ValueError(f"its crc32 metadata is not JSON ({e})") from None
    if not isinstance(crcs, dict) or not all(is_int(v) for v in crcs.values()):
        raise ValueError(f"its crc32 metadata is not a map of integers: {meta['crc32'][:80]!r}")
    if sd.keys() - crcs.keys():
        raise ValueError(f"its crc32 metadata lacks {_some(sorted(sd.keys() - crcs.keys()))} of "
                         f"the file's {len(sd)}")
    if crcs.keys() - sd.keys():
        raise ValueError(f"its crc32 metadata lists {_some(sorted(crcs.keys() - sd.keys()))} "
                         "that are not in the file")
    for k, v in sd.items():
        if crcs[k] != _crc(v):
            raise ValueError(f"leaf {k!r} fails its CRC-32 check")


def load(path: Union[str, os.PathLike], like: OptState) -> OptState:
    """Read a checkpoint written by :func:`save` into ``like`` (see :func:`load_state_dict`).

    Raises :class:`CheckpointError` naming the file and what is wrong for a truncated,
    corrupt or foreign file (``FileNotFoundError`` when there is none); ``like`` is then
    untouched.

    Example::

        state = fo.load("ckpt/opt.safetensors", like=opt.init(params))
    """
    check_state(like, "like")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a file fo.save wrote; a "
                              "torch.distributed.checkpoint directory loads with "
                              "dcp.load into fo.dcp.state_dict(like, loading=True)")
    corrupt = "the file is truncated or corrupt (or not one fo.save wrote); load another copy"
    with open(path, "rb") as f:  # one open file: a save renaming over the path cannot mix files
        try:
            meta, sd = _read_safetensors(f, os.fstat(f.fileno()).st_size)
        except ValueError as e:
            f.seek(0)
            kind = _foreign(f.read(8))
            if kind is not None:
                raise CheckpointError(f"{path}: not a functional_offload checkpoint (fo.load "
                                      "reads the safetensors files fo.save writes): it is "
                                      f"{kind}") from None
            raise CheckpointError(f"{path}: {e}; {corrupt}") from None
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"{path}: not a functional_offload checkpoint (its metadata has "
                              f"format {meta.get('format')!r}, expected {_FORMAT!r}: a safetensors "
                              "file another program wrote, e.g. a model's weights); write "
                              "checkpoints with functional_offload.save")
    try:
        _check_crcs(meta, sd)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; {corrupt}") from None
    try:
        return load_state_dict(sd, like)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


_TORCH_SAVE = ("a dict saved by torch.save of fo.state_dict(state) loads with "
               "fo.load_state_dict(torch.load(path, weights_only=True), like)")


def _foreign(head: bytes) -> Optional[str]:
    """What a file that is not safetensors looks like, from its first bytes (``None``: nothing
    known, e.g. a damaged checkpoint)."""
    if head.startswith(b"PK\x03\x04"):
        return f"a zip archive, as torch.save writes (a pickle inside a zip); {_TORCH_SAVE}"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return f"a pickle (torch.save's legacy format, or pickle.dump); {_TORCH_SAVE}"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file"
    if head.startswith(b"\x1f\x8b"):
        return "gzip-compressed (decompress it first)"
    return None
