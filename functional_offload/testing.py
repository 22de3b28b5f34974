"""Fault injection for tests of training loops (yours and ours).

The host step runs chunk by chunk (:mod:`functional_offload.executor`); these context managers
hook it before each chunk's kernel starts, whatever kernel runs (native or torch) and however
the step was started (``update``, :func:`~functional_offload.stream`, ``delayed=True``,
:class:`~functional_offload.TorchOptimizer`). Use them to check that your loop recovers from a
failed step the way the library's contract says (see docs/api.md, "Failures").

Example::

    import functional_offload as fo
    from functional_offload.testing import fail_host_kernel

    with fail_host_kernel(after=1):
        try:
            params, state = opt.update(grads, state)
        except fo.HostStepError:
            # the params come back with the optimizer's state where it keeps their masters;
            # params stepped in place (fp32, no master) come from the model's checkpoint
            model.load_state_dict(torch.load("ckpt/model.pt"))
            state = fo.load("ckpt/opt.safetensors", like=opt.init(params))
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Iterator, Optional, Sequence, Union

from functional_offload.executor import faults

__all__ = ["fail_host_kernel", "slow_host_kernel"]


@contextlib.contextmanager
def fail_host_kernel(after: int = 0, exc: Union[BaseException, type[BaseException]] = RuntimeError,
                     times: int = 1, leaves: Optional[Sequence[str]] = None) -> Iterator[None]:
    """Make host chunks fail: the first ``after`` chunks started inside the block run, then the
    next ``times`` chunks raise ``exc`` instead of running (a class is instantiated with a message
    naming the chunk's leaves). Chunks are counted across all runs, in the order they start;
    with ``leaves`` (a list of paths, not one string), only chunks holding one of them count
    (the others run; a chunk of small leaves packed into one run holds each of them); a
    ``UserWarning`` at the block's end says so where chunks ran but none held one of them.

    A failure after some chunks were applied leaves a partially applied step: the step raises
    (:class:`~functional_offload.HostStepError` naming the leaves, with ``exc`` as its cause; a
    ``KeyboardInterrupt`` or ``SystemExit`` as itself) and the state is marked failed.
    """
    if after < 0 or times < 1:
        raise ValueError(f"after must be >= 0 and times >= 1, got after={after}, times={times}")
    if isinstance(leaves, str):
        raise TypeError(f"leaves must be a list of paths, got the string {leaves!r} "
                        f"(use leaves=[{leaves!r}])")
    named = None if leaves is None else frozenset(leaves)
    seen, ran = [0], [0]
    lock = threading.Lock()

    def hook(_: int, paths: list[str]) -> None:
        with lock:
            ran[0] += 1
            if named is not None and named.isdisjoint(paths):
                return
            k = seen[0]
            seen[0] += 1
        if after <= k < after + times:
            raise exc(f"injected failure of the host kernel on {', '.join(paths)}") \
                if isinstance(exc, type) else exc

    faults.add(hook)
    try:
        yield
    finally:
        faults.remove(hook)
        if named is not None and ran[0] and not seen[0]:
            warnings.warn(f"fail_host_kernel(leaves={sorted(named)}): {ran[0]} host chunks ran, "
                          "none holding one of these leaves (check the paths)", stacklevel=3)


@contextlib.contextmanager
def slow_host_kernel(seconds: float) -> Iterator[None]:
    """Delay every host chunk started inside the block by ``seconds`` before its kernel runs
    (to make a step last long enough to interrupt it, or to race it with other calls)."""
    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")

    def hook(_: int, __: list[str]) -> None:
        time.sleep(seconds)

    faults.add(hook)
    try:
        yield
    finally:
        faults.remove(hook)
