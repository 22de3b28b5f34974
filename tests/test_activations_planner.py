"""The budget planner: its choices on synthetic profiles, and budget mode end to end on the CPU.

The planner tests use ``Profile.uniform`` shaped like a 24-layer GPT at 16k tokens (1.2 GB saved
per layer, 2.3 ms forward, 64 MiB of inputs, PCIe at 54 GB/s, a 6 GiB loss head). The end-to-end
tests check what holds whatever the CPU's timings: grads bit-identical to no offload in every
step, the budget met by the predicted peak, and when profiling and re-planning happen.
"""

import contextlib
import dataclasses
import itertools
import random
import warnings

import pytest
import torch

import functional_offload as fo
from functional_offload.activations import (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD, Profile,
                                            plan, simulate)
from functional_offload.activations.testing import copy_on_cpu, manual_clock

GiB = 1 << 30


def make(*args, copy=False, **kwargs):
    """An ActivationOffload; ``copy``: one that copies CPU tensors (made under copy_on_cpu)."""
    with copy_on_cpu() if copy else contextlib.nullcontext():
        return fo.ActivationOffload(*args, **kwargs)
GPT = dict(saved_bytes=1200 << 20, forward_s=2.3e-3, input_bytes=64 << 20, head_bytes=6 * GiB,
           pcie_bytes_per_s=54e9)


def test_everything_kept_when_it_fits():
    p = Profile.uniform(24, **GPT)
    pl = plan(p, 64 * GiB)
    assert pl.feasible and set(pl.decisions) == {KEEP} and pl.step_s == pl.keep_step_s


def test_budgets_met_at_least_time():
    p = Profile.uniform(24, **GPT)
    keep = simulate(p, [KEEP] * 24)
    ckpt = simulate(p, [RECOMPUTE] * 24)  # torch.utils.checkpoint on every layer
    last_s = keep.step_s
    for budget in [keep.peak_bytes, 24 * GiB, 16 * GiB, 12 * GiB, ckpt.peak_bytes]:
        pl = plan(p, budget)
        assert pl.feasible and pl.peak_bytes <= budget
        assert simulate(p, pl.decisions, prefetch=pl.prefetch).peak_bytes <= budget
        assert pl.step_s >= last_s - 1e-12  # less memory never comes faster
        last_s = pl.step_s
    assert pl.step_s <= ckpt.step_s  # at checkpointing's own peak, never slower than it
    below = plan(p, int(0.9 * ckpt.peak_bytes))  # below it: inputs go to the host
    assert below.feasible and RECOMPUTE_OFFLOAD in below.decisions


def test_offload_where_it_hides_recompute_where_it_does_not():
    slow, fast = Profile.uniform(8, **GPT), Profile.uniform(8, **{**GPT, "pcie_bytes_per_s": 1e15})
    budget = 12 * GiB
    assert OFFLOAD not in plan(slow, budget).decisions[2:]  # copies would stall the step
    pl = plan(fast, budget)
    assert RECOMPUTE not in pl.decisions and pl.step_s == pytest.approx(pl.keep_step_s)


def test_no_offload_without_a_copy_path_and_marked_groups_never_recompute():
    p = Profile.uniform(6, **{**GPT, "pcie_bytes_per_s": 0.0})  # the CPU pass-through
    p.recomputable[:3] = [False] * 3  # marked with off.group()
    pl = plan(p, 10 * GiB)
    assert pl.feasible and not {OFFLOAD, RECOMPUTE_OFFLOAD} & set(pl.decisions)
    assert set(pl.decisions[:3]) == {KEEP} and RECOMPUTE in pl.decisions[3:]


def test_infeasible_budget_gives_the_least_memory_plan():
    p = Profile.uniform(6, **GPT)
    pl = plan(p, 5 * GiB)  # below the loss head alone
    assert not pl.feasible and pl.peak_bytes == 6 * GiB  # the head alone: every group moved out
    assert pl.decisions == (RECOMPUTE_OFFLOAD,) * 6
    assert "does NOT fit" in str(pl)


def test_a_plan_that_peaks_at_the_budget_fits():
    """Recomputing the last group raises the peak (its inputs and its saved tensors at once),
    so memory does not fall with every recompute; the plan at exactly the budget was missed."""
    p = Profile.uniform(4, saved_bytes=1 << 20, forward_s=1e-3, input_bytes=1 << 18)
    fits = [RECOMPUTE] * 3 + [KEEP]
    budget = simulate(p, fits).peak_bytes
    assert budget == 1835008 < simulate(p, [RECOMPUTE] * 4).peak_bytes
    pl = plan(p, budget)
    assert pl.feasible and pl.decisions == tuple(fits) and pl.peak_bytes == budget
    below = plan(p, budget - 1)
    assert not below.feasible and below.peak_bytes == budget  # the least memory there is


def random_profile(rng, n, pcie):
    return Profile(
        saved_bytes=[rng.choice([0, 1, 2, 4, 8]) << 20 for _ in range(n)],
        small_bytes=[rng.choice([0, 1]) << 18 for _ in range(n)],
        input_bytes=[rng.choice([0, 1, 2, 8]) << 18 for _ in range(n)],
        forward_s=[rng.choice([1, 2, 5]) * 1e-3 for _ in range(n)],
        recomputable=[rng.random() < 0.8 for _ in range(n)],
        other_fwd_bytes=[rng.choice([0, 1, 3]) << 20 for _ in range(n)],
        other_bwd_bytes=[rng.choice([0, 1, 3]) << 20 for _ in range(n)],
        other_head_bytes=rng.choice([0, 2, 8]) << 20, backward_ratio=rng.choice([1.0, 2.0]),
        outside_s=rng.choice([0.0, 2e-3]), d2h_bytes_per_s=pcie, h2d_bytes_per_s=pcie)


def every_plan(p, prefetches=(1, 2, 4, 8)):
    """The oracle: every assignment the forward can carry out, simulated with every prefetch."""
    can_move = p.d2h_bytes_per_s > 0  # without a copy path offloading keeps: left out
    options = [[d for d in (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD)
                if (p.recomputable[i] or d in (KEEP, OFFLOAD))
                and (can_move or d in (KEEP, RECOMPUTE))] for i in range(p.num_groups)]
    return [simulate(p, d, prefetch=pf) for d in itertools.product(*options) for pf in prefetches]


def check_against(p, sims):
    least = min(s.peak_bytes for s in sims)
    keep = simulate(p, [KEEP] * p.num_groups).peak_bytes
    for budget in sorted({least - 1, least, (least + keep) // 2, keep}):
        pl = plan(p, budget)
        assert pl.feasible == (least <= budget), (budget, least, pl)
        if pl.feasible:
            assert pl.peak_bytes <= budget
            assert pl.peak_bytes == simulate(p, pl.decisions, prefetch=pl.prefetch).peak_bytes
        else:
            assert pl.peak_bytes == least, (pl.peak_bytes, least)
        if p.num_groups <= 5:  # searched exhaustively: also the least time
            best = min(s.step_s for s in sims if s.peak_bytes <= budget) if pl.feasible else \
                min(s.step_s for s in sims if s.peak_bytes == least)
            assert pl.step_s == pytest.approx(best, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_plan_against_every_assignment(seed):
    """Small profiles, every assignment simulated: the plan fits whenever one does, is the
    fastest that fits, and when none fits, has the least memory."""
    rng = random.Random(seed)
    p = random_profile(rng, rng.choice([2, 3, 4, 5]), [0.0, 1e9, 4e9][seed % 3])
    check_against(p, every_plan(p))


@pytest.mark.parametrize("seed", range(3))
def test_plan_past_the_exhaustive_search_finds_what_fits(seed):
    """Eleven groups without a copy path (2,048 assignments: the candidates' search)."""
    p = random_profile(random.Random(100 + seed), 11, 0.0)
    check_against(p, every_plan(p, prefetches=(1,)))


def test_inflight_bound_trades_time_for_memory_and_margin_counts():
    p = Profile.uniform(8, **GPT)
    offload = [OFFLOAD] * 7 + [KEEP]
    free, bounded = simulate(p, offload, max_inflight_bytes=1 << 60), simulate(p, offload)
    assert bounded.peak_bytes < free.peak_bytes and bounded.step_s > free.step_s
    assert sum(bounded.added_s) > 0  # the compute waited for copies
    assert plan(p, 12 * GiB, margin_bytes=GiB).peak_bytes == \
        simulate(p, plan(p, 12 * GiB, margin_bytes=GiB).decisions,
                 prefetch=plan(p, 12 * GiB, margin_bytes=GiB).prefetch).peak_bytes + GiB


@pytest.mark.parametrize("kw", [dict(budget_bytes=True), dict(budget_bytes=0),
                                dict(budget_bytes=1.5), dict(prefetch=0), dict(prefetch=True),
                                dict(margin_bytes=-1), dict(max_inflight_bytes=-1),
                                dict(max_inflight_bytes=False)])
def test_plan_options_are_checked(kw):
    args = {"budget_bytes": GiB, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        plan(Profile.uniform(4, **GPT), args.pop("budget_bytes"), **args)


def test_plan_prints_a_row_per_group():
    pl = plan(Profile.uniform(4, **GPT), 9 * GiB)
    text = str(pl)
    assert text.count("\n") >= 6 and "budget of 9.00 GiB" in text and "GiB" in text
    for i, d in enumerate(pl.decisions):
        assert f"{i:>5} " in text and d in text


# ---- budget mode end to end, on the CPU --------------------------------------------------------
D, N = 32, 5


def make_blocks(seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(torch.nn.Sequential(
        torch.nn.LayerNorm(D), torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D))
        for _ in range(N))


def forward(blocks, x, off=None, mark="run"):
    for i, b in enumerate(blocks):
        if off is None:
            x = x + b(x)
        elif mark == "run":
            x = x + off.run(i, b, x)
        else:
            with off.group(i):
                x = x + b(x)
    return torch.nn.functional.cross_entropy(x, torch.arange(x.shape[0]) % D)


def grads(blocks, x, off=None, mark="run"):
    params = list(blocks.parameters())
    with off.record(exclude=blocks) if off else torch.enable_grad():
        loss = forward(blocks, x, off, mark)
    return torch.autograd.grad(loss, params)


def keep_peak(blocks, x, copy, mark="run"):
    """The predicted peak with every group kept, from the profiling steps."""
    off = make(N, budget_bytes=1 << 40, min_bytes=1024, copy=copy)
    grads(blocks, x, off, mark)  # keeping everything fits: planned after one step
    return simulate(off.plan.profile, [KEEP] * N).peak_bytes


@pytest.mark.parametrize("copy", [False, True])
def test_budget_mode_grads_identical_and_budget_met(copy):
    blocks, x = make_blocks(), torch.randn(256, D)
    want = grads(blocks, x)
    budget = keep_peak(blocks, x, copy) // 3
    off = make(N, budget_bytes=budget, min_bytes=1024, copy=copy)
    for step in range(4):  # two profiling steps, then the plan
        for a, b in zip(grads(blocks, x, off), want, strict=True):
            assert torch.equal(a, b), step
        assert off.held_bytes == 0
        assert (off.plan is None) == (step == 0)
    pl = off.plan
    assert pl.feasible and pl.peak_bytes <= budget
    assert off.stats["measured_steps"] == 2 and off.stats["plans"] == 1
    assert off.stats["recomputed_groups"] == N - 1 + 2 * sum(
        d in (RECOMPUTE, RECOMPUTE_OFFLOAD) for d in pl.decisions) > N - 1
    assert (OFFLOAD in pl.decisions or RECOMPUTE_OFFLOAD in pl.decisions) <= copy


def test_replanned_when_the_sequence_length_changes():
    blocks = make_blocks()
    off = fo.ActivationOffload(N, budget_bytes=1 << 40, min_bytes=1024)
    saved = {}
    for tokens in (64, 128, 64, 128):
        x = torch.randn(tokens, D)
        for a, b in zip(grads(blocks, x, off), grads(blocks, x), strict=True):
            assert torch.equal(a, b)
        saved[tokens] = off.plan.profile.saved_bytes  # the plan for this length
    assert off.stats["measured_steps"] == 2  # one profile per length, then the plans are reused
    assert saved[128] == [2 * b for b in saved[64]] and min(saved[64]) > 0


def test_group_marks_are_never_recomputed_and_shape_changes_replan():
    blocks = make_blocks()
    x = torch.randn(256, D)
    budget = keep_peak(blocks, x, False, mark="group") // 2  # unreachable without recompute
    off = fo.ActivationOffload(N, budget_bytes=budget, min_bytes=1024)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for a, b in zip(grads(blocks, x, off, "group"), grads(blocks, x), strict=True):
            assert torch.equal(a, b)
    assert any("cannot be met" in str(w.message) and " over)" in str(w.message) for w in caught)
    assert set(off.plan.decisions) == {KEEP} and not off.plan.feasible
    grads(blocks, x, off, "group")  # the plan
    grads(blocks, torch.randn(64, D), off, "group")  # new shapes under the old plan: noticed
    grads(blocks, torch.randn(64, D), off, "group")  # profiled again
    assert off.stats["measured_steps"] == 2


def test_module_loop_with_wrap():
    blocks, x = make_blocks(), torch.randn(128, D)
    names = [k for k, _ in blocks.named_parameters()]
    want = grads(blocks, x)
    budget = keep_peak(blocks, x, True) // 3
    off = make(N, budget_bytes=budget, min_bytes=1024, copy=True)
    off.wrap(blocks)
    assert [k for k, _ in blocks.named_parameters()] == names  # names and state dict unchanged
    for _ in range(3):
        blocks.zero_grad(set_to_none=True)
        with off.record(exclude=blocks):
            loss = forward(blocks, x)  # the model calls its blocks as usual
        loss.backward()
        for p, w in zip(blocks.parameters(), want, strict=True):
            assert torch.equal(p.grad, w)
    with torch.no_grad():
        forward(blocks, x)  # evaluation: plain calls
    assert off.stats["recomputed_groups"] > 0 and off.held_bytes == 0


def test_recompute_groups_with_counts():
    blocks, x = make_blocks(), torch.randn(64, D)
    want = grads(blocks, x)
    off = make(N, 2, recompute_groups=[2, 4], min_bytes=1024, copy=True)
    for a, b in zip(grads(blocks, x, off), want, strict=True):
        assert torch.equal(a, b)
    assert off.stats["recomputed_groups"] == 2 and off.stats["offloaded_bytes"] > 0
    assert off.plan is None  # counts, not a budget


def test_profiling_buffers_are_released_when_the_plan_needs_none():
    blocks, x = make_blocks(), torch.randn(128, D)
    off = make(N, budget_bytes=1 << 40, min_bytes=1024, copy=True)
    grads(blocks, x, off)  # profiling: every group but the last offloaded
    assert off.pinned_bytes > 0 and set(off.plan.decisions) == {KEEP}
    for _ in range(3):
        grads(blocks, x, off)
    assert off.pinned_bytes == 0  # kept for two steps, then freed


class Tick(torch.autograd.Function):
    """The identity, taking ``fwd`` seconds of the manual clock forward and ``bwd`` backward."""

    @staticmethod
    def forward(ctx, x, clock, fwd, bwd):
        clock.advance(fwd)
        ctx.clock, ctx.bwd = clock, bwd
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.advance(ctx.bwd)
        return grad, None, None, None


class Takes(torch.nn.Module):
    def __init__(self, clock, fwd, bwd):
        super().__init__()
        self.clock, self.fwd, self.bwd = clock, fwd, bwd

    def forward(self, x):
        return Tick.apply(x, self.clock, self.fwd, self.bwd)


def timed_blocks(clock, fwd, bwd):
    """make_blocks() whose blocks take ``fwd`` and ``bwd`` seconds of ``clock`` (after the first
    Linear, so that the backward that the params need runs it, after the block's first unpack)."""
    for b in (blocks := make_blocks()):
        b.insert(2, Takes(clock, fwd, bwd))
    return blocks


def test_times_come_from_the_recompute_step_not_the_offload_step():
    """The first profiling step is slow for reasons of its own (on a GPU: pinning gigabytes of
    host buffers, waiting for every copy); the plan's times must be the groups' compute. The
    blocks take 1 ms forward and 2 ms backward on a manual clock, the first step 200 ms more."""
    with manual_clock() as clock:
        blocks, x = timed_blocks(clock, 1e-3, 2e-3), torch.randn(512, D)
        budget = keep_peak(blocks, x, True) // 2  # keeping everything does not fit: timing step
        first = [True]

        def stall(module, args):  # what the first step's own slowness looks like to a group
            if first[0]:
                clock.advance(0.2)
        hooks = [b.register_forward_pre_hook(stall) for b in blocks]
        off = make(N, budget_bytes=budget, min_bytes=1024, copy=True)
        grads(blocks, x, off)
        assert off.plan is None
        first[0] = False
        grads(blocks, x, off)
        for h in hooks:
            h.remove()
        p = off.plan.profile
        assert p.forward_s == pytest.approx([1e-3] * N, abs=1e-12), p.forward_s
        assert p.backward_ratio == pytest.approx(2.0) and p.outside_s == 0.0
        start = clock()
        grads(blocks, x, off)  # a planned step, as the clock measures it
        recomputed = sum(d in (RECOMPUTE, RECOMPUTE_OFFLOAD) for d in off.plan.decisions)
        assert clock() - start == pytest.approx(N * 3e-3 + recomputed * 1e-3, abs=1e-12)
        # predicted: the same, and the copies' time (at 10 GB/s: deferred copies take no time)
        assert off.plan.step_s == pytest.approx(clock() - start, rel=1e-3)


def test_no_timing_step_when_keeping_everything_fits():
    """The second profiling step recomputes every group: a forward's side effects (BatchNorm's
    running statistics) would happen twice. It runs only when the budget needs more than
    keeping everything."""
    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.BatchNorm1d(D))
                                   for _ in range(N))
    want, got = model(), model()
    off = make(N, budget_bytes=1 << 40, min_bytes=1024, copy=True)
    x = torch.randn(64, D)
    for _ in range(3):
        for a, b in zip(grads(got, x, off), grads(want, x), strict=True):
            assert torch.equal(a, b)
    assert off.stats["measured_steps"] == 1 and off.stats["recomputed_groups"] == 0
    for a, b in zip(got.buffers(), want.buffers(), strict=True):
        assert torch.equal(a, b)


def test_the_loss_head_time_leaves_out_another_micro_batch_forward():
    """Gradient accumulation with every forward recorded before the backwards: the head's time
    is its own forward and backward, not the other micro-batches' forwards in between; timing
    steps still waiting for their backward are not taken for steps that failed. On a manual
    clock each block takes 20 ms forward, the head 3 ms forward and 4 ms backward."""
    with manual_clock() as clock:
        blocks = timed_blocks(clock, 0.02, 0.0)
        head = Takes(clock, 3e-3, 4e-3)
        budget = keep_peak(blocks, torch.randn(64, D), True) // 2

        def loss_of(x):  # forward() with the head's time
            for i, b in enumerate(blocks):
                x = x + off.run(i, b, x)
            return torch.nn.functional.cross_entropy(head(x), torch.arange(x.shape[0]) % D)
        off = make(N, budget_bytes=budget, min_bytes=1024, copy=True)
        params = list(blocks.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):  # the two profiling steps, each with three micro-batches
                losses = []
                for x in (torch.randn(64, D), torch.randn(64, D), torch.randn(64, D)):
                    with off.record(exclude=blocks):
                        losses.append(loss_of(x))
                for loss in losses:
                    torch.autograd.grad(loss, params)
    assert off.plan is not None and off.stats["measured_steps"] == 2
    assert off.plan.profile.outside_s == pytest.approx(7e-3, abs=1e-12)  # not + 0.2 s of forwards


def test_timing_steps_that_never_end_fall_back_to_the_first_steps_times():
    blocks, x = make_blocks(), torch.randn(64, D)
    off = make(N, budget_bytes=keep_peak(blocks, x, True) // 2, min_bytes=1024, copy=True)
    grads(blocks, x, off)  # the memory profile
    for _ in range(2):  # timing steps whose graphs are dropped before backward
        with off.record(exclude=blocks):
            forward(blocks, x, off)
    assert off.plan is None
    with pytest.warns(RuntimeWarning, match="did not end"):
        got = grads(blocks, x, off)
    assert off.plan is not None
    for a, b in zip(got, grads(blocks, x), strict=True):
        assert torch.equal(a, b)


def test_bad_profiles_and_decisions_are_refused_naming_the_field():
    good = fo.activations.Profile.uniform(4, saved_bytes=1 << 20, forward_s=1e-3)
    for field, value, match in (("small_bytes", [0, 0], "small_bytes has 2 entries"),
                                ("saved_bytes", [-100] * 4, "saved_bytes holds -100"),
                                ("forward_s", [float("nan")] * 4, "forward_s holds nan"),
                                ("backward_ratio", -3.0, "backward_ratio is -3.0"),
                                ("h2d_bytes_per_s", float("inf"), "h2d_bytes_per_s is inf"),
                                ("recomputable", ["no"] * 4, "recomputable holds 'no'")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(good, **{field: value})
    for n in (-1, 0, True, 2.0):
        with pytest.raises(ValueError, match=f"num_groups must be an int >= 1, got {n!r}"):
            fo.activations.Profile.uniform(n, saved_bytes=1 << 20, forward_s=1e-3)
    for decisions in (["keep"] * 3, ["keep", "kept", "keep", "keep"]):
        with pytest.raises(ValueError, match="one decision per group"):
            fo.activations.simulate(good, decisions)
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        fo.activations.simulate(good, ["keep"] * 4, prefetch=0)
    for bound in (-5, 1.5, True):
        with pytest.raises(ValueError, match="max_inflight_bytes must be None or an int >= 0"):
            fo.activations.simulate(good, ["keep"] * 4, max_inflight_bytes=bound)
