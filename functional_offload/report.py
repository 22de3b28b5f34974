"""Placement report: where every leaf of an optimizer state lives, as a table and as JSON.

The counterpart of Megatron's ``--dump-param-to-param-group-map``: one row per state leaf
(path, device, dtype, shape, bytes), then the totals in host and device memory.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Optional, Union

import torch

from functional_offload.base import ParamRefs
from functional_offload.checkpoint import check_state
from functional_offload.tree import leaves_with_paths
from functional_offload.typing import OptState

__all__ = ["PlacementReport", "placement_report"]


class PlacementReport(NamedTuple):
    rows: list[dict[str, Any]]  # path, device, dtype, shape, bytes

    @property
    def host_bytes(self) -> int:
        return sum(r["bytes"] for r in self.rows if r["device"] == "cpu")

    @property
    def device_bytes(self) -> int:
        return sum(r["bytes"] for r in self.rows if r["device"] != "cpu")

    def __str__(self) -> str:
        w = max([len(r["path"]) for r in self.rows] + [4])
        out = [f"{'leaf':<{w}}  {'device':<8} {'dtype':<15} {'bytes':>14}"]
        out += [f"{r['path']:<{w}}  {r['device']:<8} {r['dtype']:<15} {r['bytes']:>14,}" for r in self.rows]
        out.append(f"state bytes: host {self.host_bytes:,}, device {self.device_bytes:,}")
        return "\n".join(out)

    def to_json(self, path: Optional[Union[str, os.PathLike]] = None) -> str:
        text = json.dumps({"leaves": self.rows, "host_bytes": self.host_bytes,
                           "device_bytes": self.device_bytes}, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text


def placement_report(state: OptState) -> PlacementReport:
    """Report where the leaves of ``state`` live (the params references are not state).

    A read only: it neither waits for a delayed step in flight nor changes the state.
    """
    check_state(state, "state")
    paths, leaves, _ = leaves_with_paths(state, is_leaf=lambda x: isinstance(x, ParamRefs))
    rows = [{"path": k, "device": str(v.device), "dtype": str(v.dtype).replace("torch.", ""),
             "shape": list(v.shape), "bytes": v.numel() * v.element_size()}
            for k, v in zip(paths, leaves) if isinstance(v, torch.Tensor)]
    return PlacementReport(rows)
