"""Placement policies: which leaves' optimizer state lives in host memory.

A policy is decided once, at ``init`` (and again when a checkpoint is loaded into a state built
with another policy). Decisions are pure functions of leaf metadata — path, shape, dtype, device,
number of elements, state bytes — so they can be planned on ``meta`` tensors, without a GPU.

Leaves whose params already live on the host keep their state there, whatever the policy; the
policy decides among the other ("device") leaves.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from functional_offload.state import terminal_states
from functional_offload.checks import is_int, real
from functional_offload.tree import (check_tensor_leaves, flatten_like, insertion_order,
                                     leaves_with_paths)
from functional_offload.typing import OptState, Params

__all__ = [
    "LeafInfo",
    "PlacementPlan",
    "Placement",
    "plan",
    "offload_fraction",
    "on_host",
    "on_device",
    "device_budget",
    "predicate",
    "select",
]


class LeafInfo(NamedTuple):
    """What a policy may look at for one leaf."""

    path: str  # dotted path in the params tree
    tensor: torch.Tensor  # the param (may be a meta tensor)
    state_bytes: int  # bytes of optimizer state this leaf needs on the device (masters, moments)

    @property
    def numel(self) -> int:
        return self.tensor.numel()


class PlacementPlan(NamedTuple):
    """Where each leaf's state lives, one row per leaf in the order the params were built
    (dict insertion order, e.g. ``named_parameters()`` order)."""

    paths: tuple[str, ...]
    on_host: tuple[bool, ...]  # True: state in host memory
    numels: tuple[int, ...]
    state_bytes: tuple[int, ...]  # the state's bytes where it lives
    already_on_host: tuple[bool, ...]  # params that were on the host before any decision
    index: tuple[int, ...]  # each row's position in the params' flatten order

    @property
    def fraction(self) -> float:
        """Offloaded elements over the elements of the device leaves (0.0 when there are none).

        With :func:`offload_fraction` this can exceed the requested fraction: whole leaves move.
        """
        dev = [n for n, a in zip(self.numels, self.already_on_host) if not a]
        off = [n for n, h, a in zip(self.numels, self.on_host, self.already_on_host) if h and not a]
        return sum(off) / sum(dev) if sum(dev) else 0.0

    @property
    def host_bytes(self) -> int:
        return sum(b for b, h in zip(self.state_bytes, self.on_host) if h)

    @property
    def device_bytes(self) -> int:
        return sum(b for b, h in zip(self.state_bytes, self.on_host) if not h)

    @property
    def host_bytes_per_param(self) -> float:
        """Host state bytes per element of the host-resident leaves (0.0 when there are none)."""
        n = sum(k for k, h in zip(self.numels, self.on_host) if h)
        return self.host_bytes / n if n else 0.0

    def host_mask(self) -> list[bool]:
        """``on_host`` in the params' flatten order."""
        out = [False] * len(self.index)
        for i, h in zip(self.index, self.on_host):
            out[i] = h
        return out

    def summary(self) -> str:
        """A table: path, elements, state bytes, where the state lives; then the totals.

        A leaf whose param is in host memory keeps its state there whatever the policy: its
        row says ``host (param)``, and the fraction counts only the other leaves.
        """
        w = max([len(p) for p in self.paths] + [4])
        rows = [f"{'leaf':<{w}}  {'elements':>12}  {'state bytes':>12}  where"]
        for p, n, b, h, a in zip(self.paths, self.numels, self.state_bytes, self.on_host,
                                 self.already_on_host):
            where = "host (param)" if a else "host" if h else "device"
            rows.append(f"{p:<{w}}  {n:>12,}  {b:>12,}  {where}")
        kept = sum(self.already_on_host)
        if kept == len(self.paths):
            rows.append("every param is in host memory, so all state is in host memory with it "
                        "(a placement decides only for params on a device); state bytes on host "
                        f"{self.host_bytes:,} ({self.host_bytes_per_param:.2f} per element there), "
                        f"on device {self.device_bytes:,}")
        else:
            also = (f"; {kept} of {len(self.paths)} leaves have their param in host memory and "
                    "keep their state there" if kept else "")
            rows.append(f"offloaded fraction {self.fraction:.4f} of the device params' elements"
                        f"{also}; state bytes on host {self.host_bytes:,} "
                        f"({self.host_bytes_per_param:.2f} per element there), on device "
                        f"{self.device_bytes:,}")
        return "\n".join(rows)


Decide = Callable[[Sequence[LeafInfo]], Sequence[bool]]


class Placement:
    """A placement policy: ``decide(leaves) -> [on_host, ...]`` over the device leaves, which it
    sees in the order the params were built.

    Build one with the functions of this module; :func:`plan` shows what an optimizer's ``init``
    would do with it.
    """

    def __init__(self, decide: Decide, name: str):
        self._decide = decide
        self.name = name

    def __repr__(self) -> str:
        return f"Placement({self.name})"

    def decide(self, leaves: Sequence[LeafInfo]) -> list[bool]:
        out = list(self._decide(leaves))
        if len(out) != len(leaves):
            raise ValueError(f"placement {self.name} returned {len(out)} decisions for "
                             f"{len(leaves)} leaves")
        for leaf, x in zip(leaves, out):
            if not isinstance(x, bool):
                raise TypeError(f"placement {self.name} decided {x!r} for leaf {leaf.path!r}; "
                                "each decision must be a bool (True: its state on the host)")
        return out

    def plan(self, params: Params, state_bytes: Sequence[int] | None = None,
             host_bytes: Sequence[int] | None = None) -> PlacementPlan:
        """Decide for every leaf of ``params`` (``meta`` tensors work).

        Args:
          params: a pytree of tensors.
          state_bytes: per-leaf optimizer-state bytes on the device, in flatten order (the
            optimizers pass theirs); default: each param's own size.
          host_bytes: the same on the host where they differ (a host-resident GPU param gets
            an fp32 master); default: ``state_bytes``.
        """
        paths, leaves, _ = leaves_with_paths(params)
        check_tensor_leaves(leaves, paths, "params")
        if state_bytes is None:
            state_bytes = [t.numel() * t.element_size() for t in leaves]
        host_bytes = state_bytes if host_bytes is None else host_bytes
        order = insertion_order(params)
        already = [leaves[i].device.type == "cpu" for i in order]
        device_leaves = [LeafInfo(paths[i], leaves[i], int(state_bytes[i]))
                         for i, a in zip(order, already) if not a]
        decided = iter(self.decide(device_leaves))
        on_host = tuple(True if a else next(decided) for a in already)
        return PlacementPlan(
            tuple(paths[i] for i in order), on_host, tuple(leaves[i].numel() for i in order),
            tuple(int(host_bytes[i] if h else state_bytes[i]) for i, h in zip(order, on_host)),
            tuple(already), tuple(order))


_previews: ContextVar[Optional[list[PlacementPlan]]] = ContextVar("functional_offload_previews",
                                                                  default=None)


def previewing() -> bool:
    """Whether an optimizer's ``init`` runs inside :func:`plan` (it then allocates nothing)."""
    return _previews.get() is not None


def record_plan(p: PlacementPlan) -> None:
    """Hand a terminal optimizer's plan to the :func:`plan` call around its ``init``."""
    plans = _previews.get()
    if plans is not None:
        plans.append(p)


def plan(opt: Any, params: Params) -> PlacementPlan:
    """The placement ``opt.init(params)`` would make, without allocating anything (the state
    comes out on ``meta``): each row's ``state_bytes`` are the bytes of the state tensors that
    ``init`` makes for that leaf (masters, moments, EMA), counted on that state.

    Works for any optimizer built from this library's parts (chains, partitions, wrappers);
    with several terminal optimizers inside (a :func:`~functional_offload.partition`), every
    part's rows come together, one per leaf in the order the params were built, and ``index``
    and ``host_mask()`` refer to ``params``' flatten order.

    Example::

        >>> import torch, functional_offload as fo
        >>> params = {"w": torch.zeros(4, 4, dtype=torch.bfloat16, device="meta")}
        >>> p = fo.plan(fo.adamw(1e-3, placement=fo.placement.on_device()), params)
        >>> p.device_bytes  # fp32 master, mu and nu: 12 bytes per element
        192
    """
    token = _previews.set([])
    try:
        state = opt.init(params)
        plans = _previews.get() or []
    finally:
        _previews.reset(token)
    if not plans:
        raise ValueError("this optimizer holds no terminal optimizer: nothing is placed")
    sizes = [_leaf_bytes(s) for s in terminal_states(state) if "master" in s._fields]
    paths = leaves_with_paths(params)[0]
    at = {p: i for i, p in enumerate(paths)}
    rows = [(at.get(path, -1), path, h, n, size[i], a)
            for p, size in zip(plans, sizes)
            for path, h, n, i, a in zip(p.paths, p.on_host, p.numels, p.index, p.already_on_host)]
    if len(sizes) != len(plans) or sorted(r[0] for r in rows) != list(range(len(paths))):
        raise ValueError(f"fo.plan cannot match this optimizer's placement to the params: its "
                         f"init placed {len(rows)} leaves in {len(plans)} terminal optimizers and "
                         f"its state holds {len(sizes)} of their states, for params of "
                         f"{len(paths)} leaves; fo.plan shows optimizers whose state holds each "
                         "part's state, every leaf of params in one part")
    rank = {i: k for k, i in enumerate(insertion_order(params))}
    rows.sort(key=lambda r: rank[r[0]])
    index, paths_, on_host, numels, state_bytes, already = (tuple(x) for x in zip(*rows))
    return PlacementPlan(paths_, on_host, numels, state_bytes, already, index)


def _leaf_bytes(state: OptState) -> list[int]:
    """Bytes of a terminal optimizer's state per leaf (masters, moments, EMA; not the count),
    in its params' flatten order."""
    tree = state.params.tree
    out = [0] * len(leaves_with_paths(tree)[1])
    for field in state._fields:
        value = getattr(state, field)
        if field in ("count", "params") or (isinstance(value, tuple) and not value):
            continue  # not per leaf, or a field this state does not fill
        for i, x in enumerate(flatten_like(value, tree, f"state.{field}")):
            if isinstance(x, torch.Tensor):
                out[i] += x.numel() * x.element_size()
    return out


def _check_fraction(f: Any) -> float:
    v = real(f)
    if v is None or not 0 <= v <= 1:  # NaN too
        raise ValueError(f"offload fraction must be a number in [0, 1], got {f!r}; e.g. 0.5 "
                         "offloads about half of the elements, 1.0 all of them")
    return v


def offload_fraction(fraction: float, *, from_end: bool = False) -> Placement:
    """Megatron's ``--optimizer-offload-fraction``: offload leaves greedily in the model's order.

    With ``N`` the number of elements in the device leaves, ``threshold = fraction · N``; walking
    the leaves in the order the params were built (``named_parameters()`` order), a leaf is
    offloaded while the elements offloaded so far are below the threshold. Whole leaves move, so
    the real fraction (:attr:`PlacementPlan.fraction`) can overshoot.

    ``from_end=True`` walks from the last leaf instead, keeping the first leaves' state on the
    device. With grad streaming (:func:`functional_offload.stream`) this is the tail helper:
    backward produces the first layers' grads last, so their host steps would be the wait
    after backward; on the GPU they finish with the fused kernel at once.
    """
    f = _check_fraction(fraction)

    def decide(leaves: Sequence[LeafInfo]) -> list[bool]:
        threshold = f * sum(leaf.numel for leaf in leaves)
        out, running = [], 0
        for leaf in (reversed(leaves) if from_end else leaves):
            host = running < threshold or f == 1.0  # 1.0: every leaf, empty ones too (on_host)
            running += leaf.numel if host else 0
            out.append(host)
        return out[::-1] if from_end else out

    return Placement(decide, f"offload_fraction({f}{', from_end=True' if from_end else ''})")


def on_host() -> Placement:
    """All state in host memory (``offload_fraction(1.0)``)."""
    return Placement(lambda leaves: [True] * len(leaves), "on_host()")


def on_device() -> Placement:
    """All state next to its param (nothing offloaded)."""
    return Placement(lambda leaves: [False] * len(leaves), "on_device()")


def device_budget(max_bytes: int) -> Placement:
    """Keep state on the device, leaf by leaf in the model's order, while it fits in ``max_bytes``.

    The first leaf that does not fit and every leaf after it go to the host, so the device part
    is a prefix of the leaves (as with the fraction policy, whose host part is a prefix).
    """
    if not is_int(max_bytes) or max_bytes < 0:
        raise ValueError(f"device_budget takes a byte count >= 0, got {max_bytes!r}")

    def decide(leaves: Sequence[LeafInfo]) -> list[bool]:
        out, used, full = [], 0, False
        for leaf in leaves:
            full = full or used + leaf.state_bytes > max_bytes
            used += 0 if full else leaf.state_bytes
            out.append(full)
        return out

    return Placement(decide, f"device_budget({max_bytes})")


def predicate(fn: Callable[[str, torch.Tensor], bool]) -> Placement:
    """Offload the leaves for which ``fn(path, param)`` is true."""
    return Placement(lambda leaves: [bool(fn(leaf.path, leaf.tensor)) for leaf in leaves],
                     f"predicate({getattr(fn, '__name__', 'fn')})")


def select(fn: Callable[[str, torch.Tensor], bool], if_true: Placement,
           if_false: Placement) -> Placement:
    """Combine policies: ``if_true`` decides among the leaves where ``fn(path, param)`` holds,
    ``if_false`` among the others (each sees only its own leaves, in order).

    Example — small leaves stay on the GPU, half of the rest is offloaded::

        select(lambda path, p: p.numel() < 65536, on_device(), offload_fraction(0.5))
    """
    for name, x in (("if_true", if_true), ("if_false", if_false)):
        if not isinstance(x, Placement):
            raise TypeError(f"select's {name} must be a Placement (e.g. on_device(), "
                            f"offload_fraction(0.5)), got {type(x).__name__}")

    def decide(leaves: Sequence[LeafInfo]) -> list[bool]:
        picks = [bool(fn(leaf.path, leaf.tensor)) for leaf in leaves]
        a = iter(if_true.decide([x for x, p in zip(leaves, picks) if p]))
        b = iter(if_false.decide([x for x, p in zip(leaves, picks) if not p]))
        return [next(a) if p else next(b) for p in picks]

    return Placement(decide, f"select({if_true.name}, {if_false.name})")
