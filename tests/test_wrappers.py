"""The optax combinators: MultiSteps (gradient accumulation), inject_hyperparams, partition —
each against its oracle, through checkpoints, streamed, and their consumption and errors."""

import _thread
import re
import threading

import optree
import pytest
import torch
import torch.distributed as dist

import functional_offload as fo
from functional_offload.executor import HostExecutor
from functional_offload.testing import fail_host_kernel, slow_host_kernel
from functional_offload.tree import leaves_with_paths
from conftest import clone, grad_seq, make_params, resume, run, small_executor

LABELS = {"layer1": {"weight": "w", "bias": "b"}, "layer2": {"weight": "w", "bias": "b"},
          "scale": "w"}  # for make_params() trees


def by_ndim(params):
    """Labels for a flat dict of params: matrices "w", vectors "b"."""
    return {k: "w" if v.ndim > 1 else "b" for k, v in params.items()}


def same(a, b):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def snapshot(state):
    return {k: v.clone() for k, v in fo.state_dict(state).items()}


def sub(tree, paths):
    """The leaves of ``tree`` at ``paths`` as ``{path: leaf}`` (what a partition's part sees)."""
    ps, leaves, _ = leaves_with_paths(tree)
    return {p: x for p, x in zip(ps, leaves) if p in paths}


# ---- MultiSteps ----------------------------------------------------------------------------

def mean_grads(cycle):
    """The oracle's grads for one cycle: the sum in fp32 (or wider), over k, cast back; None
    for a leaf that got no grad."""
    flat = [optree.tree_flatten(g, none_is_leaf=True) for g in cycle]
    out = []
    for gs in zip(*(leaves for leaves, _ in flat)):
        got = [g for g in gs if g is not None]
        acc = torch.promote_types(got[0].dtype, torch.float32) if got else None
        out.append((sum(g.to(acc) for g in got) / len(cycle)).to(got[0].dtype) if got else None)
    return optree.tree_unflatten(flat[0][1], out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multisteps_is_the_mean_grad_step_through_a_checkpoint(dtype, tmp_path):
    k = 3
    params = make_params(dtype=dtype)
    grads = grad_seq(params, 2 * k)
    for g in grads[:k]:
        g["layer2"] = {"weight": None, "bias": None}  # no grad in the whole first cycle
    grads[4]["scale"] = None  # one grad of the second cycle missing
    grads[5]["layer1"]["bias"] = None  # the last one missing
    def mk():
        return fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1))

    want, want_state = run(mk(), params, [mean_grads(grads[:k]), mean_grads(grads[k:])])
    opt = fo.MultiSteps(mk(), k)
    p = clone(params)
    s = opt.init(p)
    for j, g in enumerate(grads):
        if j == k + 1:  # mid-cycle
            assert int(s.mini_step) == 1
            p, s = resume(opt, s, p, tmp_path / "ms")
        before = clone(p)
        p, s = opt.update(g, s)
        assert same(p, before) == (j % k != k - 1)  # params move on the last grad of a cycle only
        if j == k - 1:
            assert same(p["layer2"], params["layer2"])
    assert same(p, want) and int(s.mini_step) == 0
    inner = {k.removeprefix("inner_state."): v for k, v in fo.state_dict(s).items()
             if k.startswith("inner_state.")}
    assert same(inner, fo.state_dict(want_state))


def test_multisteps_consumes_its_state_and_checks_grads_first():
    params = make_params()
    opt = fo.MultiSteps(fo.adamw(1e-2), 2)
    s0 = opt.init(params)
    g = grad_seq(params, 1)[0]
    snap = snapshot(s0)
    for bad, exc in [(dict(g, scale=g["scale"].double()), TypeError),
                     ({"layer1": g["layer1"]}, ValueError)]:
        with pytest.raises(exc, match="scale"):
            opt.update(bad, s0)
    assert same(snapshot(s0), snap)  # nothing accumulated
    _, s1 = opt.update(g, s0)
    with pytest.raises(fo.StateError, match="MultiStepsState was consumed"):
        opt.update(g, s0)
    _, s2 = opt.update(g, s1)
    with pytest.raises(fo.StateError, match="consumed"):
        opt.update(g, s1)
    for args, exc in [((fo.adamw(), 0), ValueError), ((fo.adamw(), True), ValueError),
                      ((fo.scale(2.0), 2), TypeError)]:
        with pytest.raises(exc):
            fo.MultiSteps(*args)
    with pytest.raises(TypeError, match="acc_dtype"):
        fo.MultiSteps(fo.adamw(), 2, acc_dtype=torch.int32)


@pytest.fixture
def mesh(tmp_path):
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    yield tensor_api, init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_multisteps_over_dtensor_params_hands_dtensor_means_on(mesh):
    tensor_api, m = mesh
    params = make_params(dtype=torch.bfloat16)
    grads = grad_seq(params, 4)
    def mk():
        return fo.MultiSteps(fo.chain(fo.clip_by_global_norm(0.1), fo.adamw(1e-2)), 2)

    def shard(tree):
        return optree.tree_map(
            lambda t: tensor_api.distribute_tensor(t.clone(), m, [tensor_api.Shard(0)]), tree)

    want, _ = run(mk(), params, grads)
    got, _ = run(mk(), shard(params), [shard(g) for g in grads])
    assert all(isinstance(x, tensor_api.DTensor) for x in optree.tree_leaves(got))
    assert same([x.to_local() for x in optree.tree_leaves(got)], want)


# ---- inject_hyperparams ----------------------------------------------------------------------

def test_inject_hyperparams_equals_the_schedule_through_a_checkpoint(tmp_path):
    sched = fo.schedules.warmup_cosine(1e-2, 2, 8)
    params = make_params(dtype=torch.bfloat16)
    grads = grad_seq(params, 6)
    want, want_state = run(fo.adamw(sched, weight_decay=0.1), params, grads)
    opt = fo.inject_hyperparams(fo.adamw)(lr=sched, weight_decay=0.1)
    p = clone(params)
    s = opt.init(p)
    assert sorted(s.hyperparams) == ["eps", "lr", "weight_decay"]  # betas: a tuple, static
    assert s.hyperparams["lr"].item() == sched(0)
    for n, g in enumerate(grads):
        if n == 3:
            p, s = resume(opt, s, p, tmp_path / "inject")
        p, s = opt.update(g, s)
        assert s.hyperparams["lr"].item() == sched(n) and int(s.count) == n + 1
    assert same(p, want) and same(fo.state_dict(s.inner_state), fo.state_dict(want_state))


def test_changed_hyperparams_take_effect_and_are_checkpointed(tmp_path):
    params = make_params()
    grads = grad_seq(params, 4)
    lrs, wds = [1e-2, 1e-2, 3e-3, 3e-3], [0.05, 0.05, 0.2, 0.2]
    want, _ = run(fo.adamw(lambda n: lrs[n], weight_decay=lambda n: wds[n]), params, grads)
    opt = fo.inject_hyperparams(fo.adamw)(lr=1e-2, weight_decay=0.05)
    p = clone(params)
    s = opt.init(p)
    for n, g in enumerate(grads):
        if n == 2:
            new = {"lr": torch.tensor(3e-3, dtype=torch.float64),
                   "weight_decay": torch.tensor(0.2, dtype=torch.float64)}
            s = s._replace(hyperparams={**s.hyperparams, **new})
            p, s = resume(opt, s, p, tmp_path / "hp")
            assert s.hyperparams["lr"].item() == 3e-3
        p, s = opt.update(g, s)
    assert same(p, want)


def test_inject_hyperparams_of_a_gradient_transformation():
    opt = fo.chain(fo.inject_hyperparams(fo.clip_by_global_norm)(max_norm=1.0), fo.sgd(lr=1.0))
    s = opt.init({"w": torch.zeros(2)})
    p, s = opt.update({"w": torch.tensor([3.0, 4.0])}, s)
    assert torch.allclose(p["w"], torch.tensor([-0.6, -0.8]))
    s = (s[0]._replace(hyperparams={"max_norm": torch.tensor(10.0, dtype=torch.float64)}), s[1])
    p, s = opt.update({"w": torch.tensor([3.0, 4.0])}, s)
    assert torch.allclose(p["w"], torch.tensor([-3.6, -4.8]))


def test_inject_hyperparams_errors_change_nothing():
    with pytest.raises(ValueError, match="lr"):
        fo.inject_hyperparams(fo.adamw)(lr=-1.0)
    with pytest.raises(ValueError, match="static_args.*nope"):
        fo.inject_hyperparams(fo.adamw, static_args="nope")
    mask = lambda p: {k: v.ndim > 1 for k, v in p.items()}  # noqa: E731
    with pytest.raises(TypeError, match="'weight_decay_mask'.*static_args"):
        fo.inject_hyperparams(fo.adamw)(weight_decay_mask=mask)
    fo.inject_hyperparams(fo.adamw, static_args="weight_decay_mask")(weight_decay_mask=mask)
    opt = fo.inject_hyperparams(fo.adamw)(lr=1e-2)
    params = make_params()
    s = opt.init(params)
    g = grad_seq(params, 1)[0]
    snap = snapshot(s)
    hp = lambda **kw: s._replace(hyperparams={**s.hyperparams, **kw})  # noqa: E731
    for bad, exc, match in [(hp(lr=torch.tensor(-1.0, dtype=torch.float64)), ValueError, "lr"),
                            (hp(lr=torch.tensor(1e-3)), TypeError, "'lr'.*float64"),
                            (s._replace(hyperparams={}), ValueError, "exactly")]:
        with pytest.raises(exc, match=match):
            opt.update(g, bad)
    assert same(snapshot(s), snap)
    opt.update(g, s)
    with pytest.raises(fo.StateError, match="InjectHyperparamsState was consumed"):
        opt.update(g, s)


# ---- partition -------------------------------------------------------------------------------

def test_partition_equals_its_parts_run_separately():
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 4)
    mk_w = lambda: fo.adamw(1e-2, weight_decay=0.1, executor=small_executor(),  # noqa: E731
                            placement=fo.placement.offload_fraction(0.5))
    mk_b = lambda: fo.chain(fo.clip_by_global_norm(0.1),  # noqa: E731
                            fo.sgd(0.05, momentum=0.9, placement=fo.placement.on_device()))
    got, s = run(fo.partition({"w": mk_w(), "b": mk_b()}, LABELS), params, grads)
    for label, mk in [("w", mk_w), ("b", mk_b)]:
        paths = {p for p, name in zip(leaves_with_paths(params)[0], optree.tree_leaves(LABELS))
                 if name == label}
        want, want_state = run(mk(), sub(params, paths), [sub(g, paths) for g in grads])
        assert same(sub(got, paths), want)
        assert same(fo.state_dict(s.inner_states[label]), fo.state_dict(want_state))
    assert fo.params_of(s) is got and int(s.refs.count) == 4


def test_plan_covers_every_part_each_placing_its_leaves_in_the_model_order():
    shapes = {"layer2.weight": (64, 64), "layer2.bias": (64,), "layer1.weight": (64, 48),
              "layer1.bias": (64,)}  # named_parameters() order, not sorted
    meta = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in shapes.items()}
    opt = fo.partition({"w": fo.adamw(placement=fo.placement.offload_fraction(0.5)),
                        "b": fo.sgd(0.1, momentum=0.9, placement=fo.placement.on_device())},
                       by_ndim)
    plan = fo.plan(opt, meta)
    # offload_fraction walks the weights in the model's order: layer2.weight reaches half
    assert dict(zip(plan.paths, plan.on_host)) == {"layer2.weight": True, "layer1.weight": False,
                                                   "layer2.bias": False, "layer1.bias": False}
    assert plan.host_bytes == 12 * 64 * 64  # master, mu, nu
    assert plan.device_bytes == 12 * 64 * 48 + 8 * 128  # sgd: master, momentum
    host = fo.placement.on_host()
    wrapped = fo.MultiSteps(fo.inject_hyperparams(fo.adamw)(lr=1e-3, placement=host), 4)
    assert fo.plan(wrapped, meta) == fo.plan(fo.adamw(placement=host), meta)  # seen through


def test_partition_errors_name_the_label_and_the_leaf(tmp_path):
    params = make_params()
    two = {"w": fo.adamw(), "b": fo.sgd(0.1)}
    all_w = lambda p: optree.tree_map(lambda _: "w", p)  # noqa: E731
    for labels, exc, match in [
            ({**LABELS, "layer1": {"weight": "w", "bias": "x"}}, ValueError,
             "'layer1.bias' has the label 'x'"),
            (all_w, ValueError, "label 'b' has a transformation but no leaf"),
            ({k: v for k, v in LABELS.items() if k != "scale"}, ValueError,
             r"without a label \['scale'\]"),
            ({**LABELS, "scale": 3}, TypeError, "label of leaf 'scale' is 3")]:
        with pytest.raises(exc, match=match):
            fo.partition(two, labels).init(params)
    with pytest.raises(TypeError, match=r"optimizers \['w'\] and gradient transformations \['b'\]"):
        fo.partition({"w": fo.adamw(), "b": fo.scale(1.0)}, LABELS)
    opt = fo.partition(two, LABELS)
    s = opt.init(params)
    g = grad_seq(params, 1)[0]
    snap = snapshot(s)
    with pytest.raises(TypeError, match="'layer1.bias'"):  # a bad grad of the second part
        opt.update({**g, "layer1": {**g["layer1"], "bias": g["layer1"]["bias"].double()}}, s)
    assert same(snapshot(s), snap)
    opt.update(g, s)
    for action in (lambda: opt.update(g, s), lambda: fo.save(s, tmp_path / "x")):
        with pytest.raises(fo.StateError, match="PartitionRefs was consumed"):
            action()


def _one_update_saved(opt, params, grads, path):
    """``opt`` over a copy of ``params`` after one update with ``grads``, its state saved to
    ``path``: (opt, params, state, a copy of the params then)."""
    p = clone(params)
    p, s = opt.update(grads, opt.init(p))
    fo.save(s, path)
    return opt, p, s, clone(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_torn_partition_step_is_failed_until_a_checkpoint_is_loaded(tmp_path, dtype):
    """One part steps, the other fails (the parts run at once, each in a thread: which one's
    chunk comes first is not fixed): the state is failed. bf16 params have masters, so a load
    into it recovers; fp32 ones were changed in place without one, so a load into it is refused
    naming the stepped part's params, and one into a new state (the model's params restored)
    recovers."""
    ex = HostExecutor(chunk_bytes=1 << 20, slots=2, threads=1)  # one chunk per part

    def mk():
        return fo.partition({"w": fo.adamw(1e-2, executor=ex),
                             "b": fo.sgd(0.1, momentum=0.9, executor=ex)}, LABELS)

    params = make_params(dtype=dtype)
    grads = grad_seq(params, 3)
    want, _ = run(mk(), params, grads)
    opt, p, s, good = _one_update_saved(mk(), params, grads[0], tmp_path / "good")
    with fail_host_kernel(after=1):  # one part runs, the other fails
        with pytest.raises(fo.HostStepError):
            opt.update(grads[1], s)
    for action in (lambda: opt.update(grads[1], s), lambda: fo.save(s, tmp_path / "good")):
        with pytest.raises(fo.StateError, match="PartitionRefs is failed"):
            action()
    if dtype == torch.float32:
        with pytest.raises(fo.StateError, match="in place") as e:
            fo.load(tmp_path / "good", like=s)
        named = set(re.findall(r"'([\w.]+)'", str(e.value)))
        label = dict(zip(leaves_with_paths(params)[0], optree.tree_leaves(LABELS)))
        assert named in ({k for k, v in label.items() if v == part} for part in "wb"), named
        for x, y in zip(optree.tree_leaves(p), optree.tree_leaves(good)):
            x.copy_(y)  # the model's own checkpoint
        s = opt.init(p)
    s = fo.load(tmp_path / "good", like=s)
    for g in grads[1:]:
        p, s = opt.update(g, s)
    assert same(p, want)


@pytest.mark.parametrize("surfaced", ["flush", "save", "land"])
def test_a_delayed_part_failing_after_the_update_returned_tears_the_partition(tmp_path, surfaced):
    """A delayed part's host step fails in the background and the error surfaces at a flush, a
    save or a landing, after the update returned: the other part applied that update in place
    (fp32 params, no master), so the partition's state is failed and a load into it is refused
    naming that part's params (it would apply their step twice); into a new state (the
    model's params restored) it recovers the run without the failure."""
    ex = HostExecutor(chunk_bytes=1 << 16, slots=2, threads=1)

    def mk():
        return fo.partition({"w": fo.adamw(1e-2, delayed=fo.Delay(lookahead=False), executor=ex),
                             "b": fo.sgd(0.1, momentum=0.9, executor=ex)}, LABELS)

    params = make_params()
    grads = grad_seq(params, 3)
    want, want_state = run(mk(), params, grads)
    fo.flush(want_state)
    opt, p, s, good = _one_update_saved(mk(), params, grads[0], tmp_path / "good")
    label = dict(zip(leaves_with_paths(params)[0], optree.tree_leaves(LABELS)))
    with fail_host_kernel(leaves=[k for k, v in label.items() if v == "w"]):
        p, s = opt.update(grads[1], s)  # returns: the "w" part's step runs in the background
        surface = {"flush": lambda: fo.flush(s), "save": lambda: fo.save(s, tmp_path / "bad"),
                   "land": lambda: fo.land(s, p)}[surfaced]
        with pytest.raises(fo.HostStepError):
            surface()
    with pytest.raises(fo.StateError, match="failed"):
        opt.update(grads[2], s)
    with pytest.raises(fo.StateError, match="in place") as e:
        fo.load(tmp_path / "good", like=s)
    assert set(re.findall(r"'([\w.]+)'", str(e.value))) == {k for k, v in label.items() if v == "b"}
    for x, y in zip(optree.tree_leaves(p), optree.tree_leaves(good)):
        x.copy_(y)  # the model's own checkpoint
    s = fo.load(tmp_path / "good", like=opt.init(p))
    for g in grads[1:]:
        p, s = opt.update(g, s)
    fo.flush(s)
    assert same(p, want)


def test_ctrl_c_during_a_partition_update_completes_the_step_then_raises():
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 3)
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=1)

    def mk():
        return fo.partition({"w": fo.adamw(1e-2, executor=ex), "b": fo.sgd(0.1, executor=ex)},
                            LABELS)

    want, _ = run(mk(), params, grads)
    opt = mk()
    p, s = run(opt, params, grads[:1])
    with slow_host_kernel(0.1):  # part "w": 4 chunks, 0.4 s; the interrupt comes in the first
        threading.Timer(0.15, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            p, s = opt.update(grads[1], s)  # the assignment never happens
    assert int(s.refs.count) == 2  # the state passed in holds the whole step
    p, s = opt.update(grads[2], s)
    assert same(p, want)


def test_partition_of_gradient_transformations():
    opt = fo.chain(fo.partition({"w": fo.clip_by_global_norm(1.0), "b": fo.scale(0.5)}, by_ndim),
                   fo.sgd(lr=1.0))
    p, _ = opt.update({"w": torch.tensor([[3.0, 4.0]]), "b": torch.tensor([2.0])},
                      opt.init({"w": torch.zeros(1, 2), "b": torch.zeros(1)}))
    assert torch.allclose(p["w"], torch.tensor([[-0.6, -0.8]]))
    assert torch.equal(p["b"], torch.tensor([-1.0]))


# ---- streaming every wrapper -----------------------------------------------------------------

def _model(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return model.to(device, torch.bfloat16)


def _opt(kind, device):
    """The optimizer of each case (clipping that redoes the step, or that keeps it)."""
    place = fo.placement.offload_fraction(0.5) if device == "cuda" else None

    def adamw():
        return fo.adamw(1e-2, weight_decay=0.1, executor=small_executor(), placement=place)

    if kind == "multisteps":
        return fo.MultiSteps(fo.chain(fo.clip_by_global_norm(0.05), adamw()), 2)
    if kind == "inject":
        return fo.inject_hyperparams(fo.adamw)(
            lr=fo.schedules.linear_warmup(1e-2, 3), executor=small_executor(), placement=place)
    if kind == "partition":  # both parts on one executor, both running ahead in backward
        ex = small_executor()
        return fo.chain(fo.clip_by_global_norm(0.05), fo.partition(
            {"w": fo.adamw(1e-2, weight_decay=0.1, executor=ex, placement=place),
             "b": fo.sgd(0.1, momentum=0.9, executor=ex, placement=fo.placement.on_device())},
            by_ndim))
    return fo.MultiSteps(fo.chain(fo.clip_by_global_norm(1e6), fo.partition(  # all together
        {"w": fo.inject_hyperparams(fo.adamw)(
            lr=lambda n: 1e-2 / (n + 1), executor=small_executor(), placement=place),
         "b": fo.sgd(0.1, executor=small_executor())}, by_ndim)), 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", ["multisteps", "inject", "partition", "all"])
def test_streamed_equals_plain_bit_for_bit(kind, device):
    outs = []
    for streamed in (False, True):
        model = _model(device)
        params = dict(model.named_parameters())
        opt = _opt(kind, device)
        state = opt.init(params)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(32, 16, generator=g).to(device, torch.bfloat16)
            loss = model(x).float().square().mean()
            if streamed:
                with fo.stream(opt, state) as s:
                    loss.backward()
                params, state = s.finish()
                assert s.arrived == set(range(len(params)))  # every part got its grads in backward
            else:
                loss.backward()
                params, state = opt.update({k: p.grad for k, p in params.items()}, state)
            model.zero_grad(set_to_none=True)
        outs.append((clone(params), fo.state_dict(state)))
    assert same(outs[0][0], outs[1][0]) and same(outs[0][1], outs[1][1])


@pytest.mark.cuda
def test_cuda_wrappers_keep_each_part_where_placed():
    model = _model("cuda")
    params = dict(model.named_parameters())
    ms = fo.MultiSteps(fo.adamw(placement=fo.placement.on_host()), 2).init(params)
    assert all(a.is_cuda and a.dtype == torch.float32 for a in optree.tree_leaves(ms.acc_grads))
    s = fo.partition({"w": fo.adamw(placement=fo.placement.on_host()),
                      "b": fo.adamw(placement=fo.placement.on_device())}, by_ndim).init(params)
    assert all(m.device.type == "cpu" for m in optree.tree_leaves(s.inner_states["w"].mu))
    assert all(m.is_cuda for m in optree.tree_leaves(s.inner_states["b"].mu))


def test_ema_params_of_a_partition_state_is_a_tree_like_the_params():
    """fo.ema_params on a partition's state: each param's EMA from the part that steps it (it
    raised AttributeError); a part without ema_decay is named in a ValueError."""
    p = {"w": torch.zeros(2), "v": torch.zeros(3)}
    opt = fo.partition({"a": fo.sgd(1.0, ema_decay=0.5), "b": fo.adamw(0.1, ema_decay=0.5)},
                       {"w": "a", "v": "b"})
    p, s = opt.update({"w": torch.ones(2), "v": torch.ones(3)}, opt.init(p))
    ema = fo.ema_params(s)
    assert list(ema) == ["w", "v"]
    assert torch.equal(ema["w"], torch.full((2,), -0.5))
    assert torch.allclose(ema["v"], 0.5 * p["v"])
    mixed = fo.partition({"a": fo.sgd(1.0, ema_decay=0.5), "b": fo.sgd(1.0)}, {"w": "a", "v": "b"})
    with pytest.raises(ValueError, match=r"\['v'\].*ema_decay"):
        fo.ema_params(mixed.init({"w": torch.zeros(2), "v": torch.zeros(3)}))


def test_a_hyperparameter_written_in_another_dtype_is_refused_before_it_is_saved(tmp_path):
    """A float32 tensor written into an inject_hyperparams state under MultiSteps steps the
    accumulation, but fo.save refuses it, naming it (it saved, then did not load into init)."""
    opt = fo.MultiSteps(fo.inject_hyperparams(fo.adamw)(lr=0.1), 2)
    st = opt.init({"w": torch.zeros(3)})
    inner = st.inner_state._replace(hyperparams={"lr": torch.tensor(0.01)})
    _, st = opt.update({"w": torch.ones(3)}, st._replace(inner_state=inner))
    with pytest.raises(TypeError, match=r"hyperparams\['lr'\].*float32.*float64"):
        fo.save(st, tmp_path / "opt")
    assert not (tmp_path / "opt").exists()
