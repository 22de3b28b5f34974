"""What the one-pass Triton kernels of the state formats (``blockwise_cuda``, ``remainder_cuda``)
share: Triton where it imports, and which tensors they take."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - not installed (a CPU-only torch), or failing to import
    triton = tl = None

__all__ = ["triton", "tl", "takes"]


def takes(*tensors: torch.Tensor) -> bool:
    """Whether Triton imports and every tensor is contiguous on one CUDA device."""
    return (triton is not None and len({t.device for t in tensors}) == 1
            and all(t.is_cuda and t.is_contiguous() for t in tensors))
