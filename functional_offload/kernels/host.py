"""The host kernel of a run: the native op of an optimizer's spec, or its torch reference.

Both compute a piece's new value and moments (in place, or into ``targets`` so the old state
stays intact until the caller commits), then the param in the grad's dtype (``out``) — or, for a
piece with a look-ahead (``ahead``), the look-ahead's base to ``out`` (a bf16 one split, its
residual to ``residual``: :func:`~functional_offload.kernels.remainder.split_base`) and its rate
to ``ahead`` — and the EMA of the value. The torch kernel runs the spec's reference math on each
claimed block.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from functional_offload.kernels import blockwise, native
from functional_offload.kernels.remainder import is_split, join_halves, split_base, split_halves
from functional_offload.kernels.work import Kernel, Work

__all__ = ["host_kernel", "torch_kernel"]

_NATIVE_STATE = (torch.float32, torch.bfloat16, torch.uint8)


def torch_kernel(reference: Callable[..., None], signed: Sequence[bool],
                 ahead: Optional[Callable[..., tuple[list, list]]] = None) -> Callable[[Work], None]:
    """A Python kernel running ``reference(values, grads, [moment lists], hyper)`` per block;
    ``signed``: per moment, its block-wise map (:mod:`~functional_offload.kernels.blockwise`);
    ``ahead(values, [moment lists], hyper, next_hyper) -> (bases, rates)``: the look-ahead."""

    @torch.no_grad()
    def kernel(work: Work) -> None:
        for p, a, b in work.claims():
            state = [blockwise.part(x, a, b) for x in p.state]
            if p.targets:
                dst = [blockwise.part(x, a, b) for x in p.targets]
                for d, s in zip(dst, state):
                    d.copy_(s)
                state = dst
            split = is_split(state[0])  # (high half, remainder, moments...)
            value = join_halves(state[0], state[1]) if split else state[0]
            stored = state[2 if split else 1:]
            moments = [blockwise.dequantize(m, b - a, sg) if blockwise.is_blockwise(m) else m
                       for m, sg in zip(stored, signed)]
            reference([value], [p.grad[a:b]], [[m] for m in moments], p.hyper)
            if p.ahead is not None:  # from the moments as stored (8-bit: before quantizing)
                (base,), (rate,) = ahead([value], [[m] for m in moments], p.hyper, p.ahead_hyper)
                if p.residual is None:
                    p.out[a:b].copy_(base)
                else:
                    split_base(base, p.out[a:b], p.residual[a:b])
                p.ahead[a:b].copy_(rate)
            for q, m, sg in zip(stored, moments, signed):
                if blockwise.is_blockwise(q):
                    blockwise.quantize_into(m, q, sg)
            if split:
                split_halves(value, state[0], state[1])
            if p.out is not None and p.ahead is None:
                p.out[a:b].copy_(state[0].view(torch.bfloat16) if split else value)
            if p.ema is not None:
                if p.ema_target is None:
                    p.ema[a:b].lerp_(value, 1 - p.ema_decay)
                else:
                    torch.lerp(p.ema[a:b], value, 1 - p.ema_decay, out=p.ema_target[a:b])

    return kernel


def _native_fits(state: Sequence[torch.Tensor]) -> bool:
    """Whether the native op takes this state: an fp32 or split value, moments of one format
    among fp32, bf16 and block-wise 8-bit."""
    moments = state[2:] if is_split(state[0]) else state[1:]
    return ((is_split(state[0]) or state[0].dtype == torch.float32)
            and all(m.dtype in _NATIVE_STATE for m in moments) and len({m.dtype for m in moments}) <= 1)


def host_kernel(op: Optional[str], scalars: Optional[Callable[[Any], Sequence[float]]],
                reference: Callable[..., None], signed: Sequence[bool],
                states: Sequence[Sequence[torch.Tensor]], mode: str,
                ahead: Optional[Callable[..., tuple[list, list]]] = None,
                ahead_scalars: Optional[Callable[[Any, Any], Sequence[float]]] = None) -> Kernel:
    """The kernel for host leaves whose state tensors are ``states`` (value, moments...);
    ``signed``: per moment, whether it may be negative (its block-wise 8-bit map); ``ahead``
    and ``ahead_scalars``: the spec's look-ahead (:class:`~functional_offload.optimizers.spec.
    OptimizerSpec`), or None.

    ``mode``: ``"native"`` (raise if it cannot run), ``"torch"``, or ``"auto"`` (native when
    the op is registered, the build exists and every leaf has an fp32 or split value
    (:mod:`~functional_offload.kernels.remainder`) and fp32, bf16 or block-wise 8-bit
    (:mod:`~functional_offload.kernels.blockwise`) moments of one format; torch otherwise). A
    split value's state is (high half, remainder, moments...).
    """
    if mode == "torch" or op is None:
        if mode == "native":
            raise RuntimeError("cpu_kernel='native' but this optimizer has no native op; use 'auto'")
        return torch_kernel(reference, signed, ahead)
    mod = native.module()
    fits = all(_native_fits(st) for st in states)
    if mod is not None and fits:
        return native.NativeKernel(mod, op, scalars, signed, ahead_scalars)
    if mode == "native":
        raise RuntimeError("cpu_kernel='native' but the native CPU kernel " +
                           ("could not be built here (needs a C++ compiler and ninja)" if mod is None
                            else "takes fp32 values and moments of one format") + "; use 'auto'")
    return torch_kernel(reference, signed, ahead)
