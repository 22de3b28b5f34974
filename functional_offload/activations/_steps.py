"""Per-step state, and budget mode's bookkeeping: one plan per input shape, made from profiling
steps (memory, then times unless keeping everything fits) and, on a GPU, checked against the
measured peak of the next steps and corrected."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import torch

import functional_offload.activations.cost_model as cost_model
import functional_offload.activations.planner as planner
from functional_offload.activations._measure import Measure, profiling_decisions, timing_decisions
from functional_offload.activations.cost_model import KEEP, OFFLOAD, Profile
from functional_offload.activations.planner import ActivationPlan


class Recording:
    """One recorded forward and its backward: decisions, per-group bytes, the profiling."""

    def __init__(self, n: int, start_bytes: int, prefetch: int):
        self.decisions: Optional[list[str]] = None
        self.key: Any = None
        self.device: Optional[torch.device] = None
        self.start_bytes, self.prefetch = start_bytes, prefetch
        self.measure: Optional[Measure] = None
        self.verify = False
        self.records: list[list[weakref.ref]] = [[] for _ in range(n)]  # offloaded copies
        self.saved, self.small, self.moved = [0] * n, [0] * n, [0] * n
        self.seen: set = set()  # storages counted in the open group (or outside the groups)
        self.outside_before = self.outside = 0
        self.entered = False  # a group has begun
        self.backward_group: Optional[int] = -1  # -1: backward has not begun

    def held(self, below: int) -> int:
        """Bytes the decisions hold for groups ``0 … below-1``, plus what the copies hold."""
        inputs = self.measure.inputs if self.measure is not None else [0] * len(self.saved)
        return sum(cost_model.held_bytes(self.decisions[j], self.saved[j], self.small[j], inputs[j])
                   for j in range(below)) + self.device_bytes()

    def device_bytes(self) -> int:
        """Device bytes this step's copies hold: sources in flight, copies reloaded."""
        return sum(s.nbytes for recs in self.records for s in (r() for r in recs)
                   if s is not None and (s.src is not None or s.device_copy is not None))


class _PlanState:
    def __init__(self, profile: Profile):
        self.profile, self.margin, self.plan = profile, 0, None  # no plan: times not measured yet
        self.timing: list[weakref.ref] = []  # the timing steps begun (their Recording objects)
        self.verify_left = 4 if profile.peak_bytes is not None else 0  # GPU: check the peak


class Budget:
    """Plans for ``budget_bytes``, one per input-shape key (the latest few)."""

    def __init__(self, budget_bytes: int, num_groups: int, max_inflight_bytes: Optional[int],
                 stats: dict):
        self.budget_bytes, self.num_groups = budget_bytes, num_groups
        self.bound, self.stats = max_inflight_bytes, stats
        self.plans: dict[Any, _PlanState] = {}
        self.last_key: Any = None
        self.warned_missing = False

    @property
    def plan(self) -> Optional[ActivationPlan]:
        state = self.plans.get(self.last_key)
        return state.plan if state is not None else None

    def decide(self, step: Recording, can_move: bool) -> Optional[Measure]:
        """Set ``step``'s decisions: its key's plan, or profiling (returns the recorder)."""
        self.last_key = step.key
        state = self.plans.pop(step.key, None)
        if state is not None:
            self.plans[step.key] = state  # the latest used last: the oldest go first
            # a timing step whose graph is gone without a plan made: it raised or was dropped
            if state.plan is None and sum(r() is None for r in state.timing) >= 2:
                warnings.warn("two profiling steps that recompute every group did not end (their "
                              "forward or backward raised, or the graph was dropped): the plan "
                              "uses the forward times of the first profiling step, which "
                              "include its waits for copies", RuntimeWarning, stacklevel=4)
                self._replan(state)
        if state is None or state.plan is None:
            timing = state is not None
            if timing:
                state.timing.append(weakref.ref(step))
            step.decisions = timing_decisions(state.profile.recomputable, can_move) if timing \
                else profiling_decisions(self.num_groups, can_move)
            step.measure = Measure(self.num_groups, step.device, step.start_bytes, can_move,
                                   timing=timing)
            return step.measure
        step.decisions, step.prefetch = list(state.plan.decisions), state.plan.prefetch
        if state.verify_left > 0 and step.device.type == "cuda":
            step.verify = True
            torch.cuda.reset_peak_memory_stats(step.device)
        return None

    def backward_done(self, step: Recording) -> None:
        """Plan from a profiling step; correct a plan by a measured peak; notice new shapes."""
        state = self.plans.get(step.key)
        if step.measure is not None:
            self._profiled(step, state)
            return
        if state is None or state.plan is None or tuple(step.decisions) != state.plan.decisions:
            return
        if step.verify:  # the model's error on this plan becomes its margin (it only grows)
            measured = torch.cuda.max_memory_allocated(step.device) - step.start_bytes
            if measured <= self.budget_bytes:
                state.verify_left = 0  # met: keep this plan
                return
            state.margin = max(state.margin, measured - (state.plan.peak_bytes - state.margin))
            state.verify_left -= 1
            self._replan(state)
            return
        p = state.profile  # shapes changed without a new key (groups marked with group())?
        for i, d in enumerate(step.decisions):
            was, now = p.saved_bytes[i] + p.small_bytes[i], step.saved[i] + step.small[i]
            if d in (KEEP, OFFLOAD) and abs(now - was) > 0.05 * max(was, 1):
                del self.plans[step.key]  # the next step profiles again
                return

    def _profiled(self, step: Recording, state: Optional[_PlanState]) -> None:
        """After a profiling step: the memory profile (first step), or its times and the plan."""
        m = step.measure
        if not m.timing:
            if state is not None:  # a second forward recorded before the first backward
                return
            profile = m.profile(step.saved, step.small, step.outside_before, step.outside)
            if profile is None:
                if not self.warned_missing:
                    self.warned_missing = True
                    warnings.warn(f"budget_bytes: groups {m.missing()} of 0 … "
                                  f"{self.num_groups - 1} did not run in a profiled step, so no "
                                  "plan is made and the budget is not applied (the next step "
                                  "profiles again): run every group each step, or lower "
                                  "num_groups", RuntimeWarning, stacklevel=2)
                return
            self.stats["measured_steps"] += 1
            self.plans[step.key] = state = _PlanState(profile)
            if len(self.plans) > 32:  # the input shape used longest ago
                del self.plans[next(iter(self.plans))]
            keep = cost_model.simulate(profile, [KEEP] * self.num_groups,
                                    max_inflight_bytes=self.bound).peak_bytes
            if keep <= self.budget_bytes or not any(profile.recomputable[:-1]):
                self._replan(state)  # keeping everything fits, or nothing can be recomputed:
            return                   # no timing step (it would recompute every group)
        if state is None or state.plan is not None:
            return
        profile = m.times(state.profile, step.decisions)
        if profile is not None:
            self.stats["measured_steps"] += 1
            state.profile = profile
            self._replan(state)

    def _replan(self, state: _PlanState) -> None:
        state.plan = p = planner.plan(state.profile, self.budget_bytes,
                                      max_inflight_bytes=self.bound, margin_bytes=state.margin)
        self.stats["plans"] += 1
        if not p.feasible:
            warnings.warn(f"budget_bytes={self.budget_bytes} cannot be met: the least-memory plan "
                          f"peaks at {p.peak_bytes} bytes ({p.peak_bytes - self.budget_bytes} "
                          f"over), {p.profile.other_head_bytes} of them "
                          "outside the layer groups (the loss head, grads): raise the budget or "
                          "shrink what lies outside the groups (e.g. compute the loss in chunks)",
                          RuntimeWarning, stacklevel=2)
