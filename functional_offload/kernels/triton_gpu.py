"""What the one-pass Triton kernels of the state formats (``blockwise_cuda``, ``remainder_cuda``)
share: Triton where it imports, and which tensors they take."""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - not installed (a CPU-only torch), or failing to import
    triton = tl = None

__all__ = ["triton", "tl", "takes", "launch"]


def takes(*tensors: torch.Tensor) -> bool:
    """Whether Triton imports and every tensor is contiguous on one CUDA device."""
    return (triton is not None and len({t.device for t in tensors}) == 1
            and all(t.is_cuda and t.is_contiguous() for t in tensors))


def launch(kernel: Any, grid: tuple, device: torch.device, *args: Any, **options: Any) -> None:
    """``kernel[grid](*args, **options)`` on ``device`` (Triton launches on the current CUDA
    device); on a CPU device as Triton's interpreter runs it (``TRITON_INTERPRET=1``: the
    tests' way to run the kernels without a GPU)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **options)
    else:
        kernel[grid](*args, **options)
