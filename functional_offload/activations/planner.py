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
import functools
import itertools
import math
from typing import Optional, Sequence

from functional_offload.activations.cost_model import (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD,
                                                       Profile, held_bytes, simulate)
from functional_offload.checks import is_int

__all__ = ["ActivationPlan", "plan"]

_MOVING = (OFFLOAD, RECOMPUTE_OFFLOAD)


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
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
         prefetch: Optional[int] = None, margin_bytes: int = 0) -> ActivationPlan:
    """The plan of least predicted step time whose predicted peak fits ``budget_bytes``.

    A plan fits when :func:`simulate`'s peak plus ``margin_bytes`` is at most the budget. Each
    group may keep, offload (where something can move), recompute or recompute+offload (where
    it runs through ``run``). Up to 1,024 assignments, every one is simulated: the plan found is
    the fastest that fits, and when none fits, the one of least memory. Past that, candidates
    offload the earliest ``m`` groups (their copies have the most compute to hide behind), for
    every ``m``; then recompute groups in order of bytes saved per second of recompute, then
    move the recomputed groups' inputs to the host, earliest first, each change kept only where
    it lowers the peak, until the budget is met. The least memory is searched from the least
    held and the lowest candidate by changing single decisions while the peak falls, and the
    fastest plan that fits is polished by single changes that keep it within the budget.
    ``prefetch`` (how many groups ahead backward reloads) is chosen among 1, 2, 4 and 8 unless
    given. Ties in time go to the plan that changes fewer groups and moves less.

    Example::

        p = fo.activations.Profile.uniform(8, saved_bytes=1 << 30, forward_s=3e-3,
                                           input_bytes=64 << 20, pcie_bytes_per_s=50e9)
        print(fo.activations.plan(p, budget_bytes=4 << 30))
    """
    _check_count("budget_bytes", budget_bytes, 1)
    _check_count("margin_bytes", margin_bytes, 0)
    if max_inflight_bytes is not None:
        _check_count("max_inflight_bytes", max_inflight_bytes, 0)
    if prefetch is not None:
        _check_count("prefetch", prefetch, 1)
    p, n = profile, profile.num_groups
    sims = _Sims(p, max_inflight_bytes, margin_bytes)
    options = _options(p)
    prefetches = [prefetch] if prefetch else [
        pf for pf in (1, 2, 4, 8) if pf == 1 or min(pf, n - 1) > min(pf // 2, n - 1)]
    if math.prod(map(len, options)) <= _EXHAUSTIVE:
        for d in itertools.product(*options):
            for pf in prefetches if _moves(d) else prefetches[:1]:
                sims.peak(d, pf)
    else:
        for pf in prefetches:
            _search(p, options, budget_bytes, pf, sims)
    fits = [c for c, (_, peak) in sims.done.items() if peak <= budget_bytes]
    if fits:
        decisions, pf = _fastest(fits, sims)
    else:  # nothing fits: the least memory there is
        least = min(peak for _, peak in sims.done.values())
        decisions, pf = _fastest([c for c, (_, peak) in sims.done.items() if peak == least], sims)
    sim = simulate(p, decisions, max_inflight_bytes=max_inflight_bytes, prefetch=pf)
    peak = sim.peak_bytes + margin_bytes
    keep_s = simulate(p, [KEEP] * n).step_s
    return ActivationPlan(tuple(decisions), pf, int(budget_bytes), int(peak), sim.step_s, keep_s,
                tuple(sim.added_s), peak <= budget_bytes, p)


_EXHAUSTIVE = 1024  # assignments up to which plan() simulates every one
_RANK = {KEEP: 0, OFFLOAD: 1, RECOMPUTE: 2, RECOMPUTE_OFFLOAD: 3}


def _check_count(name: str, value: object, least: int) -> None:
    if not is_int(value) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _options(p: Profile) -> list[tuple[str, ...]]:
    """Per group, the decisions the forward can carry out: offloading needs a copy path (a GPU),
    recomputing a group marked with ``run``."""
    can_move = p.d2h_bytes_per_s > 0
    return [tuple(d for d in (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD)
                  if (can_move or d not in _MOVING) and (p.recomputable[i] or d in (KEEP, OFFLOAD)))
            for i in range(p.num_groups)]


def _moves(decisions: Sequence[str]) -> bool:
    return any(d in _MOVING for d in decisions)


class _Sims:
    """:func:`simulate` once per (decisions, prefetch): its step time and peak, margin included."""

    def __init__(self, p: Profile, bound: Optional[int], margin: int):
        self.p, self.bound, self.margin = p, bound, margin
        self.done: dict[tuple[tuple[str, ...], int], tuple[float, int]] = {}

    def cost(self, decisions: Sequence[str], prefetch: int) -> tuple[float, int]:
        key = (tuple(decisions), prefetch)
        if key not in self.done:
            s = simulate(self.p, decisions, max_inflight_bytes=self.bound, prefetch=prefetch)
            self.done[key] = (s.step_s, s.peak_bytes + self.margin)
        return self.done[key]

    def peak(self, decisions: Sequence[str], prefetch: int) -> int:
        return self.cost(decisions, prefetch)[1]

    def time(self, decisions: Sequence[str], prefetch: int) -> float:
        return self.cost(decisions, prefetch)[0]


def _fastest(candidates: Sequence[tuple[tuple[str, ...], int]],
             sims: _Sims) -> tuple[tuple[str, ...], int]:
    """The least step time; within 1e-12 s of it, the fewest changed and moved groups."""
    least = min(sims.time(*c) for c in candidates)
    near = [c for c in candidates if sims.time(*c) <= least + 1e-12]
    return min(near, key=lambda c: (sum(d != KEEP for d in c[0]), sum(d in _MOVING for d in c[0]),
                                    c[1], [_RANK[d] for d in c[0]]))


def _descend(d: list[str], options: Sequence[tuple[str, ...]], better,
             pairs: bool = False) -> list[str]:
    """Change single decisions (and, with ``pairs``, two neighbours' at once) while
    ``better(trial, d)``: first improvement, until none."""
    n = len(d)
    spans = [(i, i + 1) for i in range(n)] + ([(i, i + 2) for i in range(n - 1)] if pairs else [])
    improved = True
    while improved:
        improved = False
        for a, b in spans:
            for change in itertools.product(*options[a:b]):
                if list(change) != d[a:b]:
                    trial = d[:a] + list(change) + d[b:]
                    if better(trial, d):
                        d, improved = trial, True
    return d


def _search(p: Profile, options: Sequence[tuple[str, ...]], budget: int, prefetch: int,
            sims: _Sims) -> None:
    """Simulate the candidates for ``prefetch`` (into ``sims``): past the exhaustive search."""
    n = p.num_groups
    by_value = sorted((i for i in range(n) if RECOMPUTE in options[i]), key=lambda i: -(
        p.saved_bytes[i] + p.small_bytes[i] - p.input_bytes[i]) / max(p.forward_s[i], 1e-9))
    moves = [(i, RECOMPUTE) for i in by_value] + [
        (i, RECOMPUTE_OFFLOAD) for i in range(n) if RECOMPUTE_OFFLOAD in options[i]]
    peak = functools.partial(sims.peak, prefetch=prefetch)
    found = []
    for m in range(n if OFFLOAD in options[0] else 1):  # offload groups 0 … m-1
        d = [OFFLOAD if i < m and OFFLOAD in options[i] else KEEP for i in range(n)]
        for i, dec in moves:
            if peak(d) <= budget:
                break
            if i >= m or dec == RECOMPUTE_OFFLOAD:
                trial = d[:i] + [dec] + d[i + 1:]
                if peak(trial) < peak(d):  # a change that does not lower the peak is skipped
                    d = trial
        found.append(d)
    least_held = [min(opts, key=lambda o: (held_bytes(o, p.saved_bytes[i], p.small_bytes[i],
                                                      p.input_bytes[i]), _RANK[o]))
                  for i, opts in enumerate(options)]
    lower = lambda a, b: peak(a) < peak(b)  # noqa: E731
    found += [_descend(seed, options, lower) for seed in (least_held, min(found, key=peak))]
    if all(peak(d) > budget for d in found):  # nothing fits yet: change neighbours in pairs too
        found.append(_descend(min(found, key=peak), options, lower, pairs=True))
    fits = [d for d in found if peak(d) <= budget]
    if fits:
        best = min(fits, key=lambda d: sims.time(d, prefetch))
        _descend(best, options, lambda a, b: peak(a) <= budget
                 and sims.time(a, prefetch) < sims.time(b, prefetch) - 1e-12)
