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


# ---- fo.plan counts what init allocates ---------------------------------------------------------

import inspect  # noqa: E402
import re  # noqa: E402

from registry import OPTIMIZERS  # noqa: E402

ENTRIES = {e.name: e for e in OPTIMIZERS}
DTYPES = {  # param dtype, options
    "fp32": (torch.float32, {}), "bf16": (torch.bfloat16, {}), "fp16": (torch.float16, {}),
    "fp64": (torch.float64, {}),
    "bf16-fp64-master": (torch.bfloat16, {"master_dtype": torch.float64}),
    "fp32-bf16-moments": (torch.float32, "bf16 moments"),
}


def layouts(kind, dtype):
    """A tree of the layouts a param may have, in an order that is not sorted. ``cpu``:
    contiguous CPU params; ``strided``: CPU params that are not contiguous; ``meta`` and
    ``cuda``: params on a device, of every layout."""
    device = kind if kind in ("meta", "cuda") else "cpu"
    make = lambda *s: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
    contiguous = {"w": make(6, 5), "v": make(7), "s": make(), "e": make(0, 3), "c": make(2, 3, 4)}
    strided = {"wt": make(5, 6).t(), "sl": make(12)[::2], "ct": make(2, 3, 4).transpose(0, 2)}
    return {"cpu": contiguous, "strided": strided}.get(kind, {**strided, **contiguous})


def options(make, dtype_case):
    dtype, extra = DTYPES[dtype_case]
    if extra == "bf16 moments":  # every moment dtype option the constructor has
        extra = {k: torch.bfloat16 for k in inspect.signature(make).parameters
                 if k.endswith("_dtype") and k != "master_dtype"}
    return dtype, extra


def by_leaf(report):
    """The report's rows of each params leaf (a terminal state's paths are field.leaf)."""
    out = {}
    for row in report.rows:
        field, _, leaf = row["path"].partition(".")
        if field != "count":
            out.setdefault(leaf, []).append(row)
    return out


def check_plan_is_what_init_allocates(opt, params):
    """``fo.plan``'s rows are the leaves in build order, each with the bytes of the state
    tensors ``init`` makes for it, where they are; or both raise the same error."""
    try:
        state = opt.init(params)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            fo.plan(opt, params)
        return
    plan, report = fo.plan(opt, params), fo.placement_report(state)
    assert plan.paths == tuple(params)  # build order
    rows = by_leaf(report)
    assert set(rows) <= set(plan.paths)
    for path, host, nbytes in zip(plan.paths, plan.on_host, plan.state_bytes):
        assert sum(r["bytes"] for r in rows.get(path, [])) == nbytes, path
        assert all((r["device"] == "cpu") == host for r in rows.get(path, [])), path
    assert plan.host_bytes + plan.device_bytes == report.host_bytes + report.device_bytes - 8


@pytest.mark.parametrize("kind", ["cpu", "strided", "meta"])
@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
@pytest.mark.parametrize("dtype_case", list(DTYPES))
@pytest.mark.parametrize("name", list(ENTRIES))
def test_plan_bytes_are_the_bytes_init_allocates(name, dtype_case, delayed, kind):
    e = ENTRIES[name]
    if delayed and not e.delayed:
        pytest.skip(f"{name} has no delayed mode")
    dtype, extra = options(e.make, dtype_case)
    params = layouts(kind, dtype)
    # CPU params keep their state on the host whatever the policy; meta (device) params can
    # be initialised for real only with their state next to them
    policies = ([P.on_device()] if kind == "meta" else
                [P.on_device(), P.on_host(), P.offload_fraction(0.5)])
    for placement in policies:
        for ema in (None, 0.5):
            opt = e.make(**e.hypers, **extra, placement=placement, delayed=delayed, ema_decay=ema)
            check_plan_is_what_init_allocates(opt, params)


@pytest.mark.cuda
@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
@pytest.mark.parametrize("dtype_case", list(DTYPES))
@pytest.mark.parametrize("name", list(ENTRIES))
def test_plan_bytes_are_the_bytes_init_allocates_on_cuda(name, dtype_case, delayed):
    e = ENTRIES[name]
    if delayed and not e.delayed:
        pytest.skip(f"{name} has no delayed mode")
    dtype, extra = options(e.make, dtype_case)
    params = layouts("cuda", dtype)
    for placement in (P.on_device(), P.on_host(), P.offload_fraction(0.5), P.device_budget(400)):
        for ema in (None, 0.5):
            opt = e.make(**e.hypers, **extra, placement=placement, delayed=delayed, ema_decay=ema)
            check_plan_is_what_init_allocates(opt, params)


def test_a_partitions_rows_follow_the_params_build_order_with_their_bytes():
    params = {"layer2.weight": torch.zeros(6, 5), "layer2.bias": torch.zeros(6),
              "layer1.weight": torch.zeros(5, 4).t(), "layer1.bias": torch.zeros(5)}  # not sorted
    opt = fo.partition({"w": fo.lion(1e-3, ema_decay=0.5),
                        "b": fo.chain(fo.clip_by_global_norm(1.0), fo.sgd(0.1, momentum=0.9))},
                       lambda p: {k: "w" if v.dim() > 1 else "b" for k, v in p.items()})
    plan = fo.plan(opt, params)
    assert plan.paths == tuple(params)  # not each part's rows in turn
    state = opt.init(params)
    sizes = {leaf: sum(r["bytes"] for r in rows)
             for part in (state.inner_states["w"], state.inner_states["b"][-1])
             for leaf, rows in by_leaf(fo.placement_report(part)).items()}
    assert dict(zip(plan.paths, plan.state_bytes)) == sizes
    # index and host_mask() refer to the params' flatten order (optree sorts dict keys)
    assert [sorted(params)[i] for i in plan.index] == list(params)
    host = fo.partition({"w": fo.adamw(placement=P.on_host()),
                         "b": fo.adamw(placement=P.on_device())},
                        lambda p: {k: "w" if k.endswith("weight") else "b" for k in p})
    meta = {k: torch.empty(v.shape, device="meta") for k, v in params.items()}
    assert fo.plan(host, meta).host_mask() == [True if k.endswith("weight") else False
                                               for k in sorted(params)]


def test_summary_says_all_state_is_in_host_memory_when_every_param_is():
    plan = fo.plan(fo.adamw(1e-3, placement=P.on_device()), {"w": torch.zeros(4, 4)})
    text = plan.summary()
    assert "offloaded fraction" not in text and "host (param)" in text.splitlines()[1]
    assert "every param is in host memory, so all state is in host memory with it" in text
    assert text.endswith("state bytes on host 128 (8.00 per element there), on device 0")  # mu, nu


def test_summary_counts_the_leaves_whose_params_are_in_host_memory_apart():
    tree = {"cpu": torch.empty(1000), "a": torch.empty(100, device="meta"),
            "b": torch.empty(100, device="meta")}
    lines = P.offload_fraction(0.5).plan(tree).summary().splitlines()
    assert [line.split()[-1] for line in lines[1:4]] == ["(param)", "host", "device"]
    assert lines[-1].startswith("offloaded fraction 0.5000 of the device params' elements; 1 of "
                                "3 leaves have their param in host memory and keep their state "
                                "there;")


def test_plan_refuses_an_optimizer_whose_state_does_not_hold_what_its_parts_placed():
    inner, params = fo.adamw(1e-3), {"w": torch.empty(4, device="meta")}
    twice = fo.Optimizer(lambda p: [inner.init(p) for _ in range(2)][0], inner.update)
    renamed = fo.Optimizer(lambda p: inner.init({"x": p["w"]}), inner.update)
    for opt in (twice, renamed):
        with pytest.raises(ValueError, match="fo.plan cannot match this optimizer's placement"):
            fo.plan(opt, params)


def test_a_budget_policy_decides_on_the_bytes_init_makes():
    """fp64 params' EMAs are fp64: 1,600 B of moments and 800 B of EMA per 100-element leaf,
    past a 2,000 B budget, so no leaf's state fits on the device."""
    params = {f"l{i}": torch.empty(100, dtype=torch.float64, device="meta") for i in range(2)}
    plan = fo.plan(fo.adamw(1e-3, placement=P.device_budget(2000), ema_decay=0.9), params)
    assert plan.on_host == (True, True) and plan.device_bytes == 0
    assert plan.state_bytes == (3200, 3200)  # on the host, a device param gets an fp64 master


def test_a_custom_placement_decides_bools_and_select_takes_placements():
    params = {"a": torch.empty(4, 4, device="meta"), "b": torch.empty(4, device="meta")}
    for bad in (["no", "no"], [2, 0], [None, True]):
        with pytest.raises(TypeError,
                           match=r"decided .* for leaf 'a'; each decision must be a bool"):
            fo.placement.Placement(lambda leaves, bad=bad: bad, "mine").plan(params)
    plan = fo.placement.predicate(lambda path, p: "b" in path or None).plan(params)
    assert plan.on_host == (False, True)
    with pytest.raises(TypeError, match="select's if_false must be a Placement"):
        fo.placement.select(lambda path, p: True, fo.placement.on_device(), 0.5)


def test_offload_fraction_one_is_on_host_with_empty_leaves():
    for params in ({"a": torch.empty(4, device="meta"), "z": torch.empty(0, device="meta")},
                   {"z": torch.empty(0, device="meta")}):
        assert (fo.placement.offload_fraction(1.0).plan(params).on_host
                == fo.placement.on_host().plan(params).on_host)
