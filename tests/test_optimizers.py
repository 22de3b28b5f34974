"""What the registry's shared properties do not cover: schedules, clipping, masks, guards,
chains, in-place params, a training loop (the oracles are torch.optim)."""

import math

import optree
import pytest
import torch

import functional_offload as fo
from conftest import DELAYS, KERNELS, clone, grad_seq, make_params

STEPS = 20
RTOL = 1e-6


def torch_run(cls, kwargs, params, grads, lr_lambda=None, clip=None):
    ps = optree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    leaves = optree.tree_leaves(ps)
    opt = cls(leaves, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    for g in grads:
        for p, gi in zip(leaves, optree.tree_leaves(g)):
            p.grad = gi.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(leaves, clip)
        opt.step()
        if sched:
            sched.step()
    return optree.tree_map(lambda t: t.detach(), ps)


def ours_run(opt, params, grads):
    params = clone(params)
    state = opt.init(params)
    for g in grads:
        params, state = opt.update(g, state)
    return params, state


def assert_close(a, b, rtol=RTOL):
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        rel = ((x.double() - y.double()).abs().max() / y.double().abs().max()).item()
        assert rel <= rtol, rel


CASES = {
    "adamw": (fo.adamw, torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)),
    "adamw-nowd": (fo.adamw, torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.0)),
    "adam": (fo.adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.999), eps=1e-6)),
    "adam-l2": (fo.adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
    "sgd": (fo.sgd, torch.optim.SGD, dict(lr=0.05)),
    "sgd-momentum-wd": (fo.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "sgd-nesterov": (fo.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", ["adamw", "adam-l2", "sgd-momentum-wd"])
def test_schedule_matches_lambdalr(case, kernel):
    ours, theirs, kw = CASES[case]
    f = fo.schedules.warmup_cosine(1.0, 5, STEPS, init=0.1, end=0.05)
    base = kw["lr"]
    params = make_params(3)
    grads = grad_seq(params, STEPS, seed=4)
    got, _ = ours_run(ours(**{**kw, "lr": lambda n: base * f(n)}, cpu_kernel=kernel), params, grads)
    want = torch_run(theirs, kw, params, grads, lr_lambda=f)
    assert_close(got, want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_clip_chain_matches_clip_grad_norm(kernel):
    kw = dict(lr=1e-2, weight_decay=0.1)
    params = make_params(5)
    grads = grad_seq(params, STEPS, seed=6)
    grads = [optree.tree_map(lambda g: g * (0.01 if i % 2 else 10.0), gs) for i, gs in enumerate(grads)]
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(**kw, cpu_kernel=kernel))
    got, _ = ours_run(opt, params, grads)
    want = torch_run(torch.optim.AdamW, kw, params, grads, clip=1.0)
    assert_close(got, want)


def test_clip_does_not_modify_input_and_matches_torch_norm():
    g = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0]), "c": None}
    clip = fo.clip_by_global_norm(1.0)
    out, _ = clip.update(g, clip.init(None))
    assert torch.equal(g["a"], torch.tensor([3.0, 4.0])) and out["c"] is None
    assert torch.allclose(fo.global_norm(g), torch.tensor(13.0))
    assert torch.allclose(out["b"], torch.tensor([12.0 / (13.0 + 1e-6)]))
    small, _ = fo.clip_by_global_norm(100.0).update(g, ())
    assert torch.equal(small["a"], g["a"])
    # one grad per device and dtype: flattening one tensor gives a view of it, not a copy
    alone = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 1.0], dtype=torch.bfloat16)}
    before = {k: v.clone() for k, v in alone.items()}
    out, _ = clip.update(alone, ())
    assert all(torch.equal(alone[k], before[k]) for k in alone)
    assert not torch.equal(out["w"], alone["w"])


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_moments_stored_in_bf16(kernel):
    params = make_params(9)
    opt = fo.adamw(1e-2, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16, cpu_kernel=kernel)
    got, state = ours_run(opt, params, grad_seq(params, 5))
    want = torch_run(torch.optim.AdamW, dict(lr=1e-2), params, grad_seq(params, 5))
    assert all(m.dtype == torch.bfloat16 for m in optree.tree_leaves((state.mu, state.nu)))
    assert_close(got, want, rtol=1e-2)


def test_fp32_params_update_in_place_without_master():
    params = make_params()
    ids = [id(t) for t in optree.tree_leaves(params)]
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    assert optree.tree_leaves(state.master) == []
    new, state = opt.update(grad_seq(params, 1)[0], state)
    assert [id(t) for t in optree.tree_leaves(new)] == ids


def test_donation_consumed_state_raises():
    params = make_params()
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2))
    s0 = opt.init(params)
    g = grad_seq(params, 1)[0]
    params, s1 = opt.update(g, s0)
    with pytest.raises(RuntimeError, match="consumed"):
        opt.update(g, s0)
    with pytest.raises(RuntimeError, match="consumed"):
        fo.state_dict(s0)
    params, s2 = opt.update(g, s1)  # the returned state works
    assert int(s2[1].count) == 2
    assert s2[1].mu["scale"] is s0[1].mu["scale"]  # buffers reused in place


def test_weight_decay_mask_skips_biases():
    params = make_params()
    mask = lambda p: optree.tree_map(lambda t: t.ndim > 1, p)  # noqa: E731
    opt = fo.adamw(lr=1e-2, weight_decay=0.5, weight_decay_mask=mask, cpu_kernel="torch")
    got, _ = ours_run(opt, params, grad_seq(params, 3))
    decayed = torch_run(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.5), params, grad_seq(params, 3))
    plain = torch_run(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0), params, grad_seq(params, 3))
    assert torch.equal(got["layer1"]["bias"], plain["layer1"]["bias"])
    assert torch.equal(got["layer1"]["weight"], decayed["layer1"]["weight"])


def test_apply_if_finite_skips_whole_step():
    params = make_params()
    opt = fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2)))
    state = opt.init(params)
    gs = grad_seq(params, 3)
    params, state = opt.update(gs[0], state)
    snap_p, snap_s = clone(params), clone(fo.state_dict(state))
    for bad in (float("nan"), float("inf")):
        g = clone(gs[1])
        g["layer1"]["weight"][0, 0] = bad
        params, state = opt.update(g, state)
        for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(snap_p)):
            assert torch.equal(a, b)
        for k, v in fo.state_dict(state).items():
            if "notfinite" not in k:
                assert torch.equal(v, snap_s[k]), k
    assert int(state.notfinite_count) == 2 and int(state.total_notfinite) == 2
    params, state = opt.update(gs[1], state)
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 2
    assert int(state.inner_state[1].count) == 2


def test_scale_and_masked():
    g = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    t = fo.masked(fo.scale(3.0), {"w": True, "b": False})
    out, _ = t.update(g, t.init(g))
    assert torch.equal(out["w"], torch.full((2, 2), 3.0)) and torch.equal(out["b"], torch.ones(2))


@pytest.mark.parametrize("mask", [{"w": True, "b": False}, lambda g: {k: True for k in g}],
                         ids=["tree", "callable"])
def test_masked_passes_a_missing_grad_through(mask):
    """A leaf without a grad (None), as the optimizers skip it: masked keeps it None, and the
    chain's optimizer leaves its param as it was."""
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    opt = fo.chain(fo.masked(fo.clip_by_global_norm(1.0), mask), fo.sgd(0.1))
    p, state = opt.update({"w": torch.ones(2, 2), "b": None}, opt.init(params))
    assert torch.equal(p["b"], torch.ones(2))
    torch.testing.assert_close(p["w"], torch.full((2, 2), 0.95))  # clipped to norm 1
    p, state = opt.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, state)


def test_chain_types_and_schedules():
    assert isinstance(fo.chain(fo.scale(1.0), fo.sgd(0.1)), fo.Optimizer)
    assert isinstance(fo.chain(fo.scale(1.0), fo.clip_by_global_norm(1.0)), fo.GradientTransformation)
    with pytest.raises(TypeError, match="last element"):
        fo.chain(fo.sgd(0.1), fo.scale(1.0))
    s = fo.schedules
    assert s.constant(0.3)(100) == 0.3
    assert s.linear_warmup(1.0, 4)(0) == 0.0 and s.linear_warmup(1.0, 4)(2) == 0.5
    assert s.linear_warmup(1.0, 4)(9) == 1.0
    assert math.isclose(s.cosine_decay(2.0, 10, alpha=0.1)(10), 0.2)
    assert math.isclose(s.cosine_decay(2.0, 10)(5), 1.0)
    w = s.warmup_cosine(1.0, 2, 12, end=0.1)
    assert w(2) == 1.0 and math.isclose(w(7), 0.55) and math.isclose(w(50), 0.1)


def test_functional_call_training_loop_converges():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(256, 4)
    y = x.sum(1, keepdim=True).sin()

    def loss_fn(p):
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(3e-2, weight_decay=0.0))
    state = opt.init(params)
    first = loss_fn(params).item()
    for _ in range(150):
        params, state = opt.update(torch.func.grad(loss_fn)(params), state)
    assert loss_fn(params).item() < 0.1 * first


@pytest.mark.parametrize("kernel", KERNELS)
def test_param_storage_replaced_between_updates_is_followed(kernel):
    """``param.data = ...`` between updates (a CPU param with no master: its state is the param
    itself): the next update steps the new storage, not the old one."""
    params = {"w": torch.zeros(1000), "b": torch.zeros(3)}
    opt = fo.sgd(1.0, cpu_kernel=kernel)
    state = opt.init(params)
    params, state = opt.update({"w": torch.ones(1000), "b": torch.ones(3)}, state)
    params["w"].data = torch.zeros(1000)
    params, state = opt.update({"w": torch.ones(1000), "b": torch.ones(3)}, state)
    assert torch.equal(params["w"], torch.full((1000,), -1.0))
    assert torch.equal(params["b"], torch.full((3,), -2.0))


def test_param_dtype_change_between_updates_is_followed():
    """``module.to(dtype)`` between updates (``param.data = ...`` in another dtype): the next
    update steps the new tensors with a kernel that takes their dtype."""
    params = {"w": torch.zeros(100), "b": torch.zeros(3)}
    opt = fo.sgd(1.0)
    state = opt.init(params)
    params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state)
    for v in params.values():
        v.data = v.data.double()
    params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state)
    assert all(v.dtype == torch.float64 and torch.equal(v, torch.full_like(v, -2.0)) for v in params.values())


@pytest.mark.parametrize("placement", ["on_host", "on_device"])
@pytest.mark.parametrize("when", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_param_narrowed_below_fp32_without_a_master_is_refused(placement, when, dtype):
    """An fp32 param (no master) made bf16/fp16 after init, before or between updates, would
    step in its own precision, losing most small updates: the update refuses it, naming it,
    before anything changes; converted back, the state steps on."""
    params = {"w": torch.randn(4096), "b": torch.zeros(3)}
    opt = fo.adamw(1e-4, placement=getattr(fo.placement, placement)())
    state = opt.init(params)
    grads = lambda: {k: torch.ones_like(v) for k, v in params.items()}  # noqa: E731
    for _ in range(when):
        params, state = opt.update(grads(), state)
    before = {k: v.clone() for k, v in params.items()}
    params["w"].data = params["w"].data.to(dtype)
    with pytest.raises(TypeError, match=rf"param 'w' is {dtype} now, but its state keeps no master"):
        opt.update(grads(), state)
    assert int(state.count) == when and torch.equal(params["b"], before["b"])
    params["w"].data = params["w"].data.float()
    params, state = opt.update(grads(), state)
    assert int(state.count) == when + 1


@pytest.mark.parametrize("shape", [(20,), (5, 4)])
def test_small_packed_param_reshaped_between_updates_is_followed(shape):
    """``param.data = param.data.reshape(...)`` on a small bf16 param (its host state shares
    arenas with other small leaves) between updates: the next update steps it as if it had had
    the new shape from the start."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 5, generator=g).bfloat16(), torch.randn(7, generator=g).bfloat16()
    grads = [(torch.randn(20, generator=g).bfloat16(), torch.randn(7, generator=g).bfloat16())
             for _ in range(2)]
    p = {"w": w.clone(), "b": b.clone()}
    opt = fo.adamw(1e-2)
    state = opt.init(p)
    p, state = opt.update({"w": grads[0][0].view(4, 5), "b": grads[0][1]}, state)
    p["w"].data = p["w"].data.reshape(shape)
    p, state = opt.update({"w": grads[1][0].view(shape), "b": grads[1][1]}, state)
    q = {"w": w.reshape(-1).clone(), "b": b.clone()}
    q_state = opt.init(q)
    for gw, gb in grads:
        q, q_state = opt.update({"w": gw, "b": gb}, q_state)
    assert int(state.count) == 2
    assert torch.equal(p["w"].reshape(-1), q["w"]) and torch.equal(p["b"], q["b"])


def test_packs_keep_each_device_s_params_apart():
    """A pack's grads and new params pass through one buffer on one device: small params on
    two devices go to a pack each (state on the host either way), never one across both."""
    from functional_offload.optimizers.packing import arrange
    params = [torch.zeros(8), torch.zeros(8, device="meta"), torch.zeros(8),
              torch.zeros(8, device="meta"), torch.zeros(8)]
    state = [torch.zeros(8) for _ in params]
    packs = arrange(range(len(params)), [state], [True] * len(params), params, pin=False)
    assert sorted(pack.members for pack in packs) == [(0, 2, 4), (1, 3)]


@pytest.mark.parametrize("delay", [False, *DELAYS], ids=["plain", *DELAYS])
@pytest.mark.parametrize("to", [torch.float32, torch.float16])
def test_small_packed_param_changing_dtype_runs_apart_from_its_pack(delay, to):
    """One small bf16 param of a pack made fp32 or fp16 (``param.data = ...``) between updates:
    it runs apart from the rest of its pack (whose grads and new params pass through a buffer
    of their dtype) and gets the bits of a twin too large to pack, given the same values and
    grads; the other member stays packed and equal to its own twin."""
    from functional_offload.optimizers.packing import PACK_MAX
    g = torch.Generator().manual_seed(0)
    small = {"a": torch.randn(100, generator=g).bfloat16(), "b": torch.randn(37, generator=g).bfloat16()}
    twins = {k: torch.cat([v.float(), torch.randn(PACK_MAX, generator=g)]).bfloat16()
             for k, v in small.items()}
    tree = {"small": small, "twin": twins}
    opt = fo.sgd(0.1, momentum=0.9, delayed=DELAYS[delay] if delay else False)
    state = opt.init(tree)

    def grads():
        out = optree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(p.dtype), tree)
        for k, v in tree["small"].items():
            out["twin"][k][:v.numel()] = out["small"][k].to(out["twin"][k].dtype)
        return out

    tree, state = opt.update(grads(), state)
    fo.flush(state)
    for t in (tree["small"]["b"], tree["twin"]["b"]):
        t.data = t.data.to(to)
    for _ in range(3):
        tree, state = opt.update(grads(), state)
    fo.flush(state)
    assert tree["small"]["b"].dtype == to
    for k, v in tree["small"].items():
        assert torch.equal(v, tree["twin"][k][:v.numel()]), k


def test_small_param_reshaped_then_left_without_a_grad_is_followed():
    """A small bf16 param (packed with others on the host) reshaped in place, then an update
    where it has no grad, then one where it has: stepped as if it had had the new shape."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 5, generator=g).bfloat16(), torch.randn(7, generator=g).bfloat16()
    gw, gb = [torch.randn(20, generator=g).bfloat16() for _ in range(2)], torch.randn(7, generator=g).bfloat16()
    p, q = {"w": w.clone(), "b": b.clone()}, {"w": w.reshape(-1).clone(), "b": b.clone()}
    opt = fo.adamw(1e-2)
    state, q_state = opt.init(p), opt.init(q)
    p, state = opt.update({"w": gw[0].view(4, 5), "b": gb}, state)
    q, q_state = opt.update({"w": gw[0], "b": gb}, q_state)
    p["w"].data = p["w"].data.reshape(20)
    for grads in ({"w": None, "b": gb}, {"w": gw[1], "b": gb}):
        p, state = opt.update(grads, state)
        q, q_state = opt.update(grads, q_state)
    assert torch.equal(p["w"], q["w"]) and torch.equal(p["b"], q["b"])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n", [64, 5000])
def test_strided_and_expanded_grads_of_host_params(kernel, n):
    """1-D grads that are strided slices or expanded scalars (of params in host memory, whose
    grads the kernel reads where they are): stepped as their dense copies."""
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(64, 48, generator=g), "b": torch.randn(n, generator=g)}
    grads = [{"a": torch.randn(64, 48, generator=g), "b": torch.randn(n, 2, generator=g)[:, 0]},
             {"a": torch.randn(64, 48, generator=g), "b": torch.randn(1, generator=g).expand(n)}]
    results = []
    for dense in (False, True):
        p = clone(params)
        opt = fo.adamw(1e-2, cpu_kernel=kernel)
        state = opt.init(p)
        for gs in grads:
            p, state = opt.update({k: v.contiguous() if dense else v for k, v in gs.items()}, state)
        results.append(p)
    assert all(torch.equal(results[0][k], results[1][k]) for k in params)


def test_grad_of_a_params_old_shape_is_refused_after_a_reshape():
    """``param.data = param.data.reshape(...)`` keeps the param's memory: a grad of its old
    shape is refused at the next update (naming the leaf), the state left as it was."""
    p = {"w": torch.randn(4, 5), "b": torch.randn(7)}
    opt = fo.adamw(1e-2)
    state = opt.init(p)
    grads = {"w": torch.randn(4, 5), "b": torch.randn(7)}
    p, state = opt.update(grads, state)
    p["w"].data = p["w"].data.reshape(20)
    with pytest.raises(ValueError, match="'w' has shape"):
        opt.update(grads, state)
    assert int(state.count) == 1


@pytest.mark.parametrize("first,then", [("native", "torch"), ("torch", "native")])
def test_cpu_kernel_changed_between_updates_is_followed(first, then):
    """A state stepped with one ``cpu_kernel`` and continued by an optimizer with another runs
    the other kernel: bit for bit as a fresh state of that kernel loaded at the same point."""
    if "native" not in KERNELS:
        pytest.skip("no native kernel here")
    params = make_params()
    grads = grad_seq(params, 3)
    p = clone(params)
    state = fo.adamw(1e-2, cpu_kernel=first).init(p)
    p, state = fo.adamw(1e-2, cpu_kernel=first).update(grads[0], state)
    sd, q = {k: v.clone() for k, v in fo.state_dict(state).items()}, clone(p)
    opt = fo.adamw(1e-2, cpu_kernel=then)
    for g in grads[1:]:
        p, state = opt.update(g, state)
    q_state = fo.load_state_dict(sd, opt.init(q))
    for g in grads[1:]:
        q, q_state = opt.update(g, q_state)
    for a, b in zip(optree.tree_leaves(p), optree.tree_leaves(q)):
        assert torch.equal(a, b)


def test_replaced_moment_storage_is_followed():
    """``state.mu[k].data = ...`` between updates (as helpers that move optimizer state do): the
    next update writes the new storage, and checkpoints see the step."""
    params = make_params()
    grads = grad_seq(params, 3)
    sds = []
    for replace in (False, True):
        p = clone(params)
        opt = fo.adamw(1e-2, ema_decay=0.9)
        state = opt.init(p)
        for g in grads:
            p, state = opt.update(g, state)
            if replace:
                for tree in (state.mu, state.nu, state.ema):
                    for x in optree.tree_leaves(tree):
                        x.data = x.data.clone()
        sds.append(fo.state_dict(state))
    assert sds[0].keys() == sds[1].keys()
    assert all(torch.equal(sds[0][k], sds[1][k]) for k in sds[0])
