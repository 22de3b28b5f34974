"""A terminal state's leaves as a step sees them, and what steps reuse while the layout stays.

:func:`layout` pairs each param with its value (master or the param), moments and EMA, in the
params' flatten order; :func:`static` derives what every step of that layout reuses (which
leaves are where, the device groups, the packs' runs, the host views' addresses).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import optree
import torch

from functional_offload.executor import HostExecutor
from functional_offload.kernels.remainder import flat_halves, is_lean, is_split
from functional_offload.optimizers.device_math import Group, device_groups, state_shape
from functional_offload.optimizers.packing import Pack
from functional_offload.optimizers.packing import runs as runs_of
from functional_offload.optimizers.delay import Delay
from functional_offload.optimizers.spec import OptimizerSpec
from functional_offload.tree import flatten_like, leaves_with_paths, local

__all__ = ["Leaf", "Static", "TerminalLike", "check_fits", "check_master", "flat_state", "layout", "static",
           "viewed", "with_flat_views"]


class TerminalLike(Protocol):
    """What a step reads of its optimizer (:class:`~functional_offload.optimizers.terminal.Terminal`)."""

    spec: OptimizerSpec
    cpu_kernel: str
    delayed: bool
    delay: Optional["Delay"]  # the delayed update's policy (None: not delayed)
    ema_decay: Optional[float]
    device_writes: Optional[Callable[..., None]]  # device_kernel="te": the spec's device_writes

    @property
    def executor(self) -> HostExecutor: ...

    @property
    def threads(self) -> int: ...

    def check_state(self, state: Any, action: str) -> None: ...

    def hyper_at(self, n: int) -> tuple[Any, Any]: ...

    def layout(self, state: Any) -> list["Leaf"]: ...


class Leaf(NamedTuple):
    """One leaf of a terminal state, as a step sees it."""

    path: str
    live: torch.Tensor  # the param as in the params tree (nn.Parameter, DTensor...)
    param: torch.Tensor  # its local tensor (the data updated)
    value: torch.Tensor  # master or the param itself
    moments: tuple[torch.Tensor, ...]
    ema: Optional[torch.Tensor]
    has_master: bool
    decay: bool  # weight decay applies
    flat: tuple[torch.Tensor, ...] = ()  # host leaves of element-wise math: (value, moments...)
    #   1-D; a split value as its two halves (kernels/remainder.py; a remainder-only one's high
    #   half is the param's bits, on its device)
    ema_flat: Optional[torch.Tensor] = None  # and the EMA, 1-D

    @property
    def on_host(self) -> bool:
        return self.value.device.type == "cpu"


def with_flat_views(leaf: Leaf) -> Leaf:
    """``leaf`` with its 1-D host views (``flat``, ``ema_flat``) made from its tensors (views do
    not follow a tensor whose storage is replaced: they are made anew when that happened)."""
    return leaf._replace(flat=flat_state(leaf.value, leaf.moments, leaf.param),
                         ema_flat=None if leaf.ema is None else leaf.ema.view(-1))


def flat_state(value: torch.Tensor, moments: Sequence[torch.Tensor],
               param: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A leaf's host state as the kernels take it: 1-D views of the value (a split value's
    halves: of a remainder-only one, ``param``'s bits first) and the moments."""
    values = flat_halves(value, param) if is_split(value) else (value.view(-1),)
    return (*values, *(m.view(-1) for m in moments))


def layout(state: Any, spec: OptimizerSpec, decay: Callable[[Any], list[bool]],
           ema: bool) -> list[Leaf]:
    """The leaves of ``state`` in the params' flatten order; ``decay(params)``: per leaf, whether
    weight decay applies; ``ema``: whether the state keeps EMAs."""
    params = state.params.tree
    paths, lives, _ = leaves_with_paths(params)
    masters = flatten_like(state.master, params, "state.master")
    moms = [flatten_like(getattr(state, m.name), params, f"state.{m.name}") for m in spec.moments]
    emas = flatten_like(state.ema, params, "state.ema") if ema else [None] * len(lives)
    decays = decay(params)
    out = []
    for i, live in enumerate(lives):
        p = local(live)
        leaf = Leaf(paths[i], live, p, masters[i] if masters[i] is not None else p,
                    tuple(m[i] for m in moms), emas[i], masters[i] is not None, decays[i])
        out.append(with_flat_views(leaf) if leaf.on_host and spec.elementwise else leaf)
    return out


def decay_flags(params: Any, mask: Any) -> list[bool]:
    """Per leaf of ``params``, whether weight decay applies under ``mask`` (a tree or a function
    of the params; None: everywhere)."""
    if mask is None:
        return [True] * len(optree.tree_leaves(params))
    tree = mask(params) if callable(mask) else mask
    return [bool(m) for m in flatten_like(tree, params, "weight_decay_mask")]


def check_master(leaf: Leaf) -> None:
    """Refuse a leaf whose param changed dtype since ``init`` so that its master no longer
    fits it (an fp32 master made for an fp32 param that is fp64 now: ``module.double()``), or
    that has none where it needs one (an fp32 param without a master that is bf16 now: it would
    step in bf16); other params without a master, and low-precision params of an fp32 master,
    are followed."""
    p, v = leaf.param, leaf.value
    if not leaf.has_master and p.dtype in (torch.bfloat16, torch.float16):
        raise TypeError(f"param {leaf.path!r} is {p.dtype} now, but its state keeps no master "
                        f"(the param was wider at init), and a {p.dtype} param steps through an "
                        "fp32 master; convert it back, or make a new state for the new dtype with "
                        "opt.init(params)")
    if leaf.has_master and is_split(v) and p.dtype != torch.bfloat16:
        raise TypeError(f"param {leaf.path!r} is {p.dtype} now, but its state keeps a split master "
                        "(store_param_remainders) made for a bf16 param; convert it back, or make "
                        "a new state for the new dtype with opt.init(params)")
    if leaf.has_master and p.dtype not in (torch.bfloat16, torch.float16) and p.dtype != v.dtype:
        raise TypeError(f"param {leaf.path!r} is {p.dtype} now, but its state keeps a {v.dtype} "
                        "master made for its dtype at init; convert it back, or make a new state "
                        "for the new dtype with opt.init(params)")


def check_fits(leaf: Leaf, spec: OptimizerSpec) -> None:
    """Refuse a leaf whose state no longer fits its param: its master (:func:`check_master`),
    or, for a non-element-wise optimizer (Adafactor), a param reshaped since its state was laid
    out: that state follows the param's shape (element-wise state is read flat, so a reshaped
    param is followed)."""
    check_master(leaf)
    if spec.elementwise:
        return
    p = leaf.param
    want = [tuple(p.shape) if m.shape is None else m.shape(p.shape) for m in spec.moments]
    got = [None if x is None else tuple(x.shape) for x in leaf.moments]
    if leaf.has_master:
        want.append(tuple(p.shape))
        got.append(tuple(state_shape(leaf.value)))
    if want != got:
        raise ValueError(f"param {leaf.path!r} is {tuple(p.shape)} now, but its state was laid "
                         f"out for another shape ({spec.name}'s state follows the param's "
                         "shape): reshape it back, or make a new state with opt.init(params)")


class Static(NamedTuple):
    """What a step reuses while the state's layout stays the same: which leaves are where, the
    device groups, the packed leaves, the host tensors whose views the layout keeps and those
    views' addresses."""

    host: list[int]  # leaves whose state is on the host
    packed: frozenset[int]
    groups: list[Group]
    host_devices: frozenset[torch.device]  # the devices of the host leaves' params
    viewed: list[tuple[int, torch.Tensor]]  # (leaf, tensor) per host-view
    view_ptrs: list[int]  # the address each of those views was made at
    pack_runs: list[list[tuple[int, int]]]  # per pack, its runs when every member has a grad
    params: list[tuple[torch.dtype, torch.Size]]  # per leaf, its param's dtype and shape then
    taken: int = 0  # the grads check (GradsOf.taken) that saw the params as these; while it
    #                 is the same, plain grads are checked all at once


def viewed(leaves: list[Leaf]) -> tuple[list[tuple[int, torch.Tensor]], list[int]]:
    """The host tensors whose 1-D views the leaves keep, and each view's address."""
    pairs, ptrs = [], []
    for i, leaf in enumerate(leaves):
        if leaf.flat:
            views = (*leaf.flat, *(() if leaf.ema_flat is None else (leaf.ema_flat,)))
            values: tuple[torch.Tensor, ...] = (leaf.value,)
            if is_lean(leaf.value):  # a split one's views: of the param, then the remainder
                values = (leaf.param, leaf.value)
            elif is_split(leaf.value):  # of its rows (the first follows the storage)
                values = (leaf.value, leaf.value[1])
            tensors = (*values, *leaf.moments, *(() if leaf.ema is None else (leaf.ema,)))
            pairs += [(i, x) for x in tensors]
            ptrs += [v.data_ptr() for v in views]
    return pairs, ptrs


def static(leaves: list[Leaf], packs: list[Pack]) -> Static:
    """The :class:`Static` part of ``leaves`` packed as ``packs``."""
    host = [i for i, leaf in enumerate(leaves) if leaf.on_host]
    decays, dtypes = [leaf.decay for leaf in leaves], [leaf.param.dtype for leaf in leaves]
    return Static(host, frozenset(i for pack in packs for i in pack.members), device_groups(leaves),
                  frozenset(leaves[i].param.device for i in host), *viewed(leaves),
                  [runs_of(pack, [True] * len(leaves), decays, dtypes) for pack in packs],
                  [(leaf.param.dtype, leaf.param.shape) for leaf in leaves])
