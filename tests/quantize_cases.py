"""Block-wise 8-bit moments quantized and dequantized by
:mod:`functional_offload.kernels.blockwise_cuda` against the torch ops of
:mod:`functional_offload.kernels.blockwise` (on the CPU), byte for byte, for both maps: every
midpoint, its fp32 neighbours and the map's values with absmax 1 (where the kernel's arithmetic
search hands over to its midpoint search), values over 40 decades of both signs, blocks holding
a NaN, an infinity, only zeros or only subnormals, a last block of 113 elements.
``test_remainder.py`` runs it in Triton's interpreter, ``test_blockwise.py`` on a GPU (its
values)."""

from __future__ import annotations

import torch

from functional_offload.kernels import blockwise, blockwise_cuda


def values(signed: bool) -> torch.Tensor:
    """The cases' values (fp32, on the CPU)."""
    m = blockwise.map_on(signed, torch.device("cpu"))
    mids = m.mids[:-1]
    near = torch.cat([mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1), m.values])
    if signed:
        near = torch.cat([near, -near])
    near = torch.nn.functional.pad(near, (0, -near.numel() % 255)).view(-1, 255)
    near = torch.cat([torch.ones(near.shape[0], 1), near], 1).view(-1)  # absmax 1
    g = torch.Generator().manual_seed(0)
    wide = 10 ** (torch.rand(70_001, generator=g) * 40 - 38) * torch.randn(70_001, generator=g).sign()
    special = torch.randn(4 * 256, generator=g)
    special[5], special[300] = float("nan"), float("inf")
    special[512:768] = 0.0
    special[768:] = torch.rand(256, generator=g) * 1e-39  # subnormal
    x = torch.cat([near, special, wide])
    return x if signed else x.abs()


def check(device: str) -> None:
    """Assert the kernels on ``device`` give the torch ops' bytes and values on the CPU."""
    for signed in (True, False):
        x = values(signed)
        want = blockwise.quantize(x, signed)
        m = blockwise.map_on(signed, torch.device(device))
        got = torch.zeros_like(want, device=device)
        blockwise_cuda.quantize_into(x.to(device), got, m)
        differ = (got.cpu() != want).nonzero().view(-1)
        assert differ.numel() == 0, (signed, differ[:8].tolist())
        back = torch.empty(x.numel(), device=device)
        blockwise_cuda.dequantize_into(want.to(device), m.values, back)
        torch.testing.assert_close(back.cpu(), blockwise.dequantize(want, x.numel(), signed),
                                   rtol=0, atol=0, equal_nan=True)


if __name__ == "__main__":  # the interpreter's run: TRITON_INTERPRET=1 python tests/quantize_cases.py
    check("cpu")
    print("quantize ok")
