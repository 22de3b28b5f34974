"""Meeting users where they are: a ``torch.optim`` adapter and Megatron/NeMo option mapping."""

from functional_offload.compat.megatron import megatron_weight_decay_mask, optimizer_from_megatron
from functional_offload.compat.torch_optim import TorchOptimizer

__all__ = ["TorchOptimizer", "megatron_weight_decay_mask", "optimizer_from_megatron"]
