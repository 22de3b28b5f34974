"""optree helpers: dotted leaf paths, the user's leaf order, and checking trees against params."""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from typing import Any, Callable, Optional, Sequence

import optree
import torch

from functional_offload.quantized import is_quantized, memory_key

__all__ = ["leaves_with_paths", "flatten_like", "check_tensor_leaves", "check_grad", "check_grads",
           "GradsOf", "grads_of", "check_float_leaves", "float_leaves", "check_no_aliasing",
           "insertion_order", "local", "is_dtensor", "describe"]


def _entry_name(entry: Any) -> str:
    for attr in ("field", "key", "name", "index"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaves_with_paths(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """``(paths, leaves, treespec)`` of ``tree`` in flatten order (``None`` is not a leaf);
    paths are dotted, e.g. ``"mu.layer.weight"``."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf)
    return list(paths_of(spec)), leaves, spec


@functools.lru_cache(maxsize=256)
def paths_of(spec: optree.PyTreeSpec) -> tuple[str, ...]:
    """Dotted paths of a structure's leaves (cached: an update sees the same structure)."""
    return tuple(".".join(_entry_name(e) for e in acc) or "<root>" for acc in spec.accessors())


def insertion_order(tree: Any) -> list[int]:
    """Flatten indices of ``tree``'s leaves in the order the user built it.

    optree sorts dict keys (``layers.10`` before ``layers.2``); this order keeps each dict's
    insertion order instead (``named_parameters()`` order), as placement policies need.
    """
    paths = paths_of(optree.tree_structure(tree))
    with optree.dict_insertion_ordered(True, namespace="functional_offload"):
        built = paths_of(optree.tree_structure(tree, namespace="functional_offload"))
    rank = {p: i for i, p in enumerate(built)}
    return sorted(range(len(paths)), key=lambda i: rank[paths[i]])


def describe(x: Any) -> str:
    """A short description of a leaf: ``Tensor[4, 8] bfloat16 cuda:0``, or its type."""
    if isinstance(x, torch.Tensor):
        return f"{type(x).__name__}[{', '.join(map(str, x.shape))}] {str(x.dtype).replace('torch.', '')} {x.device}"
    return "None" if x is None else type(x).__name__


def _mismatch(tree: Any, reference: Any, what: str) -> str:
    """Which paths differ between ``tree`` and ``reference``: the first few of each kind."""
    ref_paths = set(paths_of(optree.tree_structure(reference, none_is_leaf=True)))
    try:
        got_paths = set(paths_of(optree.tree_structure(tree, none_is_leaf=True)))
    except Exception:  # noqa: BLE001 - not a tree optree knows
        return f"{what} is a {type(tree).__name__}, not a tree like the params"
    missing = sorted(ref_paths - got_paths)
    extra = sorted(got_paths - ref_paths)
    parts = []
    if missing:
        parts.append(f"missing {missing[:5]}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if extra:
        parts.append(f"unexpected {extra[:5]}" + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    if not parts:
        parts.append("the same paths in other containers (e.g. a list where the params have a tuple)")
    return (f"{what} does not match the params tree ({len(ref_paths)} leaves): " + "; ".join(parts))


def flatten_like(tree: Any, reference: Any, what: str,
                 structure: Optional[optree.PyTreeSpec] = None) -> list[Any]:
    """Flatten ``tree`` up to the structure of the tree ``reference`` (the params; ``structure``:
    its structure when the caller has it).

    A ``None`` where the reference has a leaf is kept as ``None`` (no gradient for that leaf); a
    ``None`` in the reference is no leaf (it must be ``None`` in ``tree`` too). Raises
    ``ValueError`` naming ``what`` and the first differing paths when the structures differ.
    """
    spec = optree.tree_structure(reference) if structure is None else structure
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError):
        raise ValueError(_mismatch(tree, reference, what) + ". Pass a tree with the same keys and "
                         "nesting as the params given to init (None for leaves without a "
                         "gradient).") from None


def check_unique_paths(paths: Sequence[str], what: str, why: str) -> None:
    """Raise ``ValueError`` naming the first dotted path two leaves of ``what`` share (keys
    with dots, ``{'a.b': x}`` beside ``{'a': {'b': y}}``, or ``0`` beside ``'0'``); ``why``:
    what names the leaves by their paths."""
    seen: set[str] = set()
    for p in paths:
        if p in seen:
            raise ValueError(f"two {what} leaves have the dotted path {p!r} (e.g. {{'a.b': x}} "
                             f"and {{'a': {{'b': y}}}}, or the keys 0 and '0'); {why}: rename "
                             "one")
        seen.add(p)


def check_tensor_leaves(leaves: Sequence[Any], paths: Sequence[str], what: str) -> None:
    """Raise ``TypeError`` naming the first leaf of ``leaves`` that is not a tensor."""
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what} leaf {path!r} is a {type(leaf).__name__}, expected a torch.Tensor")


def check_grad(path: str, g: Any, p: torch.Tensor) -> Optional[torch.Tensor]:
    """``g`` as the local grad of param ``p`` (a DTensor's shard), after checking it is a dense
    tensor of the param's shape, dtype and device (a negated or conjugated view comes back as a
    plain copy of its values); ``None`` stays ``None``. Raises ``TypeError`` / ``ValueError``
    naming ``path`` and the fix."""
    if g is None:
        return None
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"grad {path!r} is a {type(g).__name__}; expected a tensor or None "
                        "(convert with torch.as_tensor and move it to the param's device)")
    g, p = local(g), local(p)
    if g.shape != p.shape:
        raise ValueError(f"grad {path!r} has shape {tuple(g.shape)} but its param has shape "
                         f"{tuple(p.shape)}; pass the gradient of that param")
    if g.dtype != p.dtype:
        raise TypeError(f"grad {path!r} has dtype {g.dtype} but its param is {p.dtype}; cast "
                        f"the grad with .to({p.dtype})")
    if g.device != p.device:
        raise ValueError(f"grad {path!r} is on {g.device} but its param is on {p.device}; "
                         f"move the grad to {p.device}")
    if g.layout != torch.strided:
        raise TypeError(f"grad {path!r} has layout {g.layout}; only dense (strided) grads are "
                        "supported (call .to_dense())")
    if g.device.type == "meta":
        raise ValueError(f"grad {path!r} is a meta tensor (it has no data); pass the real gradient")
    if g.numel() and g.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
        raise ValueError(f"grad {path!r} shares memory with its param (the step would change the "
                         "grad while reading it); pass a copy")
    if g.is_neg() or g.is_conj():  # its memory holds other values than it shows: kernels that
        g = g.detach().resolve_conj().resolve_neg()  # read memory get a copy of its values
    return g


def plain_grad(g: Any, p: torch.Tensor) -> bool:
    """The common case, checked quickly: ``g`` is a plain dense tensor with ``p``'s dtype, shape
    and device, not ``p``'s own memory, and no negated or conjugated view. False sends a grad
    to :func:`check_grad`."""
    return (type(g) is torch.Tensor and g.dtype is p.dtype and g.shape == p.shape
            and g.layout is torch.strided and not g.is_meta and g.device == p.device
            and not g.is_neg() and not g.is_conj()
            and g.untyped_storage().data_ptr() != p.untyped_storage().data_ptr())


_FLOAT_DENSE = operator.attrgetter("dtype.is_floating_point", "layout", "is_meta")


def check_float_leaves(tree: Any, what: str) -> list[Optional[torch.Tensor]]:
    """The leaves of ``tree`` (``None`` kept), after checking each is a dense floating tensor;
    raises ``TypeError`` naming the first that is not."""
    return float_leaves(tree, what)[0]


def float_leaves(tree: Any, what: str) -> tuple[list[Optional[torch.Tensor]], optree.PyTreeSpec]:
    """:func:`check_float_leaves` and the structure of ``tree`` (``None`` as a leaf)."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    if (leaves and set(map(type, leaves)) == {torch.Tensor}  # the common case, all at once
            and set(map(_FLOAT_DENSE, leaves)) == {(True, torch.strided, False)}):
        return leaves, spec
    for i, x in enumerate(leaves):
        if x is None or (isinstance(x, torch.Tensor) and x.dtype.is_floating_point
                         and x.layout is torch.strided and not x.is_meta):
            continue
        path = paths_of(spec)[i]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} {path!r} is a {type(x).__name__}; expected a tensor or None")
        raise TypeError(f"{what} {path!r} is a {describe(x)} tensor; expected a dense floating "
                        "tensor with data (cast it with .float() or pass the real gradient)")
    return leaves, spec


_META = operator.attrgetter("dtype", "shape", "device", "layout")
_PTR = torch.Tensor.data_ptr
_KEY = operator.attrgetter("dtype", "shape")
_STRIDE = torch.Tensor.stride
_OFFSET = torch.Tensor.storage_offset
_NEG = torch.Tensor.is_neg
_DENSE = torch.Tensor.is_contiguous
_FLOAT = operator.attrgetter("dtype.is_floating_point")
_TAKES = itertools.count(1)


class GradsOf:
    """What the grads of a params tree must be, taken from it once, so that a step checks all
    its grads with a few calls that each run over every leaf below Python.

    Each param is recorded as its memory, dtype, shape, strides and storage offset. :meth:`plain`
    is true when every grad is a plain dense tensor with its param's dtype, shape and device,
    outside every param's memory and not a negated view, and no param's record changed since
    (then the grads pass :func:`check_grad` as they are); anything else goes to
    :func:`check_grad` leaf by leaf, which names what is wrong. A param whose record changed is
    taken anew (:meth:`refresh`) if the state can step it as it now is, else refused.
    """

    def __init__(self, params: Any):
        self.tree = params
        leaves, self.structure = optree.tree_flatten(params)
        self.paths = paths_of(self.structure)
        self.types = [torch.Tensor] * len(leaves)
        self.params: Optional[list[torch.Tensor]] = None
        self.objects = leaves  # the tree's leaves: a leaf replaced in it is refused (refresh)
        flat = type(params) is dict and all(isinstance(v, torch.Tensor) for v in params.values())
        self.values = list(params.values()) if flat else None  # (a flat dict's, in its order)
        self._take([local(p) for p in leaves])

    def _take(self, params: list[torch.Tensor]) -> None:
        """Record ``params`` (all checked first: a refused param leaves the record as it was)."""
        ptrs, keys, strides, offsets = (list(map(f, params)) for f in (_PTR, _KEY, _STRIDE, _OFFSET))
        dense = list(map(_DENSE, params))
        if self.params is None:  # first taken: params not in order or not plain are checked
            if not (all(dense) and not any(map(_NEG, params)) and all(map(_FLOAT, params))):
                for path, p in zip(self.paths, params):
                    _check_param(path, p, None)
        else:  # taken anew: each param whose record changed (and the memory they share)
            was = zip(self.ptrs, self.keys, self.strides, self.offsets)
            changed = [i for i, (old, *new) in enumerate(zip(was, ptrs, keys, strides, offsets))
                       if old != tuple(new) or params[i].is_neg()]
            for i in changed:
                _check_param(self.paths[i], params[i],
                             (self.keys[i][1].numel(), self.dense[i], self.meta[i][2]))
            if changed:
                check_no_aliasing(self.paths, params)
        self.taken = next(_TAKES)  # unique to this taking of the params (see refresh)
        self.params = params
        self.meta = [(p.dtype, p.shape, p.device, torch.strided) for p in params]
        self.ptrs, self.keys, self.strides, self.offsets, self.dense = ptrs, keys, strides, offsets, dense
        storages = [p.untyped_storage() for p in params]
        lo = [s.data_ptr() for s in storages]
        hi = [s.data_ptr() + s.nbytes() for s in storages]
        owners = sorted(range(len(params)), key=lo.__getitem__)  # the params' storages by start,
        self.owners = [-1, *owners]                                # after one that holds nothing
        self.starts, self.ends = [-1, *map(lo.__getitem__, owners)], [-1, *map(hi.__getitem__, owners)]

    def flatten(self, grads: Any) -> list[Any]:
        """``grads`` flattened like the params (``None`` kept for leaves without a grad)."""
        return flatten_like(grads, self.tree, "grads", self.structure)

    def plain(self, grads: list[Any]) -> bool:
        # (no conjugated grad either: grads of these dtypes are real, params are taken real)
        if (list(map(type, grads)) != self.types or list(map(_META, grads)) != self.meta
                or any(map(_NEG, grads))):
            return False
        qs = list(map(_PTR, grads))
        if not self._unchanged():
            return False
        below = map(operator.sub, map(bisect.bisect_right, itertools.repeat(self.starts), qs),
                    itertools.repeat(1))  # the storage starting last at or before each grad
        return not any(map(operator.lt, qs, map(self.ends.__getitem__, below)))

    def check_apart(self, grads: list[Optional[torch.Tensor]]) -> None:
        """Raise ``ValueError`` naming the first grad of ``grads`` (checked, flattened) that lies
        in another param's memory: the step would change it while it reads it."""
        for path, g in zip(self.paths, grads):
            if g is None:
                continue
            k = bisect.bisect_right(self.starts, g.data_ptr()) - 1
            if g.data_ptr() < self.ends[k]:
                raise ValueError(f"grad {path!r} lies in the memory of param "
                                 f"{self.paths[self.owners[k]]!r} (the step would change it while "
                                 "reading it): pass a copy (grad.clone())")

    def _same_leaves(self) -> bool:
        """Whether the tree holds the leaves it held (the same tensor objects)."""
        t = self.tree
        if self.values is not None:
            return len(t) == len(self.values) and all(map(operator.is_, t.values(), self.values))
        leaves = optree.tree_leaves(t)
        return len(leaves) == len(self.objects) and all(map(operator.is_, leaves, self.objects))

    def _unchanged(self) -> bool:
        ps = self.params
        return (self._same_leaves() and list(map(_PTR, ps)) == self.ptrs
                and list(map(_KEY, ps)) == self.keys and list(map(_STRIDE, ps)) == self.strides
                and list(map(_OFFSET, ps)) == self.offsets and not any(map(_NEG, ps)))

    def refresh(self) -> None:
        """Take the params anew if one was replaced or laid out anew (``param.data = ...``,
        ``module.half()``). Raises ``ValueError`` / ``TypeError`` naming the first param the
        state cannot step as it now is, and the fix: one no longer contiguous (its memory in
        another order than its elements: ``param.data = param.data.t()``), whose elements share
        memory (expanded) or another param's, a negated or conjugated view, a param with
        another number of elements or a dtype that is not floating; and a leaf of the tree
        replaced by another tensor (``params["w"] = ...``), which the state does not follow."""
        if not self._unchanged():
            leaves, structure = optree.tree_flatten(self.tree)
            if structure != self.structure:
                raise ValueError("the params tree the state holds changed its structure (a leaf "
                                 "added or removed in place); make a new state with "
                                 "opt.init(params)")
            for path, a, b in zip(self.paths, leaves, self.objects):
                if a is not b:
                    raise ValueError(f"param {path!r} was replaced in the params tree the state "
                                     "holds by another tensor, which the state does not follow: "
                                     f"write into the param instead (param.data = ..., "
                                     "param.copy_(...)), or make a new state with opt.init(params)")
            self._take([local(p) for p in leaves])

    def check(self, grads: list[Any]) -> list[Optional[torch.Tensor]]:
        """``grads`` (flattened) checked: all at once when plain, else leaf by leaf."""
        if self.plain(grads):
            return grads
        self.refresh()
        out = [g if g is None or plain_grad(g, p) else check_grad(path, g, p)
               for path, g, p in zip(self.paths, grads, self.params)]
        self.check_apart(out)
        return out


def _check_param(path: str, p: torch.Tensor,
                 was: Optional[tuple[int, bool, torch.device]]) -> None:
    """Raise naming ``path`` if a state cannot step param ``p`` as it is (its kernels read and
    write a param's memory as laid out when the state last took it); ``was``: the param's
    number of elements, whether it was contiguous and its device then, if it was taken before."""
    if not p.dtype.is_floating_point:
        raise TypeError(f"param {path!r} is now {p.dtype}; only floating params can be "
                        "optimized (cast it back: param.data = param.data.to(<its dtype>))")
    if p.is_neg() or p.is_conj():
        kind, fix = ("negated", "resolve_neg") if p.is_neg() else ("conjugated", "resolve_conj")
        raise ValueError(f"param {path!r} is a {kind} view: its memory holds other values than "
                         "it shows, and a step reads and writes that memory; give it plain "
                         f"memory (param.data = param.data.{fix}())")
    if was is not None and p.device != was[2]:
        raise ValueError(f"param {path!r} moved from {was[2]} to {p.device} since its optimizer "
                         "state took it; where its state lives and the streams its steps order "
                         "against are of that device: move it back, or init a state for the "
                         "params where they are now")
    if was is not None and p.numel() != was[0]:
        raise ValueError(f"param {path!r} now has {p.numel()} elements but its optimizer state "
                         f"was made for {was[0]}; init a state for the params as they are now "
                         "(a reshape that keeps the elements is followed)")
    if p.is_contiguous():
        return
    where = f"shape {tuple(p.shape)}, strides {p.stride()}"
    if _may_overlap(p):
        raise ValueError(f"param {path!r} has elements that share memory ({where}: an expanded "
                         "or overlapping view), so a step would write them more than once; give "
                         "it its own memory (param.data = param.data.contiguous())")
    if was is not None and was[1]:
        raise ValueError(f"param {path!r} is no longer contiguous ({where}, e.g. after "
                         "param.data = param.data.t()): its optimizer state was laid out for its "
                         "memory in order, and stepping that memory now would pair its elements "
                         "with others' state; make it contiguous again (param.data = "
                         "param.data.contiguous()) or init a state for the params as they are now")


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a zero stride, or strides that interleave
    dims): each stride, smallest first, must step past all the elements of the dims below it."""
    reach = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < reach:
            return True
        reach = stride * (size - 1) + reach
    return False


def grads_of(params: Any, cache: Any = None) -> GradsOf:
    """The :class:`GradsOf` ``params``, kept in ``cache.grads_of`` (a state's
    :class:`~functional_offload.base.StepCache`) while the params tree is the same object."""
    kept = None if cache is None else cache.grads_of
    if kept is not None and kept.tree is params:
        return kept
    made = GradsOf(params)
    if cache is not None:
        cache.grads_of = made
    return made


def check_grads(grads: Any, params: Any, cache: Any = None) -> list[Optional[torch.Tensor]]:
    """The grads of ``params``' leaves in flatten order (local shards of DTensors; ``None``
    where there is none), each checked by :func:`check_grad`; ``cache``: where to keep what
    the check learns of the params (see :func:`grads_of`)."""
    of = grads_of(params, cache)
    return of.check(of.flatten(grads))


def check_no_aliasing(paths: Sequence[str], leaves: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming both paths if two leaves share memory (the same tensor twice,
    overlapping views): each would be stepped once per appearance."""
    spans, seen = [], {}
    for path, t in zip(paths, leaves):
        if is_quantized(t):  # no address of its own: its data's, else the object's
            key = memory_key(t)
            key = ("object", id(t)) if key is None else (str(t.device), key)
            if key in seen:
                raise ValueError(f"params {seen[key]!r} and {path!r} hold the same quantized "
                                 "tensor's data; pass it once so it is not stepped twice")
            seen[key] = path
            continue
        if t.device.type == "meta" or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + _extent(t) * t.element_size()
        spans.append((t.device, start, end, path))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError(f"params {a[3]!r} and {b[3]!r} share memory (tied or overlapping "
                             "tensors); pass each tensor once (drop the tied copy from the params "
                             "tree) so it is not stepped twice")


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element a (strided) tensor can touch."""
    return 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) if t.numel() else 0


@functools.lru_cache(maxsize=1)
def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


def local(t: Any) -> Any:
    """The local shard of a DTensor (a plain tensor sharing its storage); anything else as is.

    Under FSDP2 a param is a DTensor and each rank updates its own shard: optimizer state,
    placement and the executor all work on these local tensors. Outside autograd: a grad's
    shard is the same tensor at each call (what the steps know a clip's new grads by).
    """
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()
