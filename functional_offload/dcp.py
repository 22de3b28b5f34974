"""Sharded optimizer-state checkpoints with ``torch.distributed.checkpoint`` (DCP).

Under FSDP2 a param is a DTensor and each rank keeps the optimizer state of its own shard.
:func:`state_dict` shows that state to DCP as DTensors with the params' meshes and placements,
wrapping the state's own tensors; DCP then saves each rank's shards once and loads them at any
world size straight into the state's tensors, wherever they live (host memory included).
:class:`StrictLoadPlanner` makes ``dcp.load`` as strict as :func:`functional_offload.load`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import DTensor
# What FSDP2 builds its sharded params from: DTensor.from_local would move a local tensor on
# the host to the mesh's device, and the state must stay where the placement put it.
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from functional_offload import checkpoint
from functional_offload.base import ParamRefs
from functional_offload.checkpoint import CheckpointError
from functional_offload.tree import flatten_like, leaves_with_paths, local
from functional_offload.typing import OptState

__all__ = ["state_dict", "StrictLoadPlanner"]


def _is_terminal(x: Any) -> bool:
    """A terminal optimizer's state: a NamedTuple holding its params (``AdamState``, ...)."""
    return isinstance(getattr(x, "params", None), ParamRefs)


def _as_dtensor(x: Any, p: Any, path: str) -> Any:
    """State leaf ``x`` of param ``p`` as a DTensor sharded like ``p`` whose local tensor is
    ``x`` itself; ``x`` as is where ``p`` is a plain tensor or ``x`` is None (no master)."""
    if x is None or not isinstance(p, DTensor):
        return x
    if x.shape != local(p).shape:
        raise ValueError(f"state leaf {path!r} has shape {tuple(x.shape)} but its param's local "
                         f"shard has {tuple(local(p).shape)}; pass the state that opt.init made "
                         "for these DTensor params")
    spec = DTensorSpec(p.device_mesh, tuple(p.placements),
                       tensor_meta=TensorMeta(p.shape, p.stride(), x.dtype))
    return DTensor(x, spec, requires_grad=False)


def _sharded(node: Any, prefix: str) -> Any:
    """A terminal state with the fields that mirror the params as DTensors."""
    params = node.params.tree
    ppaths, ps, _ = leaves_with_paths(params)
    spec = optree.tree_structure(params, none_is_leaf=True)
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
        fields[f] = spec.unflatten([_as_dtensor(x, p, f"{prefix}{f}.{q}")
                                    for x, p, q in zip(xs, ps, ppaths)])
    return node._replace(**fields)


def _check_ranks_agree(sd: dict[str, torch.Tensor]) -> None:
    """Raise unless every rank holds the same scalar leaves (step counts): DCP saves a plain
    tensor once, from one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = {k: v.item() for k, v in sd.items() if not isinstance(v, DTensor) and v.dim() == 0}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for k, v in mine.items():
        seen = {r: theirs[k] for r, theirs in enumerate(everyone) if k in theirs}
        if len(set(seen.values())) > 1:
            raise CheckpointError(f"leaf {k!r} differs across ranks (rank: value {seen}); every "
                                  "rank must apply the same updates before a checkpoint")


def state_dict(state: OptState, loading: bool = False) -> dict[str, torch.Tensor]:
    """The state for ``torch.distributed.checkpoint``: ``{dotted path: tensor}``, sharing the
    state's tensors.

    The keys are those of :func:`functional_offload.state_dict` (``"1.mu.layer.weight"``,
    ``"1.count"``). A leaf mirroring a DTensor param (moment, master; params without a master
    have no key) is a DTensor with the param's global shape, mesh and placements whose local
    tensor *is* the state's tensor, on the host or the device; the others (step counts, and the
    state of plain-tensor params) are the state's tensors. ``dcp.save`` writes each shard once;
    ``dcp.load`` into ``state_dict(like)`` copies the checkpoint into ``like``'s tensors in place,
    from a checkpoint saved at any world size, through host memory only.

    For ``dcp.save``, a delayed update in flight is finished first, and a consumed, failed or
    busy state is refused. With ``loading=True`` (for ``dcp.load``), a delayed update in flight
    is waited for and dropped, and a failed state is accepted: loading is how it recovers.
    Collective when a process group is up: call it on every rank, as ``dcp.save``. The scalar
    leaves (step counts) must agree across ranks when saving, else
    :class:`~functional_offload.CheckpointError`.

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
    if loading:
        checkpoint.ready_for_load(state)
    else:
        checkpoint.state_dict(state)  # lands a delayed update; refuses a consumed or failed state
    paths, nodes, spec = leaves_with_paths(state, is_leaf=_is_terminal)
    view = spec.unflatten([_sharded(n, "" if p == "<root>" else f"{p}.") if _is_terminal(n) else n
                           for p, n in zip(paths, nodes)])
    sd = checkpoint.state_tensors(view)
    if not loading:
        _check_ranks_agree(sd)
    return sd


class StrictLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, as strict as :func:`functional_offload.load`.

    Besides DCP's own checks (a key missing from the checkpoint, a different shape), it
    refuses before anything is read:

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
        plan = super().create_local_plan()  # raises for missing keys and shape mismatches
        saved = self.metadata.state_dict_metadata
        for key, obj in self.state_dict.items():
            md = saved[key]
            if (isinstance(obj, torch.Tensor) and isinstance(md, TensorStorageMetadata)
                    and md.properties.dtype != obj.dtype):
                raise CheckpointError(f"{key!r}: the checkpoint holds {md.properties.dtype}, the "
                                      f"state dict {obj.dtype}; values are never cast on load "
                                      "(build the state with the dtypes of the saved run)")
        roots = {k for k, v in self.original_state_dict.items() if isinstance(v, Mapping)}
        origin = self.metadata.planner_data or {}
        unexpected = sorted(k for k in saved
                            if k not in self.state_dict and origin.get(k, (k,))[0] in roots)
        if unexpected:
            raise CheckpointError(f"the checkpoint holds {unexpected[:8]}, which the state dict "
                                  "lacks; build the state with the optimizer chain, params and "
                                  "dtypes of the saved run")
        return plan
