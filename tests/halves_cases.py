"""The split master's halves joined and split by :mod:`functional_offload.kernels.remainder_cuda`
against the torch ops of :mod:`functional_offload.kernels.remainder` (on the CPU), bit for bit:
every high half with 40 remainders (both signs, the extremes, those near zero), and 3 M fp32
bit patterns (random, the joined ones, NaNs of every kind, infinities, signed zeros, values one
below a carry). ``test_remainder.py`` runs it in Triton's interpreter, ``test_remainder_cuda.py``
on a GPU."""

from __future__ import annotations

import torch

from functional_offload.kernels import remainder, remainder_cuda


def check(device: str) -> None:
    """Assert the kernels on ``device`` give the torch ops' bits on the CPU."""
    hi = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).repeat_interleave(40)
    lo = torch.tensor([0, 1, -1, 2, -2, 0x7FFF, -0x8000, 0x4000, -0x4000, 123, -123]
                      + list(range(-14, 15)), dtype=torch.int16).repeat(65536)
    want = remainder.join_halves(hi, lo)
    got = torch.empty(want.shape, device=device)
    remainder_cuda.join_into(hi.to(device), lo.to(device), got)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), "join"
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (3_000_000,), generator=g, dtype=torch.int64)
    special = torch.tensor([0x7F800000, -0x800000, 0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001,
                            -0x7FFFFF, 0, -2**31, 0xFFFF, 0x8000, 0x7F7FFFFF, 0x7F7F8000,
                            -0x808000, 0x3F808000, 0x3F807FFF])
    bits = torch.cat([special, bits]).to(torch.int32)
    bits[16:16 + want.numel()] = want.view(torch.int32)
    value = bits.view(torch.float32)
    h1, l1 = torch.empty(value.shape, dtype=torch.int16), torch.empty(value.shape, dtype=torch.int16)
    remainder.split_halves(value, h1, l1)
    h2 = torch.empty(value.shape, dtype=torch.int16, device=device)
    l2 = torch.empty_like(h2)
    remainder_cuda.split_into(value.to(device), h2, l2)
    assert torch.equal(h2.cpu(), h1) and torch.equal(l2.cpu(), l1), "split"
    one = torch.tensor(1.2345678, device=device)  # 0-dim
    a, b = torch.empty((), dtype=torch.int16, device=device), torch.empty((), dtype=torch.int16, device=device)
    remainder_cuda.split_into(one, a, b)
    back = torch.empty((), device=device)
    remainder_cuda.join_into(a, b, back)
    assert torch.equal(back.view(-1).view(torch.int32), one.view(-1).view(torch.int32)), "0-dim"


if __name__ == "__main__":  # the interpreter's run: TRITON_INTERPRET=1 python tests/halves_cases.py
    check("cpu")
    print("halves ok")
