"""Hooks the executor calls before each chunk's kernel may start (fault injection for tests).

:mod:`functional_offload.testing` builds its context managers on these; nothing else uses them.
A hook is called from the thread that lands the run's chunks (its lander, or the thread
running a one-chunk run alone) with the chunk's index in its run and the paths of the params
tree's leaves it holds (each member of a packed run of small leaves), after the previous chunk
of the run completed (the GPU engine's: before it queues the chunk, the earlier ones queued);
what it raises fails the run at that chunk (earlier chunks stay applied), what it sleeps
delays the chunk.
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["ChunkHook", "add", "remove", "active", "before_chunk"]

ChunkHook = Callable[[int, list[str]], None]

_hooks: list[ChunkHook] = []
_lock = threading.Lock()


def add(hook: ChunkHook) -> None:
    with _lock:
        _hooks.append(hook)


def remove(hook: ChunkHook) -> None:
    with _lock:
        _hooks.remove(hook)


def active() -> bool:
    return bool(_hooks)


def before_chunk(index: int, paths: list[str]) -> None:
    with _lock:
        hooks = list(_hooks)
    for hook in hooks:
        hook(index, paths)
