"""Device-resident leaves: the spec's math run on the params' devices, a call per group.

A :class:`Group` is the leaves one call updates (one device, one dtype of values and of each
moment, one weight decay); :func:`run_groups` casts their grads where the values' dtype
differs, runs the math, writes the params of leaves with a master (a remainder-only split
master's as it is split, batch by batch; the others' after the math) and moves the EMAs, all
queued on the caller's current streams.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch

from functional_offload.kernels import blockwise
from functional_offload.kernels.remainder import high, is_lean, is_split, join, split_
from functional_offload.optimizers.spec import batches
from functional_offload.quantized import write_params

if TYPE_CHECKING:
    from functional_offload.executor.timeline import Timeline
    from functional_offload.optimizers.layout import Leaf

__all__ = ["Cast", "Group", "device_groups", "run_groups"]


class Cast:
    """Grads in their values' dtype (bf16 grads of fp32 masters): views of one buffer, shaped like
    the grads, made once. The buffer's memory is taken for a step's math and given back after it
    (its storage is resized), so nothing is held between steps and no view is made per step."""

    def __init__(self, like: list[torch.Tensor], dtype: torch.dtype, device: torch.device):
        numels = [x.numel() for x in like]
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
        self.views = [v.view(x.shape) for v, x in zip(flat.split(numels), like)]
        self.storage = flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.storage.resize_(0)

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` cast into the views (one multi-tensor copy); :meth:`release` once the math
        that reads them is queued."""
        self.storage.resize_(self.nbytes)
        torch._foreach_copy_(self.views, grads)
        return self.views

    def release(self) -> None:
        self.storage.resize_(0)


class Group(NamedTuple):
    """Device-resident leaves that one call of the spec's device math updates: one device, one
    dtype of values and of each moment, one weight decay."""

    idx: list[int]
    values: list[torch.Tensor]
    moments: list[list[torch.Tensor]]  # per moment
    decay: bool
    device: torch.device
    written: list[int]  # positions (in idx) of the leaves with a master, whose params are written
    params: list[torch.Tensor]  # those params
    news: list[torch.Tensor]  # and their values (masters)
    emas: list[torch.Tensor]  # the leaves' EMAs, or [] without
    cast_at: list[int]  # positions (in idx) whose params' dtype is not the math's
    cast: Optional[Cast]  # their grads in the math's dtype
    split: bool = False  # the values are split masters (kernels/remainder.py): the math runs on
    #                      their fp32 values, joined per batch, and ``news`` are their high halves
    highs: tuple[Optional[torch.Tensor], ...] = ()  # with ``split``, per leaf: the param of a
    #                      remainder-only master (its high half, written by the split itself;
    #                      not in ``written``), else None
    eight: tuple[bool, ...] = ()  # per moment, block-wise 8-bit (kernels/blockwise.py): the math
    #                               runs on its fp32 values, dequantized per batch
    fusable: bool = False  # a kernel that writes the params can step it (spec.device_writes):
    #                        fp32 values and moments on a GPU, contiguous, each leaf's param
    #                        bf16/fp16 (a plain tensor) of its master, or fp32 itself

    @property
    def decoded(self) -> bool:
        """Whether the math runs on fp32 copies of stored formats (split masters, 8-bit moments)."""
        return self.split or any(self.eight)


def state_shape(value: torch.Tensor) -> torch.Size:
    """The shape a leaf's state was laid out with: its param's then (a split master's rows')."""
    return value.shape[1:] if is_split(value) else value.shape


def _in_state_shapes(xs: list, values: list) -> list:
    """Grads or params (``None`` kept) viewed in the shapes of their leaves' state: a param
    reshaped in place since keeps its elements, in order, and its state steps them so."""
    return [x if x is None or x.shape == state_shape(v) else x.detach().reshape(state_shape(v))
            for x, v in zip(xs, values)]


def _math_dtype(value: torch.Tensor) -> torch.dtype:
    """The dtype the math runs in for a leaf's value: fp32 for a split master, else its own."""
    return torch.float32 if is_split(value) else value.dtype


def device_groups(leaves: list["Leaf"]) -> list[Group]:
    """The groups of the device-resident ``leaves``, in the order their first leaf comes."""
    keyed: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if not leaf.on_host:
            key = (leaf.value.device, leaf.value.dtype,
                   tuple(None if m is None else m.dtype for m in leaf.moments), leaf.decay)
            keyed.setdefault(key, []).append(i)
    groups = []
    for (device, dtype, moments, decay), idx in keyed.items():
        split = is_split(leaves[idx[0]].value)
        dtype = _math_dtype(leaves[idx[0]].value)
        eight = tuple(m is not None and blockwise.is_blockwise(m) for m in leaves[idx[0]].moments)
        written = [k for k, i in enumerate(idx) if leaves[i].has_master
                   and not is_lean(leaves[i].value)]
        cast_at = ([] if split or any(eight) else  # decoded math casts batch by batch
                   [k for k, i in enumerate(idx) if leaves[i].param.dtype != dtype])
        groups.append(Group(
            idx, [leaves[i].value for i in idx],
            [[leaves[i].moments[j] for i in idx] for j in range(len(leaves[idx[0]].moments))],
            decay, device, written, [leaves[idx[k]].param for k in written],
            [high(leaves[idx[k]].value) if split else leaves[idx[k]].value for k in written],
            [leaves[i].ema for i in idx if leaves[i].ema is not None], cast_at,
            Cast([leaves[idx[k]].value for k in cast_at], dtype, device) if cast_at else None,
            split, tuple(leaves[i].param if is_lean(leaves[i].value) else None for i in idx)
            if split else (), eight,
            device.type == "cuda" and dtype == torch.float32 and not split
            and all(m == torch.float32 for m in moments)
            and all(_fusable(leaves[i]) for i in idx)))
    return groups


def _fusable(leaf: "Leaf") -> bool:
    """Whether a kernel writing params from fp32 masters (or stepping fp32 params) takes the
    leaf: its tensors contiguous, its param a plain bf16/fp16 tensor of its master or the fp32
    value itself."""
    p, v = leaf.param, leaf.value
    plain = type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_contiguous()
    ok = (p.dtype in (torch.bfloat16, torch.float16) if leaf.has_master else p is v)
    return plain and ok and v.is_contiguous() and all(m.is_contiguous() for m in leaf.moments)


def _with_grads(grp: Group, grads: list) -> Optional[tuple]:
    """The group's lists cut to the leaves with a grad this step (their grads cast one by one,
    but a decoded group's, which its math casts batch by batch), or None if no leaf has one."""
    if not grp.decoded:
        grads = [g if g is None or g.dtype == _math_dtype(v) else g.to(_math_dtype(v))
                 for g, v in zip(grads, grp.values)]
    keep = [k for k, g in enumerate(grads) if g is not None]
    if not keep:
        return None
    kept = set(keep)
    return ([grads[k] for k in keep], [grp.values[k] for k in keep],
            [[m[k] for k in keep] for m in grp.moments],
            [p for k, p in zip(grp.written, grp.params) if k in kept],
            [v for k, v in zip(grp.written, grp.news) if k in kept],
            [grp.emas[k] for k in keep] if grp.emas else [],
            [grp.highs[k] for k in keep] if grp.highs else [])


def _cast(grp: Group, grads: list) -> list:
    """Grads in the values' dtype through the group's :class:`Cast` (released by the caller)."""
    if len(grp.cast_at) == len(grads):
        return grp.cast(grads)
    grads = list(grads)
    for k, g in zip(grp.cast_at, grp.cast([grads[k] for k in grp.cast_at])):
        grads[k] = g
    return grads


def _decoded_math(math: Callable[..., None], grp: Group, signed: list[bool], values: list,
                  grads: list, moments: list, hyper: Any, emas: list,
                  ema_decay: Optional[float], highs: list,
                  stored: Optional[Callable[..., bool]]) -> None:
    """``math`` on stored formats: in batches of about ``spec.BATCH`` elements, the fp32 values of
    split masters joined (``highs``: per value, the param of a remainder-only one, else None)
    and of 8-bit moments dequantized, and grads in the values' dtype, stepped (a split master's
    EMA moved), written back (split, quantized; a remainder-only master's high half into its
    param). ``stored``: the spec's ``device_stored``, which steps each split master's leaf
    it takes in one pass (no EMA: that needs the fp32 values); the batches take the rest."""
    if stored is not None and grp.split and not emas:
        left = [k for k, (v, g) in enumerate(zip(values, grads))
                if not stored(v, highs[k], g, [m[k] for m in moments], hyper)]
        if len(left) < len(values):
            values, grads, highs = ([x[k] for k in left] for x in (values, grads, highs))
            moments = [[m[k] for k in left] for m in moments]
    for part in batches(grads):  # the fp32 copies a batch needs
        vs = [join(v, h) for v, h in zip(values[part], highs[part])] if grp.split else values[part]
        gs = [g if g.dtype == v.dtype else g.to(v.dtype) for g, v in zip(grads[part], vs)]
        ms = [[blockwise.dequantize(q, g.numel(), sg).view(g.shape)
               for q, g in zip(m[part], grads[part])] if eight else m[part]
              for m, eight, sg in zip(moments, grp.eight, signed)]
        math(vs, gs, ms, hyper)
        for m, temps, eight, sg in zip(moments, ms, grp.eight, signed):
            if eight:
                for q, x in zip(m[part], temps):
                    blockwise.quantize_into(x, q, sg)
        if grp.split:
            for v, x, h in zip(values[part], vs, highs[part]):
                split_(v, x, h)
            if emas:
                torch._foreach_lerp_(emas[part], vs, 1 - (ema_decay or 0.0))


def _run_fused(writes: Callable[..., None], grp: Group, grads: list, h: Any) -> list:
    """``writes`` over the group's leaves with a grad: one call per param dtype of the leaves
    with a master (grads in that dtype), one for fp32 params; the values stepped."""
    at = {k: n for n, k in enumerate(grp.written)}
    calls: dict[Any, tuple[list, ...]] = {}  # param dtype (None: fp32 params) -> lists
    stepped = []
    for k, g in enumerate(grads):
        if g is None:
            continue
        v = grp.values[k]
        p = grp.params[at[k]] if k in at else v
        lists = calls.setdefault(p.dtype if k in at else None, ([], [], [], [], []))
        for x, y in zip(lists, (g if g.is_contiguous() else g.contiguous(), p,
                                grp.moments[0][k], grp.moments[1][k], v)):
            x.append(y)
        stepped.append(k)
    for key, (gs, ps, ms, ns, vs) in calls.items():
        writes(gs, ps, [ms, ns], None if key is None else vs, h)
    return stepped


def run_groups(groups: list[Group], gs: list, every_grad: bool, math: Callable[..., None],
               signed: list[bool], hyper: Any, hyper_no_decay: Any, ema_decay: Optional[float],
               timeline: Optional["Timeline"], touched: list,
               writes: Optional[Callable[..., None]] = None,
               stored: Optional[Callable[..., bool]] = None) -> None:
    """Update each group's leaves that have a grad in ``gs`` (per leaf; ``every_grad``: the
    grads check found every leaf with one). ``signed``: per moment, whether it may be negative
    (its block-wise 8-bit map). ``touched`` gets the group's device before a group's state is
    first changed in place, so that a caller catching an error (a quantized param's write
    failing after its math ran) knows whether the state changed. ``writes``: the spec's
    ``device_writes``, run on the groups it takes (``Group.fusable``) in place of ``math``
    and the params' write; ``stored``: the spec's ``device_stored``, run on the leaves of
    stored formats it takes in place of their decoded math."""
    for grp in groups:
        grads = _in_state_shapes([gs[i] for i in grp.idx], grp.values)
        if writes is not None and grp.fusable:
            touched.append(grp.device)
            s0 = timeline.stamp(grp.device) if timeline else None
            stepped = _run_fused(writes, grp, grads, hyper if grp.decay else hyper_no_decay)
            if grp.emas and stepped:
                torch._foreach_lerp_([grp.emas[k] for k in stepped],
                                     [grp.values[k] for k in stepped], 1 - (ema_decay or 0.0))
            if timeline:
                timeline.span("GPU update", f"{len(stepped)} leaves", s0, timeline.stamp(grp.device))
            continue
        values, moments, params, news, emas = grp.values, grp.moments, grp.params, grp.news, grp.emas
        highs = list(grp.highs)
        cast = grp.cast
        if not every_grad and any(g is None for g in grads):
            cut = _with_grads(grp, grads)  # leaves without a grad left out (see _with_grads)
            if cut is None:
                continue
            cast = None
            grads, values, moments, params, news, emas, highs = cut
        touched.append(grp.device)
        s0 = timeline.stamp(grp.device) if timeline else None
        h = hyper if grp.decay else hyper_no_decay
        try:
            if cast is not None:
                grads = _cast(grp, grads)
            if grp.decoded:
                _decoded_math(math, grp, signed, values, grads, moments, h, emas, ema_decay, highs,
                              stored)
            else:
                math(values, grads, moments, h)
        finally:
            if cast is not None:
                cast.release()  # after the math is queued: the stream orders its reuse
        if params:
            write_params(_in_state_shapes(params, news), news)
        if emas and not grp.split:
            torch._foreach_lerp_(emas, [v if v.dtype == e.dtype else v.to(e.dtype)
                                        for v, e in zip(values, emas)], 1 - (ema_decay or 0.0))
        if timeline:
            timeline.span("GPU update", f"{len(grads)} leaves", s0, timeline.stamp(grp.device))
