"""Steps that an interrupt cannot tear: signal handlers are held while the work runs.

Python runs signal handlers in the main thread, between any two bytecodes: Ctrl-C's
``KeyboardInterrupt``, or whatever a handler raises (a ``SystemExit``, torchrun's
``SignalException`` on SIGTERM). An update applying its math from the main thread could be cut
between two leaves. :func:`shielded` runs the work in the calling thread with every Python-level
handler replaced by one that only records the signal; once the work has returned, the handlers
are put back, and the caller, once its state is consistent again, hands the recorded signals to
them (:meth:`Held.deliver`): a handler that saves a checkpoint sees the step complete. Other
threads receive no signals: there the work simply runs.
"""

from __future__ import annotations

import _signal  # the C layer of `signal`: getsignal in 0.04 us a signal (signal's: 0.8 us)
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional, TypeVar

__all__ = ["Held", "shielded", "shielding"]

T = TypeVar("T")
_SIGNALS = sorted(int(s) for s in signal.valid_signals())
_local = threading.local()


def shielding() -> bool:
    """Whether the calling thread is running work of :func:`shielded`."""
    return getattr(_local, "shielded", False)


class Held:
    """The Python-level signal handlers of this process, replaced by :attr:`record` between
    :meth:`take` and :meth:`give_back` (main thread only), and the signals that arrived."""

    def __init__(self) -> None:
        self.handlers: dict[int, Any] = {}
        self.arrived: list[tuple[int, Optional[FrameType]]] = []
        self.record = self._record  # one bound method: compared by identity
        self.raised: Optional[BaseException] = None  # by a handler not yet replaced

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        self.arrived.append((signum, frame))

    def take(self) -> None:
        while True:  # a handler not yet replaced may raise meanwhile: kept, and go on
            try:
                for s, h in zip(_SIGNALS, map(_signal.getsignal, _SIGNALS)):
                    if callable(h) and h is not self.record:
                        self.handlers[s] = h
                        _signal.signal(s, self.record)
                return
            except BaseException as e:  # noqa: BLE001 - raised again by deliver
                self.raised = self.raised or e

    def give_back(self) -> None:
        """Put the handlers back (each signal that arrives from now on runs its own)."""
        left = list(self.handlers.items())
        while left:
            try:
                while left:
                    s, h = left[-1]
                    if _signal.getsignal(s) is self.record:  # (unless the work set its own)
                        _signal.signal(s, h)
                    left.pop()
            except BaseException as e:  # noqa: BLE001 - a handler put back ran at once
                self.raised = self.raised or e

    def deliver(self) -> None:
        """Run the handlers of the signals that arrived, in order; raise the first exception
        raised (the other handlers still run)."""
        raised, self.raised = self.raised, None
        while self.arrived:
            try:
                while self.arrived:
                    signum, frame = self.arrived.pop(0)
                    self.handlers[signum](signum, frame)
            except BaseException as e:  # noqa: BLE001 - raised below
                raised = raised or e
        if raised is not None:
            raise raised


def shielded(fn: Callable[..., T], *args: Any) -> tuple[T, Optional[Held]]:
    """``(fn(*args), held)``: run ``fn`` to its end whatever signals arrive meanwhile.

    ``held`` is None when no signal arrived; else the caller puts its state in order, then
    calls ``held.deliver()``, which runs their handlers and raises what they raise. An
    exception of ``fn`` is raised after the handlers ran (one a handler raised instead, with
    ``fn``'s as its cause). Nested calls, and calls outside the main thread, simply run.
    """
    if shielding():
        return fn(*args), None
    held = Held() if threading.current_thread() is threading.main_thread() else None
    _local.shielded = True
    try:
        if held is not None:
            held.take()
        result = fn(*args)
    except BaseException as error:
        late = _end(held)
        if late is not None:
            try:
                late.deliver()
            except BaseException as e:
                raise e from error
        raise
    return result, _end(held)


def _end(held: Optional[Held]) -> Optional[Held]:
    """Handlers back; ``held`` if a signal arrived (or a handler raised), else None."""
    _local.shielded = False
    if held is None:
        return None
    held.give_back()
    return held if held.arrived or held.raised is not None else None
