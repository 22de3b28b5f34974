r"""AdamW on a split master with block-wise 8-bit moments on a CUDA device, in one pass (a
Triton kernel): what the device math does in six (the master joined, the moments dequantized,
the grad cast, torch's fused AdamW, the moments quantized, the master split), with their bits.

Each program takes :data:`~functional_offload.kernels.blockwise_cuda.ROWS` blocks of 256
elements. The master's halves are joined and split as
:mod:`~functional_offload.kernels.remainder_cuda` does, the moments dequantized and quantized
as :mod:`~functional_offload.kernels.blockwise_cuda` does, and the step between them is torch's
fused AdamW kernel's (``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, ``adam_math``): fp32
throughout, its hyperparameters rounded to fp32, the moments as linear interpolations in fused
multiply-adds,

.. math::

    \theta &\leftarrow \operatorname{fma}(-(\eta\otimes\lambda), \theta, \theta), \\
    m &\leftarrow \operatorname{fma}(\beta_1, m, \operatorname{fma}(-\beta_1, g, g)), \qquad
    v \leftarrow \operatorname{fma}(\beta_2, v, \operatorname{fma}(-\beta_2, g\otimes g,
    g\otimes g)), \\
    d &= \sqrt{v} \oslash c_2 \oplus \epsilon, \qquad
    \theta \leftarrow \theta \ominus (s \otimes m) \oslash d

(each operation rounded to nearest; the kernel runs with no other contraction into fused
multiply-adds). :math:`c_2 = \sqrt{1 - \beta_2^t}` and :math:`s = \eta / (1 - \beta_1^t)` are
computed as that kernel computes them, by torch's CUDA ``pow``, ``sqrt`` and division on the
device, so their bits are its bits. torch has changed that kernel's arithmetic between
releases (its hyperparameters were fp64 in earlier ones), so :func:`agrees` checks, once per
device, that the installed torch gives these bits. Used by
:func:`~functional_offload.optimizers.adam.fused_stored` where it agrees, Triton imports and
the leaf's tensors are contiguous on one CUDA device; elsewhere the six passes run.
"""

from __future__ import annotations

import torch

from functional_offload.kernels import blockwise, blockwise_cuda, remainder, remainder_cuda
from functional_offload.kernels.triton_gpu import launch, takes, tl, triton

__all__ = ["available", "agrees", "corrections", "adamw_split_q8"]

available = takes  # whether the kernel takes these tensors

if triton is not None:
    @triton.jit
    def _adamw(hi, lo, grad, mu, nu, mu_values, mu_mids, mu_search, nu_values, nu_mids,
               nu_search, n, blocks, mu_zero, nu_zero, corrections, lr: tl.float32, weight_decay: tl.float32,
               beta1: tl.float32, beta2: tl.float32, eps: tl.float32, DECAY: tl.constexpr,
               ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, 256)
        at = rows[:, None] * 256 + cols[None, :]
        inside = at < n
        p = remainder_cuda.joined(tl.load(hi + at, mask=inside, other=0).to(tl.int32) & 0xFFFF,
                                  tl.load(lo + at, mask=inside, other=0).to(tl.int32) & 0xFFFF)
        g = tl.load(grad + at, mask=inside, other=0.0).to(tl.float32)
        m = blockwise_cuda.dequantized_rows(mu, mu_values, rows, cols, n)
        v = blockwise_cuda.dequantized_rows(nu, nu_values, rows, cols, n)
        step_size = tl.load(corrections)
        bc2_sqrt = tl.load(corrections + 1)
        # torch's fused AdamW (fused_adam_utils.cuh, adam_math), operation for operation
        if DECAY:
            p = tl.fma(-(lr * weight_decay), p, p)
        m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
        gg = g * g
        v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        # zero past the moments' end, as their quantizer pads
        blockwise_cuda.quantize_rows(tl.where(inside, m, 0.0), mu, mu_mids, mu_search, mu_zero,
                                     rows, cols, blocks)
        blockwise_cuda.quantize_rows(tl.where(inside, v, 0.0), nu, nu_mids, nu_search, nu_zero,
                                     rows, cols, blocks)
        high, low = remainder_cuda.halves(p)
        tl.store(hi + at, high.to(tl.int16), mask=inside)
        tl.store(lo + at, low.to(tl.int16), mask=inside)


_last: tuple = (None, None)  # (key, corrections) of the latest step: one per step, not per leaf


def corrections(lr: float, beta1: float, beta2: float, step: int,
                device: torch.device) -> torch.Tensor:
    r"""``[s, c2]`` (fp32, on ``device``): the step size :math:`\eta / (1 - \beta_1^t)` and
    :math:`\sqrt{1 - \beta_2^t}`, computed as torch's fused AdamW computes them (fp32 ``pow``
    of the fp32 hyperparameters, ``sqrt`` and division, by torch's kernels on ``device``), on
    the current stream, without a host sync. Reused by the leaves of one step on one stream
    (not while a CUDA graph is captured)."""
    global _last
    cuda = device.type == "cuda"
    stream = torch.cuda.current_stream(device) if cuda else None
    key = (device, None if stream is None else stream.cuda_stream,
           *(float(x).hex() for x in (lr, beta1, beta2)), step)  # hex: -0.0 is not 0.0
    last = _last
    if last[0] == key:
        return last[1]
    hyper = torch.full((3,), lr, dtype=torch.float32, device=device)
    hyper[1].fill_(beta1)
    hyper[2].fill_(beta2)
    c = 1 - torch.pow(hyper[1:], torch.full((), float(step), dtype=torch.float32, device=device))
    out = torch.stack([torch.div(hyper[0], c[0]), torch.sqrt(c[1])])
    if not (cuda and torch.cuda.is_current_stream_capturing()):
        _last = (key, out)
    return out


def adamw_split_q8(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, mu: torch.Tensor,
                   nu: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, step: int) -> None:
    """One AdamW step of a leaf in place: its split master's high halves ``hi`` and remainders
    ``lo`` (``int16``), its grad (bf16, fp16 or fp32; all three of one element count), its
    block-wise 8-bit moments ``mu`` (the signed map) and ``nu`` (the unsigned one). The
    hyperparameters as torch's fused AdamW takes them (``step``: 1 for the first update)."""
    n = grad.numel()
    sizes = (hi.numel(), lo.numel(), mu.numel(), nu.numel())
    if sizes != (n, n, blockwise.nbytes(n), blockwise.nbytes(n)):
        raise ValueError(f"adamw_split_q8: a grad of {n} elements needs halves of {n} elements "
                         f"and moments of {blockwise.nbytes(n)} bytes, got {sizes}")
    if n == 0:
        return
    blocks = mu.numel() // 260
    mu_map, nu_map = blockwise.map_on(True, grad.device), blockwise.map_on(False, grad.device)
    # the hyperparameters rounded to fp32 (to nearest) at once, as torch's kernel takes them
    scalars = torch.tensor([lr, weight_decay, beta1, beta2, eps], dtype=torch.float64)
    lr32, wd32, b1, b2, eps32 = scalars.float().tolist()
    args = (hi, lo, grad, mu, nu, mu_map.values, mu_map.mids, mu_map.search, nu_map.values,
            nu_map.mids, nu_map.search, n, blocks, mu_map.zero, nu_map.zero, corrections(lr, beta1, beta2, step, grad.device),
            lr32, wd32, b1, b2, eps32)
    launch(_adamw, (triton.cdiv(blocks, blockwise_cuda.ROWS),), grad.device, *args,
           DECAY=wd32 != 0, ROWS=blockwise_cuda.ROWS, num_warps=4,  # torch tests the fp32 value
           enable_fp_fusion=False)


_agreed: dict = {}  # device -> whether the probe agreed there


def agrees(device: torch.device) -> bool:
    """Whether this kernel gives the installed torch's fused AdamW bits on the CUDA ``device``:
    a probe the first time it is asked for a device (two leaves of about 4,000 elements, one for
    each of torch's loops, with and without weight decay, at step 3, with subnormal masters and
    second moments and an epsilon of 1e-30, so that a toolchain flushing subnormals changes
    the result; one host sync), the answer kept for the process. (Each way of rounding the decay, the moments or the bias
    corrections that differs from the kernel's changes hundreds of the probe's elements.)"""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _agreed:
        _agreed[device] = _probe(device)
    return _agreed[device]


def _probe(device: torch.device) -> bool:
    gen = torch.Generator().manual_seed(0)
    step = torch.full((), 3.0, device=device)
    same = []
    for n in (4096, 4099):  # torch's vectorized loop, then its element-wise one
        for wd in (0.0, 0.7):  # lr * wd large, not a power of two: the decay's rounding shows
            value = torch.randn(n, generator=gen) * torch.logspace(-4, 2, n)
            value[:16] *= 1e-36  # subnormal masters
            grad = torch.randn(n, generator=gen) * 1e-2
            grad[:256] *= 1e-18  # a block whose second moment goes subnormal (from zero)
            v0 = torch.rand(n, generator=gen) * 1e-6
            v0[:256] = 0.0
            value, grad = value.to(device), grad.to(device).bfloat16()
            mu = blockwise.quantize((torch.randn(n, generator=gen) * 1e-3).to(device), True)
            nu = blockwise.quantize(v0.to(device), False)
            want = value.clone()
            m, v = blockwise.dequantize(mu, n, True), blockwise.dequantize(nu, n, False)
            torch._fused_adamw_([want], [grad.float()], [m], [v], [], [step], lr=0.3,
                                beta1=0.9, beta2=0.999, weight_decay=wd, eps=1e-30,
                                amsgrad=False, maximize=False)
            halves = torch.empty((2, n), dtype=torch.int16, device=device)
            remainder.split_(halves, value)
            adamw_split_q8(halves[0], halves[1], grad, mu, nu, 0.3, 0.9, 0.999, 1e-30, wd, 3)
            same += [torch.equal(remainder.join(halves), want),
                     torch.equal(mu, blockwise.quantize(m, True)),
                     torch.equal(nu, blockwise.quantize(v, False))]
    return all(same)
