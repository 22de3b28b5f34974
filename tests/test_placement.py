"""Placement decisions are pure functions of leaf metadata: planned here on meta tensors."""

import pytest
import torch

import functional_offload as fo
from functional_offload import placement as P


def meta_tree(*numels):
    return {f"l{i}": torch.empty(n, device="meta") for i, n in enumerate(numels)}


@pytest.mark.parametrize("f,expect", [
    (0.0, [False] * 4),
    (1.0, [True] * 4),
    (0.5, [True, True, True, False]),    # totals before each leaf 0, 100, 400 < 500: overshoot to 0.8
    (0.25, [True, True, False, False]),  # 0, 100 < 250; then 400 >= 250
    (0.05, [True, False, False, False]),
])
def test_offload_fraction_megatron_semantics(f, expect):
    tree = meta_tree(100, 300, 400, 200)
    plan = P.offload_fraction(f).plan(tree)
    assert list(plan.on_host) == expect
    assert plan.fraction == pytest.approx(sum(n for n, h in zip([100, 300, 400, 200], expect) if h) / 1000)


def test_reported_fraction_overshoots():
    plan = P.offload_fraction(0.1).plan(meta_tree(900, 100))
    assert plan.on_host == (True, False) and plan.fraction == pytest.approx(0.9)


def test_host_leaves_stay_on_host_and_are_not_counted():
    tree = {"cpu": torch.empty(1000), "a": torch.empty(100, device="meta"),
            "b": torch.empty(100, device="meta")}
    plan = P.on_device().plan(tree)
    assert plan.paths == ("cpu", "a", "b") and plan.on_host == (True, False, False)  # built order
    plan = P.offload_fraction(0.5).plan(tree)
    assert plan.on_host == (True, True, False) and plan.fraction == 0.5
    assert plan.host_mask() == [True, False, True]  # flatten order: a, b, cpu


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5", True])
def test_fraction_out_of_range_raises(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        P.offload_fraction(bad)


def test_budget_predicate_select():
    tree = meta_tree(100, 300, 400, 200)
    # state bytes = 4 B/elem by default (fp32 params)
    assert P.device_budget(1600).plan(tree).on_host == (False, False, True, True)
    assert P.device_budget(0).plan(tree).on_host == (True,) * 4
    assert P.predicate(lambda path, t: path in ("l1", "l3")).plan(tree).on_host == (False, True, False, True)
    small_on_gpu = P.select(lambda path, t: t.numel() <= 200, P.on_device(), P.offload_fraction(0.4))
    # among the big leaves l1 (300), l2 (400) the threshold is 280: 0 < 280 takes l1, then stop
    assert small_on_gpu.plan(tree).on_host == (False, True, False, False)
    with pytest.raises(ValueError):
        P.device_budget(-1)


def test_state_bytes_drive_budget_in_optimizer():
    tree = meta_tree(100, 100)
    plan = P.device_budget(800).plan(tree, state_bytes=[800, 800])
    assert plan.on_host == (False, True) and plan.host_bytes == 800 and plan.device_bytes == 800
    assert "offloaded fraction 0.5000" in plan.summary()


def test_cpu_only_init_places_everything_on_host_and_updates():
    params = {"w": torch.ones(4, 4), "b": torch.ones(4, dtype=torch.bfloat16)}
    for pl in (P.on_device(), P.offload_fraction(0.5), P.on_host()):
        opt = fo.adamw(1e-2, placement=pl)
        state = opt.init(params)
        assert all(t.device.type == "cpu" for t in (state.mu["w"], state.nu["b"], state.master["b"]))
        opt.update({"w": torch.ones(4, 4), "b": torch.ones(4, dtype=torch.bfloat16)}, state)


def test_placement_type_checked():
    with pytest.raises(TypeError, match="Placement"):
        fo.adamw(1e-2, placement=0.5)


def test_offload_fraction_from_end_keeps_the_first_leaves_on_device():
    tree = meta_tree(100, 300, 400, 200)  # flatten order l0..l3
    plan = P.offload_fraction(0.5, from_end=True).plan(tree)
    # from the end: totals before l3, l2 = 0, 200 < 500 -> host; then 600 >= 500
    assert plan.on_host == (False, False, True, True) and plan.fraction == pytest.approx(0.6)
    assert P.offload_fraction(1.0, from_end=True).plan(tree).on_host == (True,) * 4
    assert P.offload_fraction(0.0, from_end=True).plan(tree).on_host == (False,) * 4
