"""How a delayed update (``delayed=True``) keeps its gradients current: :class:`Delay`.

A delayed step returns before the host step is done, so the next forward cannot read the params
that step computes: left as they are, its gradient is taken at the params of one update earlier
(one step stale). Staleness costs AdamW much: with the delay alone, a small GPT-style model on
real text ends 0.6 above ``torch.optim.AdamW``'s validation loss (docs/performance.md), because
a step that answers the gradient of the step before oscillates where an exact one is still
stable.

The *look-ahead* removes it. With the new master, moments and the next step's hyperparameters,
the host step also computes, per element, two values from which the next step's result follows
for any gradient ``g`` — for SGD ``base - rate * g``; for AdamW the same with the rate taken
over the next step's denominator, which the device completes with ``g**2``, and the base's
momentum term brought over to that denominator through the params the device holds (those the
last look-ahead gave). Both go up in place
of the param (two values per element where one went; a bf16 base with a byte of its rounding
residual, so that the landing rounds once, as the step rounds its master), and when the next
``update`` lands the step it sets each param from them and that update's own (clipped)
gradients, on the device. The forward after it then reads, to within the rounding (and, for
Adam, a fraction of the last landing's error), the params the step it feeds will apply its
gradient to — as without ``delayed``. The master, the moments and
every update's math stay exact; only the params the forwards read are predicted. A flush, a
checkpoint or a param without a gradient lands the exact params (each master rounded), as
without the look-ahead. With hyperparameters that a scheduler writes into the state at each
step (``fo.TorchOptimizer``'s param groups, ``fo.inject_hyperparams``) the next step's are not
known yet: its look-ahead takes this step's (a warm-up from 0 then lands no change once). A
schedule that ends with a step (raises at the next count) leaves that step no look-ahead.

An *exact* step lands its params before ``update`` returns, as without ``delayed`` (bit for bit
the same values), and costs the host step's time on the training loop.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

__all__ = ["Delay", "as_delay"]


class Delay(NamedTuple):
    """The policy of ``delayed=...``: the look-ahead, and which updates are exact (land before
    ``update`` returns).

    Attributes:
      lookahead: the params the next forward reads are the next step's values for its own
        gradients (see the module), not the last step's. SGD's and Lion's are exact but for
        rounding; Adam's and AdamW's but for a fraction (1 - d/d', d and d' the two steps'
        denominators) of the error of the params the last forward read. Params a step
        behind (when the first delayed update's step lands, or that of the first update
        after a flush, a save or an exact one) are set from the new masters first. Costs a
        second value and the base's residual per element through the host step's copies up
        (3 bytes per bf16 param, 4 per fp32 one: pinned writes, PCIe and device memory) and
        element-wise ops on the device per update; nothing in the state or its checkpoints.
      warmup: the first ``warmup`` updates of a state are exact (counted by the state's step
        count, so a resumed run goes on where it was).
      exact_when_clipped: an update whose gradients a :func:`~functional_offload.
        clip_by_global_norm` in the same :func:`~functional_offload.chain` scales is exact. It
        reads the clip's factor on the host: one device synchronisation per update, once the
        backward is done.

    ``delayed=True`` is ``Delay()``: every update delayed, each with its look-ahead. An exact
    step leaves no look-ahead, so the update after it trains on one stale gradient: with the
    look-ahead, exact steps cost more than they give. On a small GPT-style model on real text
    (docs/performance.md; means over five seeds, three for the other policies) every step
    delayed with the look-ahead ended 0.001 above ``torch.optim.AdamW``'s validation loss (our
    exact run: -0.007); without a look-ahead, every step stale 0.63, and
    ``Delay(lookahead=False, warmup=100, exact_when_clipped=True)`` 0.12. On a 117 M one over
    2,000 steps (one seed) the look-ahead ended 0.007 below it (our exact run: -0.017), every
    step stale 1.19 above, ``Delay(lookahead=False, warmup=100, exact_when_clipped=True)``
    0.30 above.

    Example::

        opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(3e-4, delayed=True))
        stale = fo.adamw(3e-4, delayed=fo.Delay(lookahead=False, warmup=100,
                                                exact_when_clipped=True))
    """

    warmup: int = 0
    exact_when_clipped: bool = False
    lookahead: bool = True


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
    for name in ("exact_when_clipped", "lookahead"):
        if not isinstance(getattr(delayed, name), bool):
            raise TypeError(f"Delay.{name} must be True or False, got {getattr(delayed, name)!r}")
    return delayed
