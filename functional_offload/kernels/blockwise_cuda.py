"""Block-wise 8-bit moments on a CUDA device, one pass each way (Triton kernels): the bits of
:mod:`~functional_offload.kernels.blockwise`'s torch ops, which take about ten passes over a
moment (on an H100, quantizing two moments of 22 M elements took 2.0 ms that way, longer than
copying their chunk of state over PCIe).

Each program takes :data:`ROWS` blocks of 256 elements and computes what the torch ops compute,
in the same fp32 operations: the block's absmax (NaN if it holds a NaN), its reciprocal rounded
to nearest (``div_rn``; 0 for an all-zero block), each element times it, and the count of map
midpoints below that product (NaN: 0); dequantizing is the map's value times the absmax. The
count is found as the native kernel finds it (:func:`~functional_offload.kernels.blockwise._search`):
by arithmetic on the product's magnitude, with a binary search of the 256 midpoints only for
the elements near one (about 1 in 2,000), run only by the programs that hold such an element.
A binary search of every element (eight loads from a 1 KiB table each, two moments) made the
kernels bound by those loads; run by every program with the other lanes' loads masked off, it
still took two fifths of the one-pass AdamW kernel's time (H100, 22 M elements). Used where
Triton imports and the tensors are on a CUDA device (:func:`available`); elsewhere the torch
ops run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from functional_offload.kernels.triton_gpu import launch, takes, tl, triton

if TYPE_CHECKING:
    from functional_offload.kernels.blockwise import Map

__all__ = ["available", "quantize_into", "dequantize_into", "codes", "quantize_rows",
           "dequantized_rows"]

ROWS = 2  # blocks a program takes (on an H100 the fastest of 2, 4, 8 and 16)


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: Triton imports, every tensor is contiguous on
    one CUDA device, and the float ones are fp32."""
    return takes(*tensors) and all(t.dtype == torch.float32 for t in tensors
                                   if t.is_floating_point())


if triton is not None:
    @triton.jit
    def codes(y, mids, search, zero):
        """The stored bytes (int32, 0..255) of values over their absmax ``y``: the number of
        midpoints below each, less ``zero``, as the native kernel's ``q_arith`` finds it."""
        bits = y.to(tl.uint32, bitcast=True)
        neg = (bits >> 31) != 0
        abits = bits & 0x7FFFFFFF
        a = abits.to(tl.float32, bitcast=True)
        words = search.to(tl.pointer_type(tl.int32))  # the int32 tables
        octave = tl.minimum(tl.maximum((abits >> 23).to(tl.int32) - 96, 0), 31)
        bound = tl.load(search + 32 + octave)  # the class midpoint in a's octave (NaN: none)
        cls = tl.load(words + octave) + ((a > bound) | (neg & (a >= bound))).to(tl.int32)
        fx = tl.fma(a, tl.load(search + 64 + cls), tl.load(search + 80 + cls))
        x = tl.where(fx == fx, fx, 0.5)  # NaN (y NaN or infinite): any step, replaced below
        t = x.to(tl.int32)  # the floor: x > 0 in its class
        close = x - t.to(tl.float32) < tl.load(search + 128)
        mag = tl.load(words + 96 + cls) + tl.minimum(tl.maximum(t, 0), tl.load(words + 112 + cls))
        code = tl.where(y != y, -zero, tl.where(neg, -tl.minimum(mag, zero), mag))
        pos = tl.zeros(y.shape, dtype=tl.int32)
        if tl.max(close.to(tl.int32)) > 0:  # most programs hold no element near a midpoint
            for k in tl.static_range(8):  # near one: the midpoints below y, a prefix of the
                m = tl.load(mids + pos + ((128 >> k) - 1), mask=close, other=0.0)  # sorted
                pos = tl.where(close & (m < y), pos + (128 >> k), pos)  # 256, bit by bit
        return tl.where(close, pos - zero, code) & 255

    @triton.jit
    def quantize_rows(v, q, mids, search, zero, rows, cols, blocks):
        """The blocks ``rows`` (of ``blocks``) of fp32 values ``v`` (ROWS x 256, zero past the
        moment's end) into the moment ``q``: codes and absmax."""
        a = tl.max(tl.abs(v), axis=1)
        nan = tl.max((v != v).to(tl.int32), axis=1) > 0
        a = tl.where(nan, float("nan"), a)
        inv = tl.where(a != 0.0, tl.div_rn(tl.full(a.shape, 1.0, tl.float32), a), 0.0)
        code = codes(v * inv[:, None], mids, search, zero)
        live = rows < blocks
        tl.store(q + rows[:, None] * 260 + cols[None, :], code.to(tl.uint8), mask=live[:, None])
        tl.store((q + rows * 260 + 256).to(tl.pointer_type(tl.float32)), a, mask=live)

    @triton.jit
    def dequantized_rows(q, values, rows, cols, n):
        """The fp32 values of the blocks ``rows`` of the moment ``q`` of ``n`` elements (ROWS x
        256; zero past its end)."""
        at = rows[:, None] * 256 + cols[None, :]
        code = tl.load(q + rows[:, None] * 260 + cols[None, :], mask=at < n, other=0)
        a = tl.load((q + rows * 260 + 256).to(tl.pointer_type(tl.float32)), mask=rows * 256 < n,
                    other=0.0)
        return tl.load(values + code.to(tl.int32)) * a[:, None]

    @triton.jit
    def _quantize(x, q, mids, search, n, blocks, zero, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, 256)
        at = rows[:, None] * 256 + cols[None, :]
        quantize_rows(tl.load(x + at, mask=at < n, other=0.0), q, mids, search, zero, rows, cols,
                      blocks)

    @triton.jit
    def _dequantize(q, values, out, n, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, 256)
        at = rows[:, None] * 256 + cols[None, :]
        tl.store(out + at, dequantized_rows(q, values, rows, cols, n), mask=at < n)


def quantize_into(x: torch.Tensor, q: torch.Tensor, m: "Map") -> None:
    """Write the fp32 values ``x`` (1-D, contiguous, CUDA) into the block-wise moment ``q`` (its
    bytes, on the same device) by the map ``m`` (its tensors on that device)."""
    blocks = q.numel() // 260
    launch(_quantize, (triton.cdiv(blocks, ROWS),), q.device, x, q, m.mids, m.search, x.numel(),
           blocks, m.zero, ROWS=ROWS, num_warps=4)


def dequantize_into(q: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """The fp32 values of the block-wise moment ``q`` into ``out`` (contiguous, CUDA), with the
    map's values by stored byte ``values`` (256, fp32)."""
    launch(_dequantize, (triton.cdiv(q.numel() // 260, ROWS),), q.device, q, values, out,
           out.numel(), ROWS=ROWS, num_warps=4)
