r"""The split master's halves joined and split on a CUDA device in one pass each (Triton kernels):
the bits of :mod:`~functional_offload.kernels.remainder`'s torch ops, which take five to six
passes (on an H100, joining and splitting a chunk of 22 M elements took 0.30 and 0.29 ms that
way, as long as the fused AdamW between them).

Each program takes :data:`BLOCK` elements and computes, in 32-bit integers masked to 16 bits,
what the torch ops compute in ``int16`` arithmetic modulo :math:`2^{16}`: joining, the high half
less the borrow of a negative remainder (none for a high half of :math:`\pm 0`) above the
remainder; splitting, the top 16 bits plus the carry of a negative low half, or for a NaN its
top bits with the quiet bit set and remainder 0. Used where Triton imports and the tensors are
contiguous on one CUDA device (:func:`available`); elsewhere the torch ops run.
"""

from __future__ import annotations

import torch

from functional_offload.kernels.triton_gpu import launch, takes, tl, triton

__all__ = ["available", "join_into", "split_into", "joined", "halves"]

BLOCK = 2048  # elements a program takes


available = takes  # whether the kernels take these tensors


if triton is not None:
    @triton.jit
    def joined(h, low):
        """The fp32 values of high halves ``h`` and remainders ``low`` (int32, 0..65535)."""
        borrow = (low >= 0x8000) & ((h & 0x7FFF) != 0)
        top = (h - borrow.to(tl.int32)) & 0xFFFF
        return ((top.to(tl.uint32) << 16) | low.to(tl.uint32)).to(tl.float32, bitcast=True)

    @triton.jit
    def halves(value):
        """The high halves and remainders (int32, 0..65535) of the fp32 ``value``."""
        bits = value.to(tl.uint32, bitcast=True)
        low = (bits & 0xFFFF).to(tl.int32)
        top = (bits >> 16).to(tl.int32)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        high = tl.where(nan, top | 0x40, (top + (low >= 0x8000).to(tl.int32)) & 0xFFFF)
        return high, tl.where(nan, 0, low)

    @triton.jit
    def _join(hi, lo, out, n, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < n
        h = tl.load(hi + at, mask=inside, other=0).to(tl.int32) & 0xFFFF
        low = tl.load(lo + at, mask=inside, other=0).to(tl.int32) & 0xFFFF
        tl.store(out + at, joined(h, low), mask=inside)

    @triton.jit
    def _split(value, hi, lo, n, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < n
        high, low = halves(tl.load(value + at, mask=inside, other=0.0))
        tl.store(hi + at, high.to(tl.int16), mask=inside)
        tl.store(lo + at, low.to(tl.int16), mask=inside)


def join_into(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> None:
    """The fp32 values of high halves ``hi`` and remainders ``lo`` (``int16``) into ``out``
    (fp32; all three contiguous, of one number of elements, on one device)."""
    if out.numel():
        launch(_join, (triton.cdiv(out.numel(), BLOCK),), out.device, hi, lo,
               out.view(-1), out.numel(), BLOCK=BLOCK, num_warps=4)


def split_into(value: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """The fp32 ``value`` written into high halves ``hi`` and remainders ``lo`` (``int16``; all
    three contiguous, of one number of elements, on one device)."""
    if value.numel():
        launch(_split, (triton.cdiv(value.numel(), BLOCK),), value.device,
               value.view(-1), hi, lo, value.numel(), BLOCK=BLOCK, num_warps=4)
