"""A checkpoint file: safetensors with a CRC-32 per tensor in the header.

:func:`write` writes a temporary file next to the target, fsyncs it, renames it over the target
and fsyncs the directory, so a crash mid-save leaves the previous checkpoint readable; the
temporary file of a killed save is removed by the next save of that path. :func:`read` reads
through one open file, so a save renaming a new file over the path meanwhile yields the old or
the new checkpoint, whole; a truncated, corrupt or foreign file raises :class:`CheckpointError`
saying what is wrong. What goes into a file is :mod:`functional_offload.checkpoint`'s business.
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

from functional_offload.checks import is_int

__all__ = ["CheckpointError", "read", "write", "some_keys", "key_count"]

_FORMAT = "functional_offload/1"  # the format entry of a checkpoint file's metadata


class CheckpointError(ValueError):
    """A checkpoint does not match the state it is loaded into, or is truncated or corrupt."""


def some_keys(keys: list[str], n: int = 8) -> str:
    """``keys`` for a message: how many, and the first ``n`` of them."""
    return (f"{key_count(len(keys))} {keys}" if len(keys) <= n
            else f"{key_count(len(keys))}, the first {n} {keys[:n]}")


def key_count(n: int) -> str:
    """``"1 key"``, ``"2 keys"``."""
    return f"{n} key{'' if n == 1 else 's'}"


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


def write(path: Union[str, os.PathLike], tensors: dict[str, torch.Tensor]) -> None:
    """Write contiguous CPU ``tensors`` to ``path`` as a checkpoint file, atomically: a locked
    temporary file ``.<name>.tmp-<random>`` next to ``path``, fsync, rename, fsync of the
    folder. Temporary files that killed writes of ``path`` left behind are removed first."""
    meta = {"format": _FORMAT, "crc32": json.dumps({k: _crc(v) for k, v in tensors.items()})}
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    _remove_stale_temps(path)
    f, tmp = _locked_temp(path)
    with f:  # closing it releases the lock
        try:
            _write_safetensors(f, tensors, meta)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(folder)
        except BaseException:
            if _names(f.fileno(), tmp):
                os.unlink(tmp)
            raise


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
        raise ValueError(f"its crc32 metadata lacks {some_keys(sorted(sd.keys() - crcs.keys()))} "
                         f"of the file's {len(sd)}")
    if crcs.keys() - sd.keys():
        raise ValueError(f"its crc32 metadata lists {some_keys(sorted(crcs.keys() - sd.keys()))} "
                         "that are not in the file")
    for k, v in sd.items():
        if crcs[k] != _crc(v):
            raise ValueError(f"leaf {k!r} fails its CRC-32 check")


def read(path: str) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint file at ``path``, checked: its format and every CRC-32.

    Raises :class:`CheckpointError` naming the file and what is wrong for a truncated, corrupt
    or foreign file (``FileNotFoundError`` when there is none).
    """
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
    return sd


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
