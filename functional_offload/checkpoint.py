"""Exact, pickle-free optimizer-state checkpoints, restored into a ``like`` state.

The state tree is flattened to dotted-path keys (``"1.mu.layer.weight"``, ``"1.count"``); the
:class:`~functional_offload.base.ParamRefs` node (the model's own params) is left out. Files are
safetensors with a CRC-32 per tensor, written atomically and read whole
(:mod:`functional_offload.checkpoint_file`). Restoring is strict and exact: every key, shape and
dtype must match ``like`` — a fp32 master is never silently cast — and the values are copied
into ``like``'s tensors, so they keep ``like``'s placement (re-placement on load). A split
master (``store_param_remainders``) is saved as its fp32 value, so either format of the master
loads into the other, exactly. A remainder-only split master (host state of a bf16 param on a
GPU, whose high half is the param itself) is saved joined with its param's bits, and loading it
writes the param's bits too: load the model's params before the optimizer's state, or from the
same step (they are then the same bits).

Any mode loads into any other of the same optimizer (plain, streamed, delayed, any placement).
The one difference between their states is the master of an fp32 (or fp64) param, which some
keep (delayed host leaves, host state of a GPU param, strided params) and others do not: such a
master equals its param after every landed step, so where ``like`` keeps none a checkpoint's
is written to the param (the same values; not the same where the param was of a narrower dtype
when the checkpoint was saved, then the master is the exact value), and where ``like`` keeps one
the checkpoint lacks, it is set from the param at the state's next use (a step, a flush, a
save: the model's checkpoint may be loaded after the optimizer's).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional, Union

import torch

from functional_offload.base import GradientTransformation, Optimizer, ParamRefs
from functional_offload.state import (FAILED, check_loadable, check_recoverable, check_states,
                                      check_usable, claim, flush, mark_tensors, release,
                                      restore_params, terminal_states)
from functional_offload.checkpoint_file import CheckpointError, key_count, read, some_keys, write
from functional_offload.executor.shield import shielded
from functional_offload.kernels.blockwise import is_blockwise
from functional_offload.kernels.remainder import holds_high_half, is_lean, is_split, join, split_
from functional_offload.quantized import write_params
from functional_offload.tree import check_unique_paths, flatten_like, leaves_with_paths, local
from functional_offload.typing import OptState

__all__ = ["state_dict", "load_state_dict", "save", "load", "CheckpointError"]

_is_refs = lambda x: isinstance(x, ParamRefs)  # noqa: E731
_is_terminal = lambda x: isinstance(getattr(x, "params", None), ParamRefs)  # noqa: E731


class _Mirror(NamedTuple):
    """The master of an fp32 (or fp64) param, kept by ``like`` or not (``master`` is None)."""

    state: Any  # the terminal state
    index: int  # the leaf's index in its params tree
    param: torch.Tensor
    master: Optional[torch.Tensor]


def _key(*parts: str) -> str:
    return ".".join(p for p in parts if p != "<root>")


def _mirrors(like: OptState) -> dict[str, _Mirror]:
    """By key, the masters of ``like``'s full-precision params, kept or not: those that one
    mode keeps and another does not."""
    out = {}
    prefixes, nodes, _ = leaves_with_paths(like, is_leaf=_is_terminal)
    for prefix, s in zip(prefixes, nodes):
        if not _is_terminal(s) or "master" not in s._fields:
            continue
        names, params, _ = leaves_with_paths(s.params.tree)
        masters = flatten_like(s.master, s.params.tree, "state.master")
        for i, (name, p, m) in enumerate(zip(names, params, masters)):
            if local(p).dtype in (torch.float32, torch.float64):
                out[_key(prefix, "master", name)] = _Mirror(s, i, local(p), m)
    return out


def _param_shapes(state: OptState) -> dict[str, tuple[tuple[int, ...], bool]]:
    """By key (``<prefix>.param_shape.<leaf>``), each param's shape and whether its state keeps
    block-wise 8-bit moments: flat bytes of whole blocks, which carry neither the param's shape
    nor its exact element count, so a checkpoint holds the shapes of those params beside."""
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    prefixes, nodes, _ = leaves_with_paths(state, is_leaf=_is_terminal)
    for prefix, s in zip(prefixes, nodes):
        if not _is_terminal(s):
            continue
        names, params, _ = leaves_with_paths(s.params.tree)
        for field in s._fields:
            tree = getattr(s, field)
            if field in ("count", "master", "ema", "params") or (isinstance(tree, tuple)
                                                                 and not tree):
                continue
            try:
                xs = flatten_like(tree, s.params.tree, f"state.{field}")
            except (ValueError, TypeError):  # not one tensor per param: no moment of a param
                continue
            for name, p, x in zip(names, params, xs):
                key = _key(prefix, "param_shape", name)
                eight = isinstance(x, torch.Tensor) and is_blockwise(x)
                out[key] = (tuple(local(p).shape), eight or out.get(key, ((), False))[1])
    return out


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
    check_loadable(like)
    check_recoverable(like)  # a failed step's params: restored from the masters loaded
    for s in terminal_states(like):
        if s.params.pending is not None:
            s.params.pending.settle()


def state_dict(state: OptState) -> dict[str, torch.Tensor]:
    """Flat ``{dotted path: tensor}`` of the state (the params references excluded).

    A delayed update still in flight is finished first (:func:`~functional_offload.flush`).

    The tensors are the state's own (not copies), but for split masters
    (``store_param_remainders``), given as their fp32 values, and, for params whose moments
    are block-wise 8-bit, their shapes (``param_shape.<leaf>``, int64: a load refuses a param
    of another shape); ``torch.save`` of the result loads with ``weights_only=True``.
    """
    return _landed(state, "take a state_dict")


def ready_for_save(state: OptState, action: str) -> None:
    """Make ``state`` ready to be saved for ``action`` (named in the errors): a delayed update
    still in flight lands first; a consumed, failed or busy state is refused, as are values a
    loop wrote into it that a load would refuse."""
    check_state(state, "state")
    check_usable(state, action)
    flush(state)  # a delayed update still in flight lands first
    check_usable(state, action)
    check_states(state)


def _landed(state: OptState, action: str) -> dict[str, torch.Tensor]:
    """:func:`state_dict` for ``action`` (named in the errors for a consumed, failed or busy
    state)."""
    ready_for_save(state, action)
    shapes = {k: torch.tensor(shape, dtype=torch.int64)
              for k, (shape, eight) in _param_shapes(state).items() if eight}
    return {**state_tensors(state), **shapes}


def state_tensors(state: OptState, joined: bool = True) -> dict[str, torch.Tensor]:
    """:func:`state_dict` without its checks and without landing work in flight; ``joined``
    False: split masters as they are held (``int16`` halves), not as their fp32 values."""
    paths, leaves = _state_leaves(state)
    check_unique_paths(paths, "state", "a checkpoint names each state tensor by its path")
    if not joined:
        return dict(zip(paths, leaves))
    highs = _high_params(state)
    return {p: join(x, highs.get(id(x))) if is_split(x) else x for p, x in zip(paths, leaves)}


def check_split_params(state: OptState) -> None:
    """:class:`CheckpointError` naming the leaf where a remainder-only split master's param
    can no longer be its high half (its dtype, size or layout changed)."""
    _high_params(state)


def _high_params(state: OptState) -> dict[int, torch.Tensor]:
    """By ``id`` of each remainder-only split master in ``state``, its param (the high half);
    :class:`CheckpointError` naming the leaf where the param cannot be it any more."""
    out = {}
    for s in terminal_states(state):
        if "master" not in s._fields:
            continue
        names, params, _ = leaves_with_paths(s.params.tree)
        for name, p, m in zip(names, params, flatten_like(s.master, s.params.tree, "state.master")):
            if m is None or not is_lean(m):
                continue
            p = local(p)
            if not holds_high_half(m, p):
                raise CheckpointError(
                    f"leaf {name!r}: its split master keeps the remainder alone, its contiguous "
                    f"bf16 param of {m[0].numel()} elements being the high half, but the param "
                    f"is now {p.dtype} of shape {tuple(p.shape)}"
                    f"{'' if p.is_contiguous() else ', not contiguous'}; put the param back as "
                    "it was")
            out[id(m)] = p
    return out


def load_state_dict(sd: dict[str, torch.Tensor], like: OptState) -> OptState:
    """Copy ``sd`` into the tensors of ``like`` (e.g. ``opt.init(params)``) and return it.

    Strict: missing or unexpected keys, or a shape or dtype that differs from ``like``'s, raise
    :class:`CheckpointError` naming the leaf; nothing is copied then. Values land on ``like``'s
    devices, bit for bit. A state of any mode of the same optimizer loads (see the module: the
    masters of fp32 params).
    """
    check_state(like, "like")
    paths, leaves = _state_leaves(like)
    highs = _high_params(like)
    known = set(paths)
    mirrors = _mirrors(like)
    shaped = _param_shapes(like)  # a checkpoint of 8-bit moments holds their params' shapes
    shapes = {k: shape for k, (shape, eight) in shaped.items() if eight}  # (absent from older
    #  checkpoints); those of params of other moment formats are refused below, by the moments
    missing = [p for p in paths if p not in sd and p not in mirrors]
    unexpected = [k for k in sd if k not in known and k not in mirrors and k not in shaped]
    adopt = {p: mirrors[p] for p in paths if p not in sd and p in mirrors}
    dropped = {k: mirrors[k] for k in sd if k not in known and k in mirrors}
    if missing or unexpected:
        found = ([f"missing {some_keys(missing)}"] if missing else []) + (
            [f"unexpected {some_keys(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"checkpoint does not match the state (the state has "
                              f"{key_count(len(paths))}, the checkpoint {len(sd)}): "
                              f"{'; '.join(found)}; build `like` with the same optimizer chain "
                              "and params as the saved state")
    loaded = [(p, x) for p, x in zip(paths, leaves) if p not in adopt]
    expect = {p: (x.shape[1:], torch.float32) if is_split(x) else (x.shape, x.dtype)
              for p, x in loaded}
    expect.update({k: (m.param.shape, m.param.dtype) for k, m in dropped.items()})  # as kept
    for p, (shape, dtype) in expect.items():
        y = sd[p]
        if not isinstance(y, torch.Tensor) or y.shape != shape or y.dtype != dtype:
            got = (tuple(y.shape), y.dtype) if isinstance(y, torch.Tensor) else type(y).__name__
            raise CheckpointError(f"leaf {p!r}: checkpoint has {got}, the state expects "
                                  f"{(tuple(shape), dtype)}; values are never cast on load")
        if y.is_meta or y.layout != torch.strided:
            what = "a meta tensor" if y.is_meta else f"a {y.layout} tensor"
            raise CheckpointError(f"leaf {p!r}: checkpoint has {what}, which holds no dense "
                                  "values to load (was it loaded with map_location='meta'?)")
    for k, shape in shapes.items():
        y = sd.get(k)
        if y is None:
            continue
        if not (isinstance(y, torch.Tensor) and y.dtype == torch.int64 and y.dim() == 1
                and not y.is_meta):
            raise CheckpointError(f"leaf {k!r}: checkpoint has {type(y).__name__} "
                                  f"{getattr(y, 'dtype', '')}, expected an int64 shape")
        if tuple(y.tolist()) != shape:
            raise CheckpointError(f"leaf {k!r}: the checkpoint's 8-bit moments were saved for a "
                                  f"param of shape {tuple(y.tolist())}, this state's is {shape}; "
                                  "build `like` from the params the state was saved with")
    failed = [k for k, m in adopt.items() if int(m.state.count) == FAILED]
    if failed:
        raise CheckpointError(
            f"cannot load into this failed state: the checkpoint holds no master for "
            f"{some_keys(failed)} (saved in a mode that "
            "keeps none), and the failed step may have left those params half stepped; restore "
            "the params from your model checkpoint, then load into a fresh state: "
            "state = fo.load(path, like=opt.init(params))")
    counts = {id(t) for t in mark_tensors(like)}
    for p, x in loaded:
        if id(x) in counts and int(sd[p]) < 0:
            raise CheckpointError(f"leaf {p!r} is {int(sd[p])} in the checkpoint; counts are >= 0 "
                                  "(the state was taken while consumed, failed or in a step)")
    ready_for_load(like)

    @torch.no_grad()
    def copy_all() -> None:
        for p, x in loaded:
            if is_split(x):
                split_(x, sd[p], highs.get(id(x)))  # (a remainder-only one's param: its high half)
            else:
                x.copy_(sd[p])
        restore_params(like)
        if dropped:
            write_params([m.param for m in dropped.values()], [sd[k] for k in dropped])
        for s in terminal_states(like):
            if s.params.cache is not None:
                s.params.cache.adopt_masters = [m.index for m in adopt.values() if m.state is s]
        for m in adopt.values():
            if m.state.params.cache is None:  # nowhere to note it: the param now
                m.master.copy_(m.param)

    try:
        _, interrupt = shielded(copy_all)  # all of it, or an interrupt would leave it torn
    except BaseException:
        for t in mark_tensors(like):  # part of it was copied: nothing may use it
            t.fill_(FAILED)
        raise
    if interrupt is not None:
        raise interrupt
    return like


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
        write(path, {k: scalars[k] if k in scalars else v.detach().cpu().contiguous()
                     for k, v in live.items()})
    finally:
        release(marks)


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
    sd = read(path)
    try:
        return load_state_dict(sd, like)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
