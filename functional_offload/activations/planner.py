"""Which layer groups to keep, offload or recompute so that a step's peak memory fits a budget.

The cost model, per layer group ``i`` (numbers from a measured step, :class:`Profile`):

* ``keep``: no time; holds ``a_i + k_i`` bytes (what the group saves for backward: movable tensors
  and small ones) from its forward to its backward.
* ``offload``: holds ``k_i``; ``a_i`` bytes go to the host at ``r_d2h`` once the group has run and
  come back at ``r_h2d`` ahead of its backward, beside the compute; the compute waits only when
  the copies fall behind (forward: over ``max_inflight_bytes`` still in flight; backward: a group
  not back yet).
* ``recompute``: holds the group's inputs ``x_i``; its forward (``f_i``) runs again in backward.
* ``recompute+offload``: as ``recompute``, with the inputs moved to the host (holds nothing).

:func:`simulate` plays a plan on the compute stream and the two copy streams and gives the step
time ``T`` and the memory at every phase ``p`` (each group's forward end, the loss head, each
group's backward)::

    M_p = other_p + sum of res_j over the groups j still held at p + bytes in flight_p + bytes reloaded_p

where ``other_p`` is what the plan does not control (the loss head, grads, workspace), measured.
The predicted peak is ``max_p M_p + margin``; :func:`plan` returns the plan of least ``T`` whose
peak fits the budget.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

__all__ = ["KEEP", "OFFLOAD", "RECOMPUTE", "RECOMPUTE_OFFLOAD", "Profile", "Plan", "plan",
           "simulate"]

KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD = "keep", "offload", "recompute", "recompute+offload"
_RECOMPUTING = (RECOMPUTE, RECOMPUTE_OFFLOAD)


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

    @classmethod
    def uniform(cls, num_groups: int, saved_bytes: int, forward_s: float, *, input_bytes: int = 0,
                head_bytes: int = 0, pcie_bytes_per_s: float = 0.0,
                backward_ratio: float = 2.0) -> "Profile":
        """A profile of ``num_groups`` identical groups and a loss head of ``head_bytes``."""
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
    return {KEEP: saved + small, OFFLOAD: small, RECOMPUTE: inputs, RECOMPUTE_OFFLOAD: 0}[decision]


def inflight_bound(p: Profile, decisions: Sequence[str]) -> int:
    """The default ``max_inflight_bytes``: two groups' worth of the largest group moved."""
    return 2 * max([_moved(p, i, d) for i, d in enumerate(decisions)] + [0])


def simulate(p: Profile, decisions: Sequence[str], *, max_inflight_bytes: Optional[int] = None,
             prefetch: int = 1) -> Simulation:
    """Play ``decisions`` (one per group) through the cost model: step time and peak memory.

    Example::

        p = fo.activations.Profile.uniform(8, saved_bytes=1 << 30, forward_s=3e-3)
        fo.activations.simulate(p, ["recompute"] * 8).peak_bytes  # 1 GiB: one group at a time
    """
    n, f, beta = p.num_groups, p.forward_s, p.backward_ratio
    if p.d2h_bytes_per_s <= 0:  # nothing moves: offloading keeps, recompute+offload recomputes
        decisions = [{OFFLOAD: KEEP, RECOMPUTE_OFFLOAD: RECOMPUTE}.get(d, d) for d in decisions]
    bound = inflight_bound(p, decisions) if max_inflight_bytes is None else max_inflight_bytes
    moved = [_moved(p, i, d) for i, d in enumerate(decisions)]
    held = [held_bytes(d, p.saved_bytes[i], p.small_bytes[i], p.input_bytes[i])
            for i, d in enumerate(decisions)]
    added = [0.0] * n
    flight: list[tuple[float, int, int]] = []  # (lands at, bytes, group), in copy order
    landed = [0.0] * n
    c = x = 0.0  # compute clock; device-to-host stream clock
    resident, mem = 0, []

    def in_flight(now: float) -> int:
        return sum(b for t, b, _ in flight if t > now)

    for i in range(n):
        start, c = c, c + f[i]
        if moved[i]:
            x = landed[i] = max(max(start, x) + moved[i] / p.d2h_bytes_per_s, c)
            flight.append((x, moved[i], i))
        waiting = [fl for fl in flight if fl[0] > c]
        while waiting and sum(b for _, b, _ in waiting) > bound:  # the forward waits for copies
            t, _, g = waiting.pop(0)
            added[g] += t - c
            c = t
        resident += held[i]
        mem.append(p.other_fwd_bytes[i] + resident + in_flight(c))
    c += p.outside_s / (1 + beta)
    mem.append(p.other_head_bytes + resident + in_flight(c))
    c += p.outside_s * beta / (1 + beta)

    y, ready, direct = c, {}, set()  # host-to-device clock; when each reload is back

    def reload(j: int, now: float) -> None:
        nonlocal y
        if j < 0 or j in ready or not moved[j]:
            return
        if landed[j] > now:  # still on its way down: backward takes the source itself
            ready[j] = now
            direct.add(j)
        else:
            y = ready[j] = max(now, y) + moved[j] / p.h2d_bytes_per_s
    for i in reversed(range(n)):
        for j in range(i, i - prefetch - 1, -1):
            reload(j, c)
        if ready.get(i, c) > c:
            added[i] += ready[i] - c
            c = ready[i]
        resident -= held[i]
        own = p.saved_bytes[i] + p.small_bytes[i] + (
            p.input_bytes[i] if decisions[i] in _RECOMPUTING else 0)
        ahead = sum(moved[j] for j in ready if j < i)
        pending = sum(b for t, b, g in flight if t > c and g not in direct)
        mem.append(p.other_bwd_bytes[i] + resident + own + ahead + pending)
        extra = f[i] if decisions[i] in _RECOMPUTING else 0.0
        added[i] += extra
        c += beta * f[i] + extra
    return Simulation(c, max(mem), added)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per group: keep, offload, recompute or recompute+offload; ``print(plan)`` shows why."""

    decisions: tuple[str, ...]
    prefetch: int  # how many groups ahead backward reloads
    budget_bytes: int
    peak_bytes: int  # predicted, margin included
    step_s: float  # predicted forward + backward
    keep_step_s: float  # predicted with every group kept
    added_s: tuple[float, ...]  # predicted time each group adds
    feasible: bool  # False: no plan fits; this is the one of least memory
    profile: Profile = dataclasses.field(repr=False, compare=False)

    def __str__(self) -> str:
        p = self.profile
        rows = [f"{'group':>5} {'saved':>10} {'inputs':>10}  {'decision':<18} {'+ms':>7}"]
        for i, d in enumerate(self.decisions):
            rows.append(f"{i:>5} {_size(p.saved_bytes[i] + p.small_bytes[i]):>10} "
                        f"{_size(p.input_bytes[i]):>10}  {d:<18} {1e3 * self.added_s[i]:>7.1f}")
        met = "fits" if self.feasible else "does NOT fit (the least-memory plan)"
        rows.append(f"memory outside the groups at the loss head: {_size(p.other_head_bytes)}")
        rows.append(f"predicted peak {_size(self.peak_bytes)}: {met} the budget of "
                    f"{_size(self.budget_bytes)}; step {self.step_s * 1e3:.1f} ms "
                    f"({self.keep_step_s * 1e3:.1f} ms keeping every group); prefetch "
                    f"{self.prefetch}")
        return "\n".join(rows)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def plan(profile: Profile, budget_bytes: int, *, max_inflight_bytes: Optional[int] = None,
         prefetch: Optional[int] = None, margin_bytes: int = 0) -> Plan:
    """The plan of least predicted step time whose predicted peak fits ``budget_bytes``.

    Candidates offload the earliest ``m`` groups (their copies have the most compute to hide
    behind), for every ``m``; then recompute groups in order of bytes saved per second of
    recompute, then offload the recomputed groups' inputs, earliest first, until the budget is
    met. The best candidate is polished by undoing single decisions the budget does not need.
    The last group is never offloaded (backward needs it first). ``prefetch`` (how many groups
    ahead backward reloads) is chosen among 1, 2, 4 and 8 unless given.

    Example::

        p = fo.activations.Profile.uniform(8, saved_bytes=1 << 30, forward_s=3e-3,
                                           input_bytes=64 << 20, pcie_bytes_per_s=50e9)
        print(fo.activations.plan(p, budget_bytes=4 << 30))
    """
    p, n = profile, profile.num_groups
    best: Optional[tuple[float, int, list[str]]] = None
    for pf in [prefetch] if prefetch else [1, 2, 4, 8]:
        found = _search(p, budget_bytes, max_inflight_bytes, pf, margin_bytes)
        if found is not None:
            t = simulate(p, found, max_inflight_bytes=max_inflight_bytes, prefetch=pf).step_s
            if best is None or t < best[0] - 1e-12:
                best = (t, pf, found)
    if best is None:  # nothing fits: the least memory there is
        can_move = p.d2h_bytes_per_s > 0
        least = [RECOMPUTE_OFFLOAD if p.recomputable[i] and can_move else
                 RECOMPUTE if p.recomputable[i] else OFFLOAD if can_move else KEEP
                 for i in range(n)]
        least[-1] = RECOMPUTE if p.recomputable[-1] else KEEP
        best = (0.0, prefetch or 1, least)
    _, pf, decisions = best
    sim = simulate(p, decisions, max_inflight_bytes=max_inflight_bytes, prefetch=pf)
    peak = sim.peak_bytes + margin_bytes
    keep_s = simulate(p, [KEEP] * n).step_s
    return Plan(tuple(decisions), pf, int(budget_bytes), int(peak), sim.step_s, keep_s,
                tuple(sim.added_s), peak <= budget_bytes, p)


def _search(p: Profile, budget: int, bound: Optional[int], prefetch: int,
            margin: int) -> Optional[list[str]]:
    """The fastest decisions found that fit ``budget`` with ``prefetch``, or None."""
    n, last, can_move = p.num_groups, p.num_groups - 1, p.d2h_bytes_per_s > 0

    def cost(d: Sequence[str]) -> tuple[float, int]:
        s = simulate(p, d, max_inflight_bytes=bound, prefetch=prefetch)
        return s.step_s, s.peak_bytes + margin

    by_value = sorted((i for i in range(n) if p.recomputable[i]), key=lambda i: -(
        p.saved_bytes[i] + p.small_bytes[i] - p.input_bytes[i]) / max(p.forward_s[i], 1e-9))
    best: Optional[list[str]] = None
    for m in range(n if can_move else 1):  # offload groups 0 … m-1
        base = [OFFLOAD if i < m else KEEP for i in range(n)]
        moves = [(i, RECOMPUTE) for i in by_value if i >= m]
        if can_move:
            moves += [(i, RECOMPUTE_OFFLOAD) for i in range(last) if p.recomputable[i]]

        def apply(k: int) -> list[str]:
            d = list(base)
            for i, dec in moves[:k]:
                d[i] = dec
            return d
        lo, hi = 0, len(moves)
        if cost(apply(hi))[1] > budget:
            continue
        while lo < hi:  # the fewest moves that fit (memory falls as moves are added)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if cost(apply(mid))[1] <= budget else (mid + 1, hi)
        if best is None or cost(apply(lo))[0] < cost(best)[0]:
            best = apply(lo)
    improved = best is not None
    while improved:  # undo what the budget does not need
        improved = False
        for i, d in enumerate(best):
            for cheaper in (KEEP, OFFLOAD, RECOMPUTE):
                if cheaper == d or (cheaper == OFFLOAD and (i == last or not can_move)):
                    continue
                trial = best[:i] + [cheaper] + best[i + 1:]
                t, peak = cost(trial)
                if peak <= budget and t < cost(best)[0] - 1e-12:
                    best, improved = trial, True
                    break
    return best
