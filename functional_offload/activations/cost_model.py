"""The activation planner's cost model: a measured step (:class:`Profile`) and a plan played
through it (:func:`simulate`) on the compute stream and the two copy streams.

Per layer group ``i``: ``keep`` holds ``a_i + k_i`` bytes from its forward to its backward;
``offload`` holds ``k_i`` and moves ``a_i`` down at ``r_d2h`` and back at ``r_h2d`` beside the
compute, which waits only when the copies fall behind; ``recompute`` holds the group's inputs
``x_i`` and runs its forward again in backward; ``recompute+offload`` moves those inputs too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence

from functional_offload.checks import is_int

__all__ = ["KEEP", "OFFLOAD", "RECOMPUTE", "RECOMPUTE_OFFLOAD", "Profile", "Simulation",
           "held_bytes", "inflight_bound", "simulate"]

KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD = "keep", "offload", "recompute", "recompute+offload"
_RECOMPUTING = (RECOMPUTE, RECOMPUTE_OFFLOAD)
_MOVING = (OFFLOAD, RECOMPUTE_OFFLOAD)


@dataclasses.dataclass
class Profile:
    """What a step costs, per layer group; :class:`ActivationOffload` measures it in a step.

    Example::

        p = fo.activations.Profile.uniform(24, saved_bytes=1 << 30, forward_s=3e-3,
                                           input_bytes=64 << 20, pcie_bytes_per_s=50e9)
        print(fo.activations.plan(p, budget_bytes=8 << 30))
    """

    saved_bytes: list[int]  # a_i: saved tensors that can move (>= min_bytes, not params)
    small_bytes: list[int]  # k_i: other saved tensors (stay on the device)
    input_bytes: list[int]  # x_i: the group's tensor arguments (what recomputing holds)
    forward_s: list[float]  # f_i: the group's forward time
    recomputable: list[bool]  # run through ``off.run``/``off.wrap`` (``group`` cannot recompute)
    other_fwd_bytes: list[int]  # memory outside the plan's control at each group's forward end
    other_bwd_bytes: list[int]  # ... during each group's backward (grads so far, workspace)
    other_head_bytes: int = 0  # ... between the forward's last group and the backward's first
    backward_ratio: float = 2.0  # a group's backward time / its forward time
    outside_s: float = 0.0  # forward + backward time outside groups (embeddings, loss head)
    d2h_bytes_per_s: float = 0.0  # 0: nothing can be offloaded (the CPU pass-through)
    h2d_bytes_per_s: float = 0.0
    peak_bytes: Optional[int] = None  # the measured step's peak above its start (GPU only)

    def __post_init__(self) -> None:
        """Refuse what no step measures, naming the field: per-group lists of unequal lengths
        (or none), negative byte counts of what the groups save or take (the memory outside them
        is counted from the step's start, and may be negative), recomputable flags that are not
        bools, negative or non-finite times and rates."""
        lists = ("saved_bytes", "small_bytes", "input_bytes", "forward_s", "recomputable",
                 "other_fwd_bytes", "other_bwd_bytes")
        n = len(self.saved_bytes)
        for name in lists:
            if len(getattr(self, name)) != n or n == 0:
                raise ValueError(f"Profile.{name} has {len(getattr(self, name))} entries; every "
                                 f"per-group list needs one per group (saved_bytes has {n}, at "
                                 "least 1)")
        for name in ("saved_bytes", "small_bytes", "input_bytes", "forward_s"):
            bad = next((x for x in getattr(self, name) if not 0 <= x < math.inf), None)
            if bad is not None:
                raise ValueError(f"Profile.{name} holds {bad!r}; it must be finite and >= 0")
        bad = next((x for x in self.recomputable if not isinstance(x, bool)), None)
        if bad is not None:
            raise ValueError(f"Profile.recomputable holds {bad!r}; it must hold bools")
        for name in ("outside_s", "d2h_bytes_per_s", "h2d_bytes_per_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"Profile.{name} is {getattr(self, name)!r}; it must be finite "
                                 "and >= 0")
        if not 0 < self.backward_ratio < math.inf:
            raise ValueError(f"Profile.backward_ratio is {self.backward_ratio!r}; it must be "
                             "finite and > 0")

    @classmethod
    def uniform(cls, num_groups: int, saved_bytes: int, forward_s: float, *, input_bytes: int = 0,
                head_bytes: int = 0, pcie_bytes_per_s: float = 0.0,
                backward_ratio: float = 2.0) -> "Profile":
        """A profile of ``num_groups`` identical groups and a loss head of ``head_bytes``."""
        if not is_int(num_groups) or num_groups < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
        n = num_groups
        return cls([saved_bytes] * n, [0] * n, [input_bytes] * n, [forward_s] * n, [True] * n,
                   [0] * n, [0] * n, head_bytes, backward_ratio, 0.0, pcie_bytes_per_s,
                   pcie_bytes_per_s)

    @property
    def num_groups(self) -> int:
        return len(self.saved_bytes)


class Simulation(NamedTuple):
    step_s: float  # forward + backward
    peak_bytes: int  # above the step's start, margin not included
    added_s: list[float]  # per group: recompute time, or the time compute waited for its copies


def _moved(p: Profile, i: int, d: str) -> int:
    return p.saved_bytes[i] if d == OFFLOAD else p.input_bytes[i] if d == RECOMPUTE_OFFLOAD else 0


def held_bytes(decision: str, saved: int, small: int, inputs: int) -> int:
    """Bytes a group holds on the device between its forward and its backward."""
    if decision == KEEP:
        return saved + small
    if decision == OFFLOAD:
        return small
    if decision == RECOMPUTE:
        return inputs
    if decision == RECOMPUTE_OFFLOAD:
        return 0
    raise ValueError(f"a decision is one of {KEEP!r}, {OFFLOAD!r}, {RECOMPUTE!r} or "
                     f"{RECOMPUTE_OFFLOAD!r}, got {decision!r}")


def inflight_bound(p: Profile, decisions: Sequence[str]) -> int:
    """The default ``max_inflight_bytes``: two groups' worth of the largest group moved."""
    return 2 * max([_moved(p, i, d) for i, d in enumerate(decisions)] + [0])


class _Copies:
    """The copies down of a simulated step, in copy order (the order they land in): when each
    lands, its bytes and group; ``first`` is the first not landed by the compute clock, and
    ``aloft`` the bytes of those still on their way."""

    def __init__(self) -> None:
        self.lands: list[float] = []
        self.sizes: list[int] = []
        self.groups: list[int] = []
        self.first = 0
        self.aloft = 0

    def add(self, when: float, nbytes: int, group: int) -> None:
        self.lands.append(when)
        self.sizes.append(nbytes)
        self.groups.append(group)
        self.aloft += nbytes

    def landed_by(self, c: float) -> list[int]:
        """Retire the copies landed by ``c``; the groups of those."""
        out = []
        while self.first < len(self.lands) and self.lands[self.first] <= c:
            self.aloft -= self.sizes[self.first]
            out.append(self.groups[self.first])
            self.first += 1
        return out

    def wait_below(self, c: float, bound: int, added: list[float]) -> float:
        """The forward waits for copies until at most ``bound`` bytes are aloft; the new clock
        (each wait charged to the group of the copy waited for)."""
        waiting, left = self.first, self.aloft
        while waiting < len(self.lands) and left > bound:
            added[self.groups[waiting]] += self.lands[waiting] - c
            c = self.lands[waiting]
            left -= self.sizes[waiting]
            waiting += 1
        return c


def _forward(p: Profile, moved: list[int], held: list[int], bound: int,
             copies: _Copies, added: list[float]) -> tuple[float, list[float], int, list[float]]:
    """The forward and the loss head: the clock, when each group's copy landed, the bytes
    resident, and the memory after each group and the head."""
    f, beta = p.forward_s, p.backward_ratio
    landed = [0.0] * p.num_groups
    c = x = 0.0  # compute clock; device-to-host stream clock
    resident, mem = 0, []
    for i in range(p.num_groups):
        start, c = c, c + f[i]
        if moved[i]:
            x = landed[i] = max(max(start, x) + moved[i] / p.d2h_bytes_per_s, c)
            copies.add(x, moved[i], i)
        copies.landed_by(c)
        c = copies.wait_below(c, bound, added)
        copies.landed_by(c)
        resident += held[i]
        mem.append(p.other_fwd_bytes[i] + resident + copies.aloft)
    c += p.outside_s / (1 + beta)
    copies.landed_by(c)
    mem.append(p.other_head_bytes + resident + copies.aloft)
    c += p.outside_s * beta / (1 + beta)
    return c, landed, resident, mem


def simulate(p: Profile, decisions: Sequence[str], *, max_inflight_bytes: Optional[int] = None,
             prefetch: int = 1) -> Simulation:
    """Play ``decisions`` (one per group) through the cost model: step time and peak memory.

    Example::

        p = fo.activations.Profile.uniform(8, saved_bytes=1 << 30, forward_s=3e-3)
        fo.activations.simulate(p, ["recompute"] * 8).peak_bytes  # 1 GiB: one group at a time
    """
    n, f, beta = p.num_groups, p.forward_s, p.backward_ratio
    if len(decisions) != n or any(d not in (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD)
                                  for d in decisions):
        raise ValueError(f"simulate takes one decision per group ({n}), each one of "
                         f"{[KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD]}; got {list(decisions)}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    if max_inflight_bytes is not None and not (is_int(max_inflight_bytes)
                                               and max_inflight_bytes >= 0):
        raise ValueError(f"max_inflight_bytes must be None or an int >= 0, got "
                         f"{max_inflight_bytes!r}")
    if p.d2h_bytes_per_s <= 0:  # nothing moves: offloading keeps, recompute+offload recomputes
        decisions = [{OFFLOAD: KEEP, RECOMPUTE_OFFLOAD: RECOMPUTE}.get(d, d) for d in decisions]
    moved = [_moved(p, i, d) for i, d in enumerate(decisions)]
    bound = 2 * max(moved + [0]) if max_inflight_bytes is None else max_inflight_bytes
    held = [held_bytes(d, p.saved_bytes[i], p.small_bytes[i], p.input_bytes[i])
            for i, d in enumerate(decisions)]
    added = [0.0] * n
    copies = _Copies()
    c, landed, resident, mem = _forward(p, moved, held, bound, copies, added)

    y, ready, direct = c, {}, set()  # host-to-device clock; when each reload is back
    reloaded = 0  # bytes of the groups in ready
    pending = copies.aloft  # not landed by c and not taken directly by backward

    def reload(j: int, now: float) -> None:
        nonlocal y, reloaded, pending
        if j in ready or not moved[j]:
            return
        reloaded += moved[j]
        if landed[j] > now:  # still on its way down: backward takes the source itself
            ready[j] = now
            direct.add(j)
            pending -= moved[j]
        else:
            y = ready[j] = max(now, y) + moved[j] / p.h2d_bytes_per_s
    used = 0  # bytes of the reloaded groups whose backward ran
    low = n  # groups low … n-1 have been considered for a reload (once is enough)
    for i in reversed(range(n)):
        for j in range(min(i, low - 1), max(i - prefetch - 1, -1), -1):
            reload(j, c)
        low = min(low, max(i - prefetch, 0))
        if ready.get(i, c) > c:
            added[i] += ready[i] - c
            c = ready[i]
        start = copies.first
        for k, g in enumerate(copies.landed_by(c)):
            if g not in direct:
                pending -= copies.sizes[start + k]
        resident -= held[i]
        own = p.saved_bytes[i] + p.small_bytes[i] + (
            p.input_bytes[i] if decisions[i] in _RECOMPUTING else 0)
        mine = moved[i] if i in ready else 0
        mem.append(p.other_bwd_bytes[i] + resident + own + reloaded - used - mine + pending)
        used += mine
        extra = f[i] if decisions[i] in _RECOMPUTING else 0.0
        added[i] += extra
        c += beta * f[i] + extra
    return Simulation(c, max(mem), added)
