"""Sharded optimizer-state checkpoints with ``torch.distributed.checkpoint`` (DCP).

Under FSDP2 a param is a DTensor and each rank keeps the optimizer state of its own shard.
:func:`state_dict` shows that state to DCP as DTensors with the params' meshes and placements,
wrapping the state's own tensors; DCP then saves each rank's shards once and loads them at any
world size straight into the state's tensors, wherever they live (host memory included).
:class:`StrictLoadPlanner` makes ``dcp.load`` as strict as :func:`functional_offload.load`.

Which leaves are shards: every tree in the state that mirrors the params — the fields of a
terminal state (moments, masters, EMA), ``MultiSteps``' sums, the state of a gradient
transformation in a chain, under ``masked``, ``partition``, ``inject_hyperparams`` or
``apply_if_finite`` alike — has one tensor per param shaped like the param's local shard. A
state field whose leaves reduce some dims of their params to size 1 over the whole param
(Adafactor's row and column factors) names those dims in its state type's class attribute
``reduced_dims`` (``{"row_var": (-1,), "col_var": (-2,)}``); such a leaf is sharded like its
param along the other dims and replicated along the reduced ones. A split master's halves,
``(rows, *param.shape)``, are sharded like the param one dim further in. Every other leaf
(step counts, hyperparameters) is saved once, from one rank, so it must be the same on every
rank.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import DTensor, Replicate, Shard
# What FSDP2 builds its sharded params from: DTensor.from_local would move a local tensor on
# the host to the mesh's device, and the state must stay where the placement put it.
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from functional_offload import checkpoint
from functional_offload.base import ParamRefs
from functional_offload.state import terminal_states
from functional_offload.checkpoint import CheckpointError
from functional_offload.kernels.blockwise import is_blockwise
from functional_offload.kernels.remainder import is_split
from functional_offload.tree import flatten_like, leaves_with_paths, local
from functional_offload.typing import OptState

try:  # FSDP2 over tensor-parallel params shards them with a split factor
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch without it has no such placements
    _StridedShard = None

__all__ = ["state_dict", "StrictLoadPlanner"]


def _is_terminal(x: Any) -> bool:
    """A terminal optimizer's state: a NamedTuple holding its params (``AdamState``, ...)."""
    return isinstance(getattr(x, "params", None), ParamRefs)


def _reduced(kind: type, field: str, ndim: int) -> frozenset[int]:
    """The dims of an ``ndim``-dim param that the leaves of field ``field`` of a ``kind`` state
    reduce to size 1 (declared by the state type's ``reduced_dims``; none by default)."""
    dims = getattr(kind, "reduced_dims", {}).get(field, ())
    return frozenset(d % ndim for d in dims if -ndim <= d < ndim)


def _reduce(shape: torch.Size, reduced: frozenset[int]) -> tuple[int, ...]:
    return tuple(1 if d in reduced else n for d, n in enumerate(shape))


def _fits(x: Any, p: Any, reduced: frozenset[int]) -> bool:
    """Whether ``x`` is a floating tensor shaped like ``p``'s local shard (``reduced`` dims: 1)."""
    return (isinstance(x, torch.Tensor) and x.dtype.is_floating_point
            and tuple(x.shape) == _reduce(local(p).shape, reduced))


def _as_dtensor(x: Any, p: Any, path: str, reduced: frozenset[int]) -> Any:
    """State leaf ``x`` of param ``p`` as a DTensor laid out like ``p`` whose local tensor is
    ``x`` itself; ``x`` as is where ``p`` is a plain tensor, ``x`` is None (no master) or
    already a DTensor. A dim that ``x`` reduces (``reduced``) has size 1 and, where ``p`` is
    sharded along it, is replicated: the reduction spans every shard."""
    if x is None or not isinstance(p, DTensor) or isinstance(x, DTensor):
        return x
    want = _reduce(local(p).shape, reduced)
    if tuple(x.shape) != want:
        raise ValueError(f"state leaf {path!r} has shape {tuple(x.shape)} but mirrors a param "
                         f"whose local shard has {tuple(local(p).shape)}, so it should have "
                         f"{want}: pass the state that opt.init made for these DTensor params "
                         "(an optimizer whose state reduces dims of its params names them in "
                         "its state type's reduced_dims)")
    shape = torch.Size(_reduce(p.shape, reduced))
    placements = tuple(Replicate() if pl.is_shard() and pl.dim % p.dim() in reduced else pl
                       for pl in p.placements)
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    spec = DTensorSpec(p.device_mesh, placements, tensor_meta=TensorMeta(shape, stride, x.dtype))
    return DTensor(x, spec, requires_grad=False)


def _split_as_dtensor(x: torch.Tensor, p: Any, path: str) -> Any:
    """Split master ``x`` (``int16``, ``(rows, *local shard)``: the high half and the remainder,
    or the remainder alone) of param ``p`` as a DTensor of shape ``(rows, *p.shape)`` laid out
    like ``p`` one dim further in, whose local tensor is ``x``; ``x`` itself for a plain
    param."""
    if not isinstance(p, DTensor):
        return x
    if tuple(x.shape[1:]) != tuple(local(p).shape):
        raise ValueError(f"split master {path!r} has shape {tuple(x.shape)}, but its param's "
                         f"local shard has {tuple(local(p).shape)}: pass the state that opt.init "
                         "made for these DTensor params")
    shape = torch.Size((x.shape[0], *p.shape))
    placements = tuple(_one_dim_in(pl, p.dim(), path) for pl in p.placements)
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    spec = DTensorSpec(p.device_mesh, placements, tensor_meta=TensorMeta(shape, stride, x.dtype))
    return DTensor(x, spec, requires_grad=False)


def _one_dim_in(pl: Any, ndim: int, path: str) -> Any:
    """Placement ``pl`` of an ``ndim``-dim param for a tensor with one more dim in front: a
    shard (strided ones, as FSDP2 over tensor parallelism makes them, keep their split factor)
    one dim further in, a replica as is; ``ValueError`` naming the leaf for others."""
    if _StridedShard is not None and isinstance(pl, _StridedShard):  # (a Shard in torch < 2.9)
        return _StridedShard(pl.dim % ndim + 1, split_factor=pl.split_factor)
    if pl.is_shard():
        return Shard(pl.dim % ndim + 1)
    if pl.is_replicate():
        return pl
    raise ValueError(f"split master {path!r}: its param's placement {pl} has no layout for the "
                     "halves; checkpoint it with fo.save per rank")


def _terminal(node: Any, prefix: str) -> Any:
    """A terminal state with the fields that mirror its params as DTensors."""
    params = node.params.tree
    ppaths, ps, spec = leaves_with_paths(params)
    fields = {}
    for f in node._fields:
        if f in ("count", "params"):
            continue
        try:
            xs = flatten_like(getattr(node, f), params, f"state field {f!r}")
        except ValueError:
            if optree.tree_leaves(getattr(node, f)):
                raise TypeError(f"state field {prefix + f!r} holds tensors but does not mirror the "
                                "params tree, so no shard of a param can be named for them; "
                                "functional_offload.dcp saves states whose fields mirror the "
                                "params (mu, nu, master, momentum) and a step count") from None
            continue  # e.g. SGD's momentum=() without momentum
        fields[f] = spec.unflatten([
            _split_as_dtensor(x, p, f"{prefix}{f}.{q}")
            if f == "master" and isinstance(x, torch.Tensor) and is_split(x)
            else _as_dtensor(x, p, f"{prefix}{f}.{q}", _reduced(type(node), f, p.dim()))
            for x, p, q in zip(xs, ps, ppaths)])
    return node._replace(**fields)


def _mirrored(tree: Any, params: Any, kind: type, field: str, path: str) -> Any:
    """``tree`` with its leaves as DTensors laid out like their params, if it mirrors the
    DTensor params ``params``: a tree of their structure (None where a param has no state, as
    under ``masked``) or a dict of some of them keyed by their dotted paths (as ``partition``'s
    parts see them), each leaf a floating tensor shaped like its param's local shard. Else None."""
    ppaths, ps, spec = leaves_with_paths(params)
    try:
        xs = flatten_like(tree, params, "state")
        keys, rebuild = ppaths, spec.unflatten
    except ValueError:
        by_path = dict(zip(ppaths, ps))
        if type(tree) is not dict or not tree or not all(k in by_path for k in tree):
            return None
        keys, xs = list(tree), list(tree.values())
        ps = [by_path[k] for k in keys]
        rebuild = lambda leaves: dict(zip(keys, leaves))  # noqa: E731
    reduced = [_reduced(kind, field, p.dim()) for p in ps]
    if not any(isinstance(p, DTensor) and x is not None for x, p in zip(xs, ps)) or not all(
            x is None or _fits(x, p, r) for x, p, r in zip(xs, ps, reduced)):
        return None
    return rebuild([_as_dtensor(x, p, f"{path}.{k}", r)
                    for x, p, k, r in zip(xs, ps, keys, reduced)])


def _exported(node: Any, params: Any, prefix: str) -> Any:
    """``node`` of a state (at path ``prefix``) as DCP sees it: every tree in it that mirrors
    DTensor params as DTensors sharded like them, whichever transformation made it (a terminal
    state's moments, masters and EMA; MultiSteps' sums; the state of a gradient transformation
    in a chain). The params a tree may mirror are those of the first terminal state inside
    ``node`` or else ``params``, those of the state around it."""
    if node is None or isinstance(node, (torch.Tensor, ParamRefs)):
        return node
    if _is_terminal(node):
        return _terminal(node, prefix)
    inner = terminal_states(node)
    if inner:
        params = inner[0].params.tree
    try:
        children, meta, entries, unflatten = optree.tree_flatten_one_level(node)
    except ValueError:  # a leaf that is no tensor: the checkpoint refuses it
        return node
    names = node._fields if isinstance(node, tuple) and hasattr(node, "_fields") else entries
    out = []
    for name, child in zip(names, children):
        path = f"{prefix}{name}"
        mirror = None if params is None else _mirrored(child, params, type(node), str(name), path)
        out.append(_exported(child, params, path + ".") if mirror is None else mirror)
    return unflatten(meta, out)


def _saved_once(x: torch.Tensor) -> bool:
    """DCP saves a plain tensor, or a DTensor replicated over its whole mesh, from one rank."""
    return not isinstance(x, DTensor) or all(pl.is_replicate() for pl in x.placements)


def _fingerprint(x: torch.Tensor) -> tuple[Any, Any]:
    """``(what must agree across ranks, what an error shows)`` for a leaf saved once."""
    t = local(x).detach().to("cpu").contiguous().reshape(-1)
    crc = zlib.crc32(t.view(torch.uint8).numpy())
    shown = t.item() if t.numel() == 1 and x.dim() == 0 else f"{tuple(t.shape)} crc32 {crc:08x}"
    return (tuple(local(x).shape), str(x.dtype), crc), shown


def _check_ranks_agree(sd: dict[str, torch.Tensor]) -> None:
    """Raise unless every rank holds the same leaves where DCP saves one rank's copy (step
    counts, hyperparameters, and any state leaf not laid out like a DTensor param): a leaf
    holding this rank's shard of something there would silently lose the other ranks' parts."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = {k: _fingerprint(v) for k, v in sd.items() if _saved_once(v)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for k in mine:
        seen = {r: theirs[k] for r, theirs in enumerate(everyone) if k in theirs}
        if len({key for key, _ in seen.values()}) > 1:
            shown = {r: s for r, (_, s) in seen.items()}
            raise CheckpointError(f"leaf {k!r} differs across ranks (rank: value {shown}), and "
                                  "DCP saves it from one rank; every rank must apply the same "
                                  "updates before a checkpoint, and a state leaf holding a "
                                  "rank's shard of a param must mirror the params tree (shaped "
                                  "like its param's local shard) to be saved as a DTensor")


def state_dict(state: OptState, loading: bool = False) -> dict[str, torch.Tensor]:
    """The state for ``torch.distributed.checkpoint``: ``{dotted path: tensor}``, sharing the
    state's tensors.

    The keys are those of :func:`functional_offload.state_dict` (``"1.mu.layer.weight"``,
    ``"1.count"``). A leaf mirroring a DTensor param (a moment, master or EMA, ``MultiSteps``'
    sum, whichever transformation holds it; params without a master have no key) is a DTensor
    with the param's global shape (its ``reduced_dims`` of size 1), mesh and placements whose
    local tensor *is* the state's tensor, on the host or the device; the others (step counts,
    and the state of plain-tensor params) are the state's tensors. ``dcp.save`` writes each
    shard once; ``dcp.load`` into ``state_dict(like)`` copies the checkpoint into ``like``'s
    tensors in place, from a checkpoint saved at any world size, through host memory only.

    A split master (``store_param_remainders``) is its ``int16`` halves as held,
    ``(2, *param.shape)`` (the high half and the remainder) or ``(1, *param.shape)`` (the
    remainder of a GPU param, whose high half is the param itself: load the model's params
    from the same checkpoint, in the same ``dcp.load``), laid out like the param one dim
    further in: exact at any world size, and it loads only into split masters of the same
    rows (``fo.save``/``fo.load`` convert between the formats). Block-wise 8-bit moments are
    refused (``ValueError`` naming the leaf): each rank's bytes quantize its own shard.

    For ``dcp.save``, a delayed update in flight is finished first, and a consumed, failed or
    busy state is refused. With ``loading=True`` (for ``dcp.load``), a delayed update in flight
    is waited for and dropped, and a failed state is accepted: loading is how it recovers.
    Collective when a process group is up: call it on every rank, as ``dcp.save``. The leaves
    DCP saves from one rank (plain tensors: step counts, flags; replicated DTensors) must agree
    across ranks when saving, else :class:`~functional_offload.CheckpointError` (a leaf holding a
    rank's own part of something that does not mirror the params would otherwise be lost).

    Example (one process here; under FSDP2 every rank makes the same calls, and the model's
    ``get_model_state_dict`` can go in the same ``dcp.save``)::

        import tempfile, torch, torch.distributed.checkpoint as dcp
        import functional_offload as fo, functional_offload.dcp

        opt = fo.adamw(1e-2)
        _, state = opt.update({"w": torch.ones(2)}, opt.init({"w": torch.zeros(2)}))
        path = tempfile.mkdtemp()
        dcp.save({"optim": fo.dcp.state_dict(state)}, checkpoint_id=path)
        like = opt.init({"w": torch.zeros(2)})
        dcp.load({"optim": fo.dcp.state_dict(like, loading=True)}, checkpoint_id=path,
                 planner=fo.dcp.StrictLoadPlanner())
        assert int(like.count) == 1  # loaded in place
    """
    _refuse_formats(state)
    if loading:
        checkpoint.ready_for_load(state)
    else:
        checkpoint.ready_for_save(state, "take a state_dict")  # lands a delayed update
    checkpoint.check_split_params(state)  # a remainder-only master's param is its high half
    sd = checkpoint.state_tensors(_exported(state, None, ""), joined=False)
    if not loading:
        _check_ranks_agree(sd)
    return sd


def _refuse_formats(state: OptState) -> None:
    """Raise ``ValueError`` for block-wise 8-bit moments, whose tensors do not mirror their
    params' shards (each rank's bytes quantize its own shard in blocks of its own)."""
    for s in terminal_states(state):
        for field in s._fields:
            if field in ("count", "params", "master"):
                continue
            paths, xs, _ = leaves_with_paths(getattr(s, field))
            bad = [p for p, x in zip(paths, xs) if isinstance(x, torch.Tensor) and is_blockwise(x)]
            if bad:
                raise ValueError(f"functional_offload.dcp does not checkpoint block-wise 8-bit "
                                 f"moments (torch.uint8), as of {field} leaf {bad[0]!r}: each "
                                 "rank's bytes quantize its own shard, not a shard of a tensor of "
                                 "the param's shape; use fo.save/fo.load per rank, or fp32/bf16 "
                                 "moments")


def _other_shape(key: str, md: TensorStorageMetadata, obj: torch.Tensor) -> str:
    """What a checkpoint entry of another shape than the state's is, and what to do."""
    says = (f"{key!r}: the checkpoint holds {md.properties.dtype} of shape {tuple(md.size)}, "
            f"the state dict {obj.dtype} of shape {tuple(obj.shape)}")
    if torch.int16 not in (md.properties.dtype, obj.dtype):
        return says + " (build the state with the params and options of the saved run)"
    return says + (" (a split master, store_param_remainders=True, is saved as its int16 "
                   "halves: 2 rows, or 1, the remainder alone, for a GPU param whose state "
                   "keeps no high half; it loads only into a split master of as many rows. "
                   "To switch the master's format or the mode, load at the saved world size "
                   "into the saved format, then fo.save and fo.load on each rank)")


class StrictLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, as strict as :func:`functional_offload.load`.

    Besides DCP's own check of a key missing from the checkpoint, it refuses before anything
    is read:

    - a tensor whose shape in the checkpoint differs from the one it loads into, saying when
      either is a split master's ``int16`` halves (another master format, or another number of
      rows);
    - a tensor whose dtype in the checkpoint differs from the one it loads into (DCP would
      cast it: fp32 masters would silently lose bits);
    - checkpoint entries under a loaded top-level key (e.g. ``"optim"``) that the state dict
      lacks (say, masters saved by a run with bf16 params, loaded into fp32 params).

    :class:`~functional_offload.CheckpointError` names the key; ``dcp.load`` raises it wrapped
    in its ``CheckpointException``, on every rank.

    Example::

        dcp.load({"optim": fo.dcp.state_dict(like, loading=True)}, checkpoint_id="ckpt/step-1000",
                 planner=fo.dcp.StrictLoadPlanner())
    """

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        for key, obj in self.state_dict.items():
            md = saved.get(key)  # a missing key: DCP's own error, below
            if not (isinstance(obj, torch.Tensor) and isinstance(md, TensorStorageMetadata)):
                continue
            if tuple(md.size) != tuple(obj.shape):
                raise CheckpointError(_other_shape(key, md, obj))
            if md.properties.dtype != obj.dtype:
                raise CheckpointError(f"{key!r}: the checkpoint holds {md.properties.dtype}, the "
                                      f"state dict {obj.dtype}; values are never cast on load "
                                      "(build the state with the dtypes of the saved run)")
        plan = super().create_local_plan()  # raises for missing keys
        roots = {k for k, v in self.original_state_dict.items() if isinstance(v, Mapping)}
        origin = self.metadata.planner_data or {}
        unexpected = sorted(k for k in saved
                            if k not in self.state_dict and origin.get(k, (k,))[0] in roots)
        if unexpected:
            shown = f"{unexpected[:8]}" + (f" (of {len(unexpected)})" if len(unexpected) > 8 else "")
            raise CheckpointError(f"the checkpoint holds {shown}, which the state dict "
                                  "lacks; build the state with the optimizer chain, params and "
                                  "dtypes of the saved run")
        return plan
