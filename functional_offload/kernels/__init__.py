"""Kernels: what runs an optimizer's math on the host.

``work`` is what a host kernel is handed (chunks of pieces, claimed block by block) and the
queue protocol its worker threads run in; ``native`` builds the C++ queue and element-wise math
(``csrc/``: element types, per-optimizer math, the optimizer-agnostic queue) and hands the
executor a :class:`~functional_offload.kernels.native.NativeKernel` per op; ``host`` picks the
native kernel or a torch one for a run, from the optimizer's spec.
"""
