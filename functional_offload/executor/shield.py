"""Steps that an interrupt cannot tear: the work runs in a helper thread, the caller waits.

Python delivers ``KeyboardInterrupt`` (and a ``SystemExit`` from a signal handler) to the main
thread at any bytecode. An update that applies its math from the caller's thread could be cut
between two leaves. :func:`shielded` runs the work in a helper thread instead and waits for it;
an interrupt that arrives meanwhile is held until the work has returned, then handed back to the
caller, who re-raises it once the state is consistent.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, Optional, TypeVar

__all__ = ["shielded", "in_helper"]

T = TypeVar("T")
_PREFIX = "fo-step"
_pool = cf.ThreadPoolExecutor(max_workers=64, thread_name_prefix=_PREFIX)


def in_helper() -> bool:
    """Whether the calling thread is one of :func:`shielded`'s helpers."""
    return threading.current_thread().name.startswith(_PREFIX)


def shielded(fn: Callable[..., T], *args: Any) -> tuple[T, Optional[BaseException]]:
    """``(fn(*args), interrupt)``: run ``fn`` to its end whatever the caller's thread receives.

    ``interrupt`` is the first ``KeyboardInterrupt`` / ``SystemExit`` that arrived while waiting
    (None if none): the caller re-raises it after putting its state in order. An exception of
    ``fn`` is raised — the interrupt, if one came, instead, with ``fn``'s exception as cause.
    Called from a helper thread, ``fn`` simply runs there.
    """
    if in_helper():
        return fn(*args), None
    future = _pool.submit(fn, *args)
    interrupt: Optional[BaseException] = None
    while True:
        try:
            error = future.exception()
            break
        except (KeyboardInterrupt, SystemExit) as e:
            interrupt = interrupt or e
    if error is not None:
        if interrupt is not None:
            raise interrupt from error
        raise error
    return future.result(), interrupt
