"""Exact, pickle-free optimizer-state checkpoints, restored into a ``like`` state.

The state tree is flattened to dotted-path keys (``"1.mu.layer.weight"``, ``"1.count"``); the
:class:`~functional_offload.base.ParamRefs` node (the model's own params) is left out. Files are
safetensors with a CRC-32 per tensor in the header, written to a temporary file and renamed, so
a crash mid-save leaves the previous checkpoint readable. Restoring is strict and exact: every
key, shape and dtype must match ``like`` — a fp32 master is never silently cast — and the values
are copied into ``like``'s tensors, so they keep ``like``'s placement (re-placement on load).
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
import zlib
from typing import Any, Union

import safetensors
import safetensors.torch
import torch

from functional_offload.base import BUSY, CONSUMED, ParamRefs, check_usable, flush, terminal_states
from functional_offload.tree import leaves_with_paths
from functional_offload.typing import OptState

__all__ = ["state_dict", "load_state_dict", "save", "load", "CheckpointError"]

_FORMAT = "functional_offload/1"
_is_refs = lambda x: isinstance(x, ParamRefs)  # noqa: E731


class CheckpointError(ValueError):
    """A checkpoint does not match the state it is loaded into, or is truncated or corrupt."""


def _state_leaves(state: OptState) -> tuple[list[str], list[Any]]:
    paths, leaves, _ = leaves_with_paths(state, is_leaf=_is_refs)
    keep = [(p, x) for p, x in zip(paths, leaves) if not _is_refs(x)]
    for p, x in keep:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"state leaf {p!r} is a {type(x).__name__}; a checkpointable state "
                            "holds tensors only")
    return [p for p, _ in keep], [x for _, x in keep]


def _settle(like: OptState) -> None:
    """Make ``like`` ready to be overwritten: wait for a delayed step in flight (its result is
    dropped); a failed state may be loaded into (that is how it recovers), a consumed one or
    one in a step may not."""
    for s in terminal_states(like):
        n = int(s.count) if isinstance(s.count, torch.Tensor) and s.count.dim() == 0 else 0
        if n in (CONSUMED, BUSY):
            check_usable(s, "load into it")
        if s.params.pending is not None:
            s.params.pending.settle()


def state_dict(state: OptState) -> dict[str, torch.Tensor]:
    """Flat ``{dotted path: tensor}`` of the state (the params references excluded).

    A delayed update still in flight is finished first (:func:`~functional_offload.flush`).

    The tensors are the state's own (not copies); ``torch.save`` of the result loads with
    ``weights_only=True``.
    """
    check_usable(state, "take a state_dict")
    flush(state)  # a delayed update still in flight lands first
    check_usable(state, "take a state_dict")
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
    paths, leaves = _state_leaves(like)
    missing = [p for p in paths if p not in sd]
    unexpected = [k for k in sd if k not in set(paths)]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not match the state: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}; build `like` with the same "
                              "optimizer chain and params as the saved state")
    for p, x in zip(paths, leaves):
        y = sd[p]
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
            got = (tuple(y.shape), y.dtype) if isinstance(y, torch.Tensor) else type(y).__name__
            raise CheckpointError(f"leaf {p!r}: checkpoint has {got}, the state expects "
                                  f"{(tuple(x.shape), x.dtype)}; values are never cast on load")
    _settle(like)
    with torch.no_grad():
        for p, x in zip(paths, leaves):
            x.copy_(sd[p])
    return like


def _crc(t: torch.Tensor) -> int:
    t = t.detach().contiguous().cpu()
    n = t.numel() * t.element_size()
    return zlib.crc32((ctypes.c_ubyte * n).from_address(t.data_ptr())) if n else 0


def save(state: OptState, path: Union[str, os.PathLike]) -> None:
    """Write the state to ``path`` (safetensors), atomically: temp file, fsync, rename.

    Example::

        fo.save(state, "ckpt/opt.safetensors")
        state = fo.load("ckpt/opt.safetensors", like=opt.init(params))
    """
    sd = {k: v.detach().cpu().contiguous() for k, v in state_dict(state).items()}
    meta = {"format": _FORMAT, "crc32": json.dumps({k: _crc(v) for k, v in sd.items()})}
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        safetensors.torch.save_file(sd, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: Union[str, os.PathLike], like: OptState) -> OptState:
    """Read a checkpoint written by :func:`save` into ``like`` (see :func:`load_state_dict`).

    Raises :class:`CheckpointError` for a truncated, corrupt or foreign file.
    """
    path = os.fspath(path)
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt?): {e}") from e
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"{path}: not a functional_offload checkpoint "
                              f"(format {meta.get('format')!r})")
    crcs = json.loads(meta["crc32"])
    for k, v in sd.items():
        if crcs.get(k) != _crc(v):
            raise CheckpointError(f"{path}: leaf {k!r} fails its CRC-32 check; the file is corrupt")
    return load_state_dict(sd, like)
