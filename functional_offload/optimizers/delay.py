"""When a delayed update (``delayed=True``) runs exact steps instead: :class:`Delay`.

A delayed step returns before the host step is done; the next forward reads the params of one
update earlier, so its gradient is one step stale. Staleness costs most where the updates are
large and change fast: at the start of training (the learning rate warms up, the loss falls
steeply) and where the gradient norm is high enough for a clip to scale it (early steps, loss
spikes). An *exact* step lands its params before ``update`` returns, as without ``delayed``
(bit for bit the same values), and costs the host step's time on the training loop.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

__all__ = ["Delay", "as_delay"]


class Delay(NamedTuple):
    """The policy of ``delayed=...``: which updates are exact (land before ``update`` returns).

    Attributes:
      warmup: the first ``warmup`` updates of a state are exact (counted by the state's step
        count, so a resumed run goes on where it was).
      exact_when_clipped: an update whose gradients a :func:`~functional_offload.
        clip_by_global_norm` in the same :func:`~functional_offload.chain` scales is exact. On a
        freshly initialised model this keeps the steps exact until the gradient norm settles
        below the clip, and later catches the spikes. It reads the clip's factor on the host:
        one device synchronisation per update, once the backward is done.

    ``delayed=True`` is ``Delay()``; ``Delay(warmup=0, exact_when_clipped=False)`` delays every
    step. Staleness still costs AdamW once the clip stops scaling: on a 117 M GPT-style model
    (2,000 steps, a 6e-4 peak) the default ended 0.30 above the exact run's validation loss,
    every step delayed 1.19 (docs/performance.md); check the curve of your own run.

    Example::

        opt = fo.chain(fo.clip_by_global_norm(1.0),
                       fo.adamw(3e-4, delayed=fo.Delay(warmup=200)))
    """

    warmup: int = 100
    exact_when_clipped: bool = True


def as_delay(delayed: Union[bool, Delay]) -> Optional[Delay]:
    """The policy of a ``delayed`` option (``None``: not delayed); ``TypeError``/``ValueError``
    naming the option for anything else."""
    if delayed is True:
        return Delay()
    if delayed is False:
        return None
    if not isinstance(delayed, Delay):
        raise TypeError(f"delayed must be True, False or a functional_offload.Delay, got {delayed!r}")
    if type(delayed.warmup) is not int or delayed.warmup < 0:
        raise ValueError(f"Delay.warmup must be an int >= 0, got {delayed.warmup!r}")
    if not isinstance(delayed.exact_when_clipped, bool):
        raise TypeError(f"Delay.exact_when_clipped must be True or False, got "
                        f"{delayed.exact_when_clipped!r}")
    return delayed
