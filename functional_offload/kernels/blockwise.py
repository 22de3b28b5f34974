r"""Block-wise 8-bit moments (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
arXiv 2110.02861): an optimizer moment kept as one byte per element plus an fp32 scale per block.

A moment of :math:`n` elements is cut into blocks of :data:`BLOCK` (256) elements, the last one
shorter. Block :math:`k` keeps its *absmax* :math:`a_k = \max_{i \in k} |x_i|` and per element a
code :math:`c_i`, the index of the value of the *dynamic map* :math:`Q` (256 values in
:math:`[-1, 1]`) nearest to :math:`x_i / a_k`:

.. math::

    c_i = \operatorname{arg\,min}_j \left| Q_j - x_i / a_k \right|, \qquad
    \hat x_i = Q_{c_i} \, a_k

The dynamic map (the paper's dynamic tree quantization) spends its bits on a decimal exponent
(:math:`10^{-6} \ldots 10^0`) and a linear fraction whose resolution grows with the exponent;
the *signed* map (one sign bit) is used for moments that change sign (Adam's first moment,
momentum), the *unsigned* map (the sign bit spent on the fraction) for non-negative ones (Adam's
second moment). Both contain 0 and 1 exactly, so a zero moment and a block's largest element are
exact.

One step of a leaf, per block: dequantize the moments, run the optimizer's fp32 math (the new
parameter is computed from the new fp32 moments), take each moment's new absmax and quantize.
The nearest code is found by comparison with the midpoints between neighbouring map values, in
fp32: :math:`c` is the number of midpoints below :math:`x/a` (a tie goes to the lower value). An
all-zero block has absmax 0 (codes of 0); a non-finite element makes its block non-finite
(absmax NaN or inf), as an fp32 moment would stay non-finite.

Layout: one ``uint8`` tensor per moment, block after block, each block its 256 code bytes then
its absmax (4 bytes, fp32 little-endian): :func:`nbytes` of :math:`n` elements is
:math:`260 \lceil n / 256 \rceil`; an element range that starts on a block is a contiguous byte
range (:func:`part`), so chunks, pieces and checkpoints take these bytes as they are. Code bytes
are stored rotated so that byte 0 is the map's 0: an all-zero tensor is a zero moment. The
library keeps no other ``uint8`` state: a ``uint8`` moment is a block-wise one.

Example::

    >>> import torch
    >>> from functional_offload.kernels import blockwise
    >>> x = torch.tensor([0.5, -1.0, 2e-3, 0.0])
    >>> q = blockwise.quantize(x, signed=True)
    >>> q.numel(), [round(v, 4) for v in blockwise.dequantize(q, 4, signed=True).tolist()]
    (260, [0.5008, -0.993, 0.0018, 0.0])
"""

from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple

import torch

from functional_offload.kernels import blockwise_cuda

__all__ = ["BLOCK", "Map", "map_on", "dynamic_map", "is_blockwise", "nbytes", "elements", "part",
           "quantize", "dequantize", "quantize_into", "dequantize_into", "table"]

assert sys.byteorder == "little", "a block's absmax is read as a little-endian fp32"

BLOCK = 256  # elements per block (bitsandbytes' block-wise optimizers use 256 as well)
_ROW = BLOCK + 4  # bytes per block: the codes, then the absmax


def dynamic_map(signed: bool) -> list[float]:
    """The 256 values of the dynamic map, sorted (the paper's dynamic tree quantization with 7
    exponent bits): per decade :math:`10^{e}`, :math:`e = -6 \\ldots 0`, the midpoints of
    :math:`2^{e+6}` (signed) or :math:`2^{e+7}` (unsigned) equal steps of :math:`[0.1, 1]`
    scaled by :math:`10^{e}` (and their negatives when signed), with 0 and 1."""
    values = [0.0, 1.0]
    for e in range(7):
        k = 2 ** e if signed else 2 ** (e + 1)
        bounds = [0.1 + 0.9 * j / k for j in range(k + 1)]
        means = [10.0 ** (e - 6) * (a + b) / 2 for a, b in zip(bounds, bounds[1:])]
        values += means + ([-m for m in means] if signed else [])
    assert len(values) == 256
    return sorted(values)


class Map(NamedTuple):
    """A map as the kernels take it (fp32): ``values`` by stored byte (rotated: byte 0 is 0),
    ``mids`` the 255 midpoints of the sorted values and ``+inf`` (256), ``zero`` the sorted
    index of 0 (the rotation: byte = sorted index - zero mod 256), ``search`` the arithmetic
    search's tables (129 words; :func:`_search`)."""

    values: torch.Tensor
    mids: torch.Tensor
    zero: int
    search: torch.Tensor


@functools.lru_cache(maxsize=None)
def _map(signed: bool) -> Map:
    v = torch.tensor(dynamic_map(signed), dtype=torch.float32)
    mids = torch.cat([(v[:-1] + v[1:]) * 0.5, torch.tensor([float("inf")])])
    zero = int((v == 0).nonzero()[0])
    return Map(torch.roll(v, -zero), mids, zero, _search(mids, zero, signed))


@functools.lru_cache(maxsize=None)
def map_on(signed: bool, device: torch.device) -> Map:
    """The map of a signed or unsigned moment, its tensors on ``device`` (made once)."""
    m = _map(signed)
    return Map(m.values.to(device), m.mids.to(device), m.zero, m.search.to(device))


_NEAR = 2.0 ** -12  # the search's margin: 4x its bound on fp32 rounding (~6e-5), in steps


def _search(mids: torch.Tensor, zero: int, signed: bool) -> torch.Tensor:
    r"""The arithmetic search of the native and GPU kernels for the nearest value (its result
    is the midpoints' count, exactly). By magnitude :math:`a = |y|` the values fall in 9 classes: 0,
    the 7 decades and 1. The class is found by one comparison with the fp32 midpoint between
    two classes that falls in :math:`a`'s binary octave (a 32-entry table by its exponent).
    Decade :math:`e` holds :math:`k` values :math:`d (0.1 + (i + 1/2) w)`, :math:`d = 10^{e-6}`,
    :math:`w = 0.9 / k`: the value nearest :math:`a` is :math:`i = \lfloor x \rfloor`,
    :math:`x = a / (d w) - 0.1 / w`, except near a midpoint (:math:`x` within ``_NEAR`` of an
    integer: about 1 input in 2,000), where the kernel searches the midpoints instead.

    Returns 129 words (int32 or fp32): per octave the classes below it (int32), then the class
    midpoint in it (NaN if none: no comparison holds), 32 each; per class, padded to 16, the
    slope :math:`1/(d w)`, the offset :math:`-0.1/w` plus ``_NEAR``, the magnitude index of its
    first value (int32) and its last step (int32; the classes of 0 and of 1 hold one value:
    slope 0, offset 1/2); then ``2 * _NEAR``."""
    ks = [2 ** e if signed else 2 ** (e + 1) for e in range(7)]
    first = [1 + sum(ks[:e]) for e in range(7)] + [1 + sum(ks)]  # the decades, then the value 1
    bounds = [float(mids[zero + f - 1]) for f in first]  # the midpoint below each class
    below, inside = [], []
    for octave in range(32):  # a's binary exponent, clamped: [0, 2^-30), ..., [2^-1, 1), [1, inf]
        lo = 0.0 if octave == 0 else 2.0 ** (octave - 31)
        hi = 2.0 ** (octave - 30) if octave < 31 else math.inf
        here = [b for b in bounds if lo <= b < hi]
        assert len(here) <= 1, "two class midpoints in one octave"
        below.append(sum(b < lo for b in bounds))
        inside.append(here[0] if here else math.nan)
    slope, offset, start, steps = [0.0] * 16, [0.5] * 16, [0] * 16, [0] * 16
    start[8] = first[7]
    for e, k in enumerate(ks):
        dw = 10.0 ** (e - 6) * 0.9 / k
        slope[1 + e], offset[1 + e] = 1.0 / dw, -0.1 * k / 0.9 + _NEAR
        start[1 + e], steps[1 + e] = first[e], k - 1
    ints = torch.tensor(below + start + steps, dtype=torch.int32).view(torch.float32)
    return torch.cat([ints[:32], torch.tensor(inside + slope + offset), ints[32:],
                      torch.tensor([2 * _NEAR])])


def table(signed: bool) -> torch.Tensor:
    """The native kernel's view of a map, 4-byte words (an fp32 tensor): the values by byte
    (256), the midpoints (256), the zero index (int32) and the arithmetic search's tables
    (129; :func:`_search`)."""
    m = _map(signed)
    return torch.cat([m.values, m.mids, torch.tensor([m.zero], dtype=torch.int32).view(torch.float32),
                      m.search])


def is_blockwise(x: torch.Tensor) -> bool:
    """Whether the state tensor ``x`` is a block-wise 8-bit moment (``uint8``)."""
    return x.dtype == torch.uint8


def nbytes(n: int) -> int:
    """Bytes of a block-wise moment of ``n`` elements."""
    return -(-n // BLOCK) * _ROW


def elements(nbytes_: int) -> int:
    """The most elements a block-wise moment of ``nbytes_`` bytes holds (a multiple of 256)."""
    return nbytes_ // _ROW * BLOCK


def part(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of the 1-D state tensor ``x``; of a block-wise moment, the bytes of
    the blocks they fall in (``start`` must begin a block)."""
    if not is_blockwise(x):
        return x[start:stop]
    if start % BLOCK:
        raise ValueError(f"a block-wise moment is cut on blocks of {BLOCK}; got start {start}")
    return x[start // BLOCK * _ROW: nbytes(stop)]


def _rows(q: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = q.view(-1, _ROW)
    if rows.shape[0] != -(-n // BLOCK):
        raise ValueError(f"a block-wise moment of {n} elements has {nbytes(n)} bytes, got {q.numel()}")
    return rows[:, :BLOCK], rows[:, BLOCK:].view(torch.float32)  # codes (nb, 256), absmax (nb, 1)


def dequantize_into(q: torch.Tensor, out: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of the block-wise moment ``q`` into ``out`` (fp32, 1-D or any shape with
    its element count)."""
    n = out.numel()
    codes, absmax = _rows(q, n)
    m = map_on(signed, q.device)
    if blockwise_cuda.available(q, out):  # one pass, the same bits
        blockwise_cuda.dequantize_into(q, m.values, out)
        return out
    full = torch.take(m.values, codes.long()).mul_(absmax)  # (nb, 256)
    out.view(-1).copy_(full.view(-1)[:n])
    return out


def dequantize(q: torch.Tensor, n: int, signed: bool) -> torch.Tensor:
    """The ``n`` fp32 values of the block-wise moment ``q`` (a new 1-D tensor)."""
    return dequantize_into(q, torch.empty(n, dtype=torch.float32, device=q.device), signed)


def quantize_into(x: torch.Tensor, q: torch.Tensor, signed: bool) -> torch.Tensor:
    """Write the fp32 values ``x`` (any shape) into the block-wise moment ``q``; returns ``q``."""
    x = x.reshape(-1).to(torch.float32)
    n = x.numel()
    codes, absmax = _rows(q, n)
    m = map_on(signed, q.device)
    if blockwise_cuda.available(x, q):  # one pass, the same bits
        blockwise_cuda.quantize_into(x, q, m)
        return q
    pad = codes.numel() - n
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, BLOCK) if pad else x.view(-1, BLOCK)
    a = blocks.abs().amax(dim=1, keepdim=True)  # NaN in a block: NaN
    inv = torch.where(a != 0, 1 / a, torch.zeros_like(a))
    y = blocks * inv
    idx = torch.searchsorted(m.mids, y.contiguous(), right=False)  # midpoints below y
    idx = torch.where(y.isnan(), 0, idx)  # as the native search: no comparison holds for NaN
    codes.copy_(((idx - m.zero) % 256).to(torch.uint8))
    absmax.copy_(a)
    return q


def quantize(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """The block-wise moment of the fp32 values ``x`` (a new ``uint8`` tensor on its device)."""
    q = torch.zeros(nbytes(x.numel()), dtype=torch.uint8, device=x.device)
    return quantize_into(x, q, signed)
