"""Params held in a quantized format: TransformerEngine's ``QuantizedTensor`` (fp8 and
block-scaled weights from ``fp8_model_init`` / ``quantized_model_init``).

Such a param holds its values in fewer bits than the math needs, so the optimizer always keeps
an fp32 master of it (made from ``param.dequantize(dtype=torch.float32)``), steps the master,
and writes each new value into the param with the param's own quantizer
(``param.quantize_(new)``: its scale, amax and scaling mode), as TransformerEngine's
``FusedAdam(master_weights=True)`` does. A quantized param is written whole, never in chunks:
its scale may depend on all its values. They are recognised by their methods (``quantize_`` and
``dequantize``), so TransformerEngine is not imported here.

At the bottom of the package: it imports nothing of it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["is_quantized", "memory_key", "same_memory", "writes_in_place", "write_params"]


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` holds its values in a quantized format written through ``quantize_``."""
    return callable(getattr(t, "quantize_", None)) and callable(getattr(t, "dequantize", None))


def memory_key(t: torch.Tensor) -> Optional[int]:
    """The address of the memory holding a quantized tensor's values: its first data tensor's
    (``get_data_tensors()``, as TransformerEngine's tensors give them), which its views and
    detached copies share; None where it gives none (then only the same object is the same
    tensor)."""
    get = getattr(t, "get_data_tensors", None)
    if callable(get):
        data = get()
        for x in data if isinstance(data, (tuple, list)) else (data,):
            if isinstance(x, torch.Tensor) and x.numel():
                return x.untyped_storage().data_ptr()
    return None


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold their values in the same memory (quantized tensors, which
    have no address of their own: by :func:`memory_key`, or identity)."""
    if is_quantized(a) or is_quantized(b):
        key = memory_key(a)
        return a is b or (key is not None and key == memory_key(b))
    return a.data_ptr() == b.data_ptr()


def writes_in_place(param: torch.Tensor) -> bool:
    """Whether new values may be written into ``param``'s memory piece by piece (a contiguous
    plain tensor); others take their new values whole, once they are all computed."""
    return not is_quantized(param) and param.is_contiguous()


def write_params(params: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> None:
    """Each new value (of its param's shape) into its param: quantized params through their
    quantizer (from ``new`` as it is, fp32 masters included), the others by one multi-tensor
    copy."""
    quantized = [is_quantized(p) for p in params]
    if not any(quantized):
        torch._foreach_copy_(params, news)
        return
    plain = [k for k, q in enumerate(quantized) if not q]
    if plain:
        torch._foreach_copy_([params[k] for k in plain], [news[k] for k in plain])
    for p, n, q in zip(params, news, quantized):
        if q:
            p.quantize_(n)
