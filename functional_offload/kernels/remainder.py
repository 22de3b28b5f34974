r"""The split master: an exact fp32 master of a bf16 param kept as two 16-bit halves.

With ``store_param_remainders=True`` the master of a bf16 leaf is an ``int16`` tensor of shape
``(2, *param.shape)``: row 0 the *high half* (the bf16 param's bits), row 1 the *remainder* (the
master's low 16 bits), as TransformerEngine's and Megatron's ``store_param_remainders``. The
halves hold all 32 bits of the fp32 master, so the master is exact: every step computes the same
fp32 master as the fp32 format, bit for bit. The bf16 param is the high half itself, so the host
step writes no separate copy of it: for a GPU param the high half (pinned) is what is copied up.

With :math:`b` the master's bits, :math:`h` its high and :math:`l` its low 16 bits (``int16``):

.. math::

    \text{high} = h + [l < 0] \pmod{2^{16}}, \qquad \text{remainder} = l,
    \qquad h = \text{high} - [\text{remainder} < 0] \pmod{2^{16}}

(a high half of :math:`\pm 0` with a negative remainder, which no split makes, joins without
the borrow: a param set to zero in place is followed within its remainder, not wrapped into a
NaN).

The high half is the master rounded to bf16 to nearest with ties away from zero (the fp32
format rounds ties to even: the params of the two formats differ by one bf16 ulp where the
master lies exactly halfway, about one element in :math:`2^{17}` per step; no 16-bit remainder
can give ties to even, which needs :math:`2^{16}+1` codes for an even high half). A NaN master
is kept as a quiet NaN of its sign and top bits with remainder 0, so its param is a NaN whatever
its payload (rounding the canonical NaN ``0x7fffffff`` a GPU writes would carry into the sign
and give a param of ``-0.0``). The library keeps no other ``int16`` state: an ``int16`` master
is a split one.

The master of a contiguous bf16 param on a GPU keeps the remainder alone, ``(1, *param.shape)``
(:func:`is_lean`): its high half is the param itself. It holds 2 bytes of master per element,
not 4 (on the device, where both halves took as many as an fp32 master, the format now saves
2 bytes a param: the device math joins and splits with the param's bits in place); on the
host (but for a delayed update's look-ahead, which keeps both halves there), the CPU
kernel's step copies the param's bits down beside the grad (2 bytes an
element more down over PCIe), steps them and copies them back up as the new param; the GPU
engine reads them where they are (2 bytes an element fewer each way). A param changed in place
between steps changes its master (followed within the remainder). Reading such a master takes
its param (:func:`join`, :func:`split_`): loading one writes the param's bits too.

Checkpoints hold the fp32 master in either format (:func:`join` on save, :func:`split_` on
load), so a checkpoint of one format loads into the other.

The delayed update's look-ahead sends its bf16 *bases* with one more byte of their fp32 bits:
:func:`split_base` writes the high half (truncated) and the byte below it (the *residual*,
``int8``), and :func:`join_base` makes an fp32 base of the two, exact but for its low byte
(within :math:`2^{-8}` of a bf16 step, toward zero; infinities and NaNs kept), so the landing
that adds the next step's grad term to it rounds to bf16 once, as the exact step does.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from functional_offload.kernels import remainder_cuda

__all__ = ["is_split", "is_lean", "new_split", "join", "split_", "join_halves", "split_halves", "high",
           "flat_halves", "holds_high_half", "split_base", "join_base"]

assert sys.byteorder == "little", "the split master reads fp32 bits as little-endian int16 pairs"


def is_split(master: torch.Tensor) -> bool:
    """Whether ``master`` is a split master (``int16``, rows high and remainder)."""
    return master.dtype == torch.int16


def is_lean(master: torch.Tensor) -> bool:
    """Whether ``master`` is a split master of the remainder alone (``(1, *param.shape)``): its
    high half is its param's bits."""
    return is_split(master) and master.shape[0] == 1


def new_split(param: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (``int16``, of shape ``(2, *param.shape)``, or ``(1, *param.shape)`` for the
    remainder alone) made a split master of the bf16 ``param``: the param's bits as the high
    half, a zero remainder (the master equals the param); returns ``out``."""
    if not is_lean(out):
        out[0].copy_(param.detach().contiguous().view(torch.int16))
    out[-1].zero_()
    return out


def high(master: torch.Tensor) -> torch.Tensor:
    """The high half of a split master that holds it as bf16 (a view): the param's value."""
    if is_lean(master):
        raise ValueError("a remainder-only split master holds no high half: its param is it")
    return master[0].view(torch.bfloat16)


def flat_halves(master: torch.Tensor, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high half and the remainder as 1-D ``int16`` views (of a remainder-only master the
    high half is ``param``'s bits, on its device)."""
    hi = param.view(torch.int16).view(-1) if is_lean(master) else master[0].view(-1)
    return hi, master[-1].view(-1)


def holds_high_half(master: torch.Tensor, param: Optional[torch.Tensor]) -> bool:
    """Whether ``param`` can be the high half of the remainder-only ``master``: a contiguous
    bf16 tensor of as many elements (a param reshaped in place keeps its elements in order)."""
    return (param is not None and param.dtype == torch.bfloat16
            and param.numel() == master[0].numel() and param.is_contiguous())


def _param_bits(master: torch.Tensor, param: Optional[torch.Tensor]) -> torch.Tensor:
    """The bits of a remainder-only master's param (its high half) in the master's shape (a
    param reshaped since, keeping its elements and its memory in order, is followed)."""
    if not holds_high_half(master, param):
        raise ValueError(f"a remainder-only split master of shape {tuple(master.shape[1:])} "
                         "needs its contiguous bf16 param of as many elements (its high half), "
                         f"got {None if param is None else (param.dtype, tuple(param.shape))}")
    return param.detach().view(torch.int16).view(master.shape[1:])


def join(master: torch.Tensor, param: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 master of a split master (a new tensor of the param's shape, on the master's
    device); ``param``: the bf16 param, the high half of a remainder-only one."""
    if is_lean(master):
        return join_halves(_param_bits(master, param).to(master.device), master[0])
    return join_halves(master[0], master[1])


def split_(master: torch.Tensor, value: torch.Tensor,
           param: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write ``value`` (any float dtype, the param's shape) as fp32 into the split ``master``
    (of a remainder-only one: its high half into ``param``, the bf16 param); returns
    ``master``."""
    if is_lean(master):
        bits = _param_bits(master, param)  # the high halves written there, in place
        rest = master[0]  # written in place where it is on the param's device
        lo = rest if rest.device == bits.device else torch.empty(
            value.shape, dtype=torch.int16, device=bits.device)
        split_halves(value.to(device=bits.device, dtype=torch.float32), bits, lo)
        if lo is not rest:
            rest.copy_(lo)
        return master
    split_halves(value.to(device=master.device, dtype=torch.float32), master[0], master[1])
    return master


def _halves_of(value: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> bool:
    """Whether ``hi`` and ``lo`` are int16 halves of the fp32 ``value``, one element each (the
    one-pass kernels' arguments; the torch ops raise for others)."""
    return (value.dtype == torch.float32 and hi.dtype == lo.dtype == torch.int16
            and value.numel() == hi.numel() == lo.numel())


def join_halves(hi: torch.Tensor, lo: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 values of high halves ``hi`` and remainders ``lo`` (``int16``, one shape), into
    ``out`` (fp32, that shape) if given."""
    if out is None:
        out = torch.empty(hi.shape, dtype=torch.float32, device=hi.device)
    if _halves_of(out, hi, lo) and remainder_cuda.available(hi, lo, out):  # one pass
        remainder_cuda.join_into(hi, lo, out)
        return out
    # (low, high) 16 bits of each fp32 (1-D views: a 0-dim tensor cannot change dtype in place)
    pairs = out.view(-1).view(torch.int16).view(*hi.shape, 2)
    pairs[..., 0].copy_(lo)
    borrow = (lo < 0) & ((hi & 0x7FFF) != 0)  # (+-0 never: a param zeroed in place, not a NaN)
    torch.sub(hi, borrow.to(torch.int16), out=pairs[..., 1])  # wraps mod 2**16
    return out


def split_halves(value: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Write the fp32 ``value`` into high halves ``hi`` and remainders ``lo`` (a NaN as a quiet
    NaN of its sign and top bits, remainder 0)."""
    if _halves_of(value, hi, lo) and remainder_cuda.available(value, hi, lo):  # one pass
        remainder_cuda.split_into(value, hi, lo)
        return
    pairs = value.contiguous().view(-1).view(torch.int16).view(*value.shape, 2)
    low, top = pairs[..., 0], pairs[..., 1]
    nan = value.isnan()
    torch.where(nan, top | 0x40, top + (low < 0).to(torch.int16), out=hi)  # wraps mod 2**16
    torch.where(nan, torch.zeros((), dtype=torch.int16, device=lo.device), low, out=lo)


def split_base(base: torch.Tensor, hi: torch.Tensor, residual: torch.Tensor) -> None:
    """Write ``base`` as fp32 (an fp64 master's rounded) as the high half of its bits ``hi``
    (bf16) and the byte below it ``residual`` (``int8``)."""
    quads = base.float().contiguous().view(torch.uint8).view(*base.shape, 4)  # little-endian
    hi.view(torch.uint8).view(*base.shape, 2).copy_(quads[..., 2:])
    residual.view(torch.uint8).copy_(quads[..., 1])


def join_base(hi: torch.Tensor, residual: torch.Tensor,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 bases of bf16 ``hi`` and ``int8`` ``residual`` (:func:`split_base`), their low
    byte zero, into ``out`` (fp32, their shape) if given."""
    if out is None:
        out = torch.empty(hi.shape, dtype=torch.float32, device=hi.device)
    quads = out.view(torch.uint8).view(*hi.shape, 4)
    quads[..., 0].zero_()
    quads[..., 1].copy_(residual.view(torch.uint8))
    quads[..., 2:].copy_(hi.view(torch.uint8).view(*hi.shape, 2))
    return out
