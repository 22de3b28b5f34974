"""Element-wise optimizer math: a torch reference (any device), a one-pass CPU kernel, fused GPU.

Every backend computes the same update, written once in the optimizers' docstrings:
``reference`` mirrors ``torch.optim``'s single-tensor code op for op (bit-identical on the CPU);
``cpu`` is the one-pass native kernel for host-resident state; ``gpu`` calls torch's fused
multi-tensor kernels for device-resident state.
"""
