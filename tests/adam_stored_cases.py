"""AdamW in one pass on a split master with block-wise 8-bit moments
(:mod:`functional_offload.kernels.adam_cuda`) against torch's fused AdamW kernel's arithmetic,
written out here in torch ops on the CPU (fp32 operations, fused multiply-adds where that kernel
has them, square roots rounded to nearest), bit for bit: leaves of 1 to 70,001 elements
(partial blocks), weight decay on, off and 0 in fp32, NaN, infinities, signed zeros and values
over eight decades in the master. ``test_remainder.py`` runs it in Triton's interpreter."""

from __future__ import annotations

import torch

from functional_offload.kernels import adam_cuda, blockwise, remainder


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64).float()


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once: the product is exact in fp64; the sum is rounded to
    fp64 by rounding to odd (its error found by TwoSum), which rounded again to fp32 is the
    correctly rounded sum."""
    x, y = a.double() * b.double(), c.double()
    s = x + y
    t = s - x
    err = (x - (s - t)) + (y - t)
    even = (s.view(torch.int64) & 1) == 0
    towards = torch.where(err > 0, float("inf"), -float("inf")).double()
    odd = torch.where(torch.isfinite(err) & (err != 0) & even, torch.nextafter(s, towards), s)
    return odd.float()


def expected(value: torch.Tensor, g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor,
             lr: float, b1: float, b2: float, eps: float, wd: float, step: int) -> tuple:
    """The new value and moments (fp32) as torch's fused CUDA kernel computes them."""
    p = value.clone()
    g = g.float()
    lr_, b1_, b2_ = _f32(lr), _f32(b1), _f32(b2)
    m = blockwise.dequantize(mu, p.numel(), True)
    v = blockwise.dequantize(nu, p.numel(), False)
    if _f32(wd) != 0:  # torch tests the fp32 value
        p = _fma(-(lr_ * _f32(wd)), p, p)
    m = _fma(b1_, m, _fma(-b1_, g, g))
    gg = g * g
    v = _fma(b2_, v, _fma(-b2_, gg, gg))
    t = torch.tensor(float(step))
    step_size = lr_ / (1 - torch.pow(b1_, t))
    bc2_sqrt = (1 - torch.pow(b2_, t)).double().sqrt().float()
    denom = v.double().sqrt().float() / bc2_sqrt + _f32(eps)
    return p - (step_size * m) / denom, m, v


def check(device: str) -> None:
    g0 = torch.Generator().manual_seed(0)
    for n in (1, 255, 256, 257, 5000, 70001):
        for wd in (0.0, 0.1, 1e-46):  # 1e-46: not 0, but 0 in fp32 (no decay)
            value = torch.randn(n, generator=g0) * torch.logspace(-3, 5, n)
            value[:5] = torch.tensor([float("nan"), 0.0, -0.0, float("inf"), -float("inf")])[:n]
            grad = (torch.randn(n, generator=g0) * 1e-2).bfloat16()
            mu = blockwise.quantize(torch.randn(n, generator=g0) * 1e-3, True)
            nu = blockwise.quantize(torch.rand(n, generator=g0) * 1e-6, False)
            master = remainder.split_(torch.empty((2, n), dtype=torch.int16), value)
            want, want_m, want_v = expected(remainder.join(master), grad, mu, nu, 1e-3, 0.9,
                                            0.95, 1e-8, wd, 7)
            want_bits = remainder.split_(torch.empty((2, n), dtype=torch.int16), want)
            on = master.to(device)
            mu_, nu_ = mu.to(device), nu.to(device)
            adam_cuda.adamw_split_q8(on[0], on[1], grad.to(device), mu_, nu_, 1e-3, 0.9, 0.95,
                                     1e-8, wd, 7)
            assert torch.equal(on.cpu(), want_bits), (n, wd, "master")
            assert torch.equal(mu_.cpu(), blockwise.quantize(want_m, True)), (n, wd, "mu")
            assert torch.equal(nu_.cpu(), blockwise.quantize(want_v, False)), (n, wd, "nu")


if __name__ == "__main__":  # the interpreter's run: TRITON_INTERPRET=1 python tests/adam_stored_cases.py
    check("cpu")
    print("adam stored ok")
