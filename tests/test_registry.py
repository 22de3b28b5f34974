"""Every optimizer of the registry (``registry.py``) through the properties users rely on."""

import optree
import pytest
import torch

import functional_offload as fo
from conftest import DELAYS, STALE, KERNELS, clone, delay_of, grad_seq, make_params, run, small_executor
from registry import OPTIMIZERS

STEPS = 12
ENTRIES = {e.name: e for e in OPTIMIZERS}
names = pytest.mark.parametrize("name", list(ENTRIES))


def rel(a, b):
    return max(((x.double() - y.double()).abs().max() / y.double().abs().max().clamp(min=1e-30)).item()
               for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


@names
@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_its_oracle(name, kernel):
    e = ENTRIES[name]
    if kernel == "native" and not e.native:
        pytest.skip("no native op")
    params = make_params(big=True)
    grads = grad_seq(params, STEPS)
    got, state = run(e.make(**e.hypers, cpu_kernel=kernel, executor=small_executor()), params, grads)
    want = e.oracle(params, grads)
    assert int(state.count) == STEPS
    if e.exact and kernel == "torch":
        assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(got), optree.tree_leaves(want)))
    assert rel(got, want) <= 1e-6


@names
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_low_precision_params_follow_fp32_masters(name, kernel, low):
    e = ENTRIES[name]
    if kernel == "native" and not e.native:
        pytest.skip("no native op")
    params = optree.tree_map(lambda t: t.to(low), make_params(7, big=True))
    grads = grad_seq(params, STEPS, seed=8)
    got, state = run(e.make(**e.hypers, cpu_kernel=kernel, executor=small_executor()), params, grads)
    want = e.oracle(optree.tree_map(lambda t: t.float(), params),
                    [optree.tree_map(lambda t: t.float(), g) for g in grads])
    assert rel(state.master, want) <= 1e-6
    for p, m in zip(optree.tree_leaves(got), optree.tree_leaves(state.master)):
        assert p.dtype == low and m.dtype == torch.float32 and torch.equal(p, m.to(low))


@names
@pytest.mark.parametrize("kernel", KERNELS)
def test_native_and_torch_kernels_agree(name, kernel):
    """The math is written once per backend; the backends must agree on every optimizer."""
    e = ENTRIES[name]
    if kernel == "torch" or not e.native:
        pytest.skip("compares the native kernel with the torch one")
    params = make_params(3, dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, STEPS, seed=4)
    outs = [run(e.make(**e.hypers, cpu_kernel=k, executor=small_executor()), params, grads)[1]
            for k in ("torch", "native")]
    assert rel(outs[1].master, outs[0].master) <= 1e-6


@names
def test_checkpoint_resume_is_bit_exact(name, tmp_path):
    e = ENTRIES[name]
    mk = lambda: fo.chain(fo.clip_by_global_norm(1.0), e.make(**e.hypers))  # noqa: E731
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 8)
    straight, _ = run(mk(), params, grads)
    p, s = clone(params), None
    opt = mk()
    s = opt.init(p)
    for g in grads[:4]:
        p, s = opt.update(g, s)
    fo.save(s, tmp_path / "opt")
    p = clone(p)
    s = fo.load(tmp_path / "opt", like=opt.init(p))
    for g in grads[4:]:
        p, s = opt.update(g, s)
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(p), optree.tree_leaves(straight)))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 4)).to(torch.bfloat16)


@names
@pytest.mark.parametrize("clip", [None, 0.05, 1e6])
def test_streamed_equals_plain_bit_for_bit(name, clip):
    e = ENTRIES[name]
    outs = []
    for streamed in (False, True):
        model = _model()
        params = dict(model.named_parameters())
        opt = e.make(**e.hypers, executor=small_executor())
        if clip is not None:
            opt = fo.chain(fo.clip_by_global_norm(clip), opt)
        state = opt.init(params)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            loss = model(torch.randn(32, 16, generator=g).to(torch.bfloat16)).float().square().mean()
            if streamed:
                with fo.stream(opt, state) as s:
                    loss.backward()
                params, state = s.finish()
            else:
                loss.backward()
                params, state = opt.update({k: p.grad for k, p in params.items()}, state)
            model.zero_grad(set_to_none=True)
        outs.append((clone(params), fo.state_dict(state)))
    assert all(torch.equal(outs[0][0][k], outs[1][0][k]) for k in outs[0][0])
    assert all(torch.equal(outs[0][1][k], outs[1][1][k]) for k in outs[0][1])


@names
@pytest.mark.parametrize("delay", DELAYS)
def test_delayed_applies_the_same_updates_in_the_end(name, delay):
    """With grads that do not depend on the params, delaying changes nothing but timing; the
    first update leaves the params as they were."""
    e = ENTRIES[name]
    if not e.delayed:
        with pytest.raises(ValueError, match="delayed"):
            e.make(**e.hypers, delayed=STALE)
        return
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 6)
    now, s_now = run(e.make(**e.hypers, executor=small_executor()), params, grads)
    p = clone(params)
    opt = e.make(**e.hypers, delayed=DELAYS[delay], executor=small_executor())
    s = opt.init(p)
    p, s = opt.update(grads[0], s)
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(p), optree.tree_leaves(params)))
    for g in grads[1:]:
        p, s = opt.update(g, s)
    fo.flush(s)
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(p), optree.tree_leaves(now)))
    assert all(torch.equal(v, fo.state_dict(s_now)[k]) for k, v in fo.state_dict(s).items())


@names
def test_bad_grads_raise_naming_the_leaf_and_change_nothing(name):
    e = ENTRIES[name]
    params = make_params()
    opt = e.make(**e.hypers)
    state = opt.init(params)
    snap = {k: v.clone() for k, v in fo.state_dict(state).items()}
    good = grad_seq(params, 1)[0]
    for bad, exc in [(dict(good, scale=good["scale"].double()), TypeError),
                     (dict(good, scale=torch.zeros(3, 5)), ValueError),
                     ({k: v for k, v in good.items() if k != "scale"}, ValueError)]:
        with pytest.raises(exc, match="scale"):
            opt.update(bad, state)
    assert all(torch.equal(v, snap[k]) for k, v in fo.state_dict(state).items())
    opt.update(good, state)


@names
def test_none_grads_leave_their_leaves_alone_and_donation_holds(name):
    e = ENTRIES[name]
    params = make_params()
    opt = e.make(**e.hypers)
    s0 = opt.init(params)
    params, s1 = opt.update(grad_seq(params, 1)[0], s0)
    with pytest.raises(fo.StateError, match="consumed"):
        opt.update(grad_seq(params, 1)[0], s0)
    before = clone((params["layer2"], fo.state_dict(s1)))
    g = grad_seq(params, 1, seed=3)[0]
    g["layer2"] = {"weight": None, "bias": None}
    params, s2 = opt.update(g, s1)
    assert all(torch.equal(params["layer2"][k], before[0][k]) for k in ("weight", "bias"))
    sd = fo.state_dict(s2)
    assert all(torch.equal(sd[k], v) for k, v in before[1].items() if "layer2" in k)


@names
def test_plan_shows_what_init_places(name):
    e = ENTRIES[name]
    opt = e.make(**e.hypers, placement=fo.placement.offload_fraction(0.5))
    meta = optree.tree_map(lambda t: torch.empty(t.shape, dtype=torch.bfloat16, device="meta"),
                           make_params(big=True))
    plan = fo.plan(opt, meta)
    real = optree.tree_map(lambda t: t.to(torch.bfloat16), make_params(big=True))
    state = opt.init(real)  # CPU params: everything on the host; the bytes must agree
    report = fo.placement_report(state)
    assert plan.host_bytes + plan.device_bytes == report.host_bytes - 8  # less the count
    assert 0 < plan.fraction < 1 and plan.host_bytes > 0 and plan.device_bytes > 0


@names
@pytest.mark.parametrize("mode", ["plain", "stream", "delayed", "ahead"])
def test_ema_follows_its_recursion(name, mode):
    """``ema_decay=d``: e_0 is the initial params in fp32, e_t = lerp(e_{t-1}, master_t, 1 - d)
    after each step, in the same pass as the step (host and device), streamed and delayed too."""
    e = ENTRIES[name]
    if mode in ("delayed", "ahead") and not e.delayed:
        pytest.skip("no delayed mode")
    d = 0.9
    model = _model()
    params = dict(model.named_parameters())
    opt = e.make(**e.hypers, ema_decay=d, executor=small_executor(), delayed=delay_of(mode))
    state = opt.init(params)
    want = {k: v.detach().float().clone() for k, v in params.items()}
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        loss = model(torch.randn(32, 16, generator=g).to(torch.bfloat16)).float().square().mean()
        if mode == "stream":
            with fo.stream(opt, state) as s:
                loss.backward()
            params, state = s.finish()
        else:
            loss.backward()
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
            fo.flush(state)
        for k in want:
            want[k] = torch.lerp(want[k], state.master[k], 1 - d)
        model.zero_grad(set_to_none=True)
    got = fo.ema_params(state)
    assert rel(got, want) <= 1e-6
    sd = fo.state_dict(state)
    assert all(torch.equal(sd[f"ema.{k}"], got[k]) for k in want)  # checkpointed with the state


@names
def test_small_leaves_packed_together_step_as_they_would_alone(name):
    """Small low-precision leaves share arenas and move in one copy each way; a leaf without a
    grad inside a pack, with another weight decay or with another dtype (bf16 and fp16 in one
    tree) stays as it would alone."""
    e = ENTRIES[name]
    g = torch.Generator().manual_seed(0)
    params = {f"b{i}": torch.randn(7 + i, generator=g).to(torch.float16 if i % 3 == 1 else torch.bfloat16)
              for i in range(12)}
    params["w"] = torch.randn(40, 30, generator=g).to(torch.bfloat16)
    mask = {k: k in ("b3", "b4", "w") for k in params}
    grads = [{k: (None if (k == "b5" and s % 2) else torch.randn(v.shape, generator=g).to(v.dtype))
              for k, v in params.items()} for s in range(4)]
    outs = []
    for alone in (False, True):
        p = clone(params)
        opt = e.make(**e.hypers, executor=small_executor(),
                     **({"weight_decay_mask": mask} if "weight_decay" in e.hypers else {}))
        s = opt.init(p)
        if alone:  # each leaf stepped by itself: the reference
            outs.append({k: run(e.make(**e.hypers, executor=small_executor(),
                                       **({"weight_decay_mask": {k: mask[k]}} if "weight_decay" in e.hypers else {})),
                                {k: params[k]}, [{k: gr[k]} for gr in grads])[0][k] for k in params})
            continue
        for gr in grads:
            p, s = opt.update(gr, s)
        outs.append(p)
    for k in params:
        assert torch.equal(outs[0][k], outs[1][k]), k
