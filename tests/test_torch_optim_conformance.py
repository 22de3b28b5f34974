"""fo.TorchOptimizer keeps torch.optim's contract: one entry per adapter (AdamW, Adam, SGD with
and without momentum/Nesterov), each driven through the behaviours tools rely on, with the
matching torch.optim class as the oracle (fp32 params and cpu_kernel="torch": bit for bit)."""

import contextlib
import copy
import io
import pickle
import warnings
from typing import Callable, NamedTuple

import pytest
import torch
from torch.nn import Parameter
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import functional_offload as fo
from conftest import STALE


class Info(NamedTuple):
    """What the tests know of one adapter (in the spirit of torch's OptimizerInfo)."""

    name: str
    fo: Callable
    torch_cls: type
    inputs: list  # constructor kwargs that both accept
    keys: tuple  # torch's per-param state keys
    errors: list  # (kwargs, exception, regex) raised at construction

    def ours(self, params, **kw):
        return fo.TorchOptimizer(params, self.fo, cpu_kernel="torch", **kw)

    def ref(self, params, **kw):
        return self.torch_cls(params, **kw)


COMMON_ERRORS = [
    (dict(lr=-1), ValueError, "Invalid learning rate: -1"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
    (dict(weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
    (dict(foreach=True, fused=True), RuntimeError, "`fused` and `foreach` cannot be `True` together"),
    (dict(differentiable=True), ValueError, "differentiable=True is not supported"),
    (dict(lr=torch.tensor(1e-3), foreach=True), ValueError, "lr as a Tensor is not supported"),
]
ADAM_INPUTS = [
    {}, {"lr": 0.01}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "maximize": True},
    {"lr": torch.tensor(0.001)}, {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05},
]
ADAM_ERRORS = COMMON_ERRORS + [
    (dict(betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, 1.0)), ValueError, "Invalid beta parameter at index 1: 1.0"),
    (dict(eps=-1), ValueError, "Invalid epsilon value: -1"),
    (dict(betas=(0.9, torch.tensor(0.99))), ValueError, "betas must be either both floats or both Tensors"),
    (dict(amsgrad=True), ValueError, "amsgrad=True is not supported"),
    (dict(capturable=True), ValueError, "capturable=True is not supported"),
]
SGD_ERRORS = COMMON_ERRORS + [
    (dict(momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
    (dict(nesterov=True), ValueError, "Nesterov momentum requires a momentum and zero dampening"),
    (dict(momentum=0.9, dampening=0.5), ValueError, "dampening=0.5 is not supported"),
]
INFOS = [
    Info("adamw", fo.adamw, torch.optim.AdamW, ADAM_INPUTS, ("exp_avg", "exp_avg_sq"), ADAM_ERRORS),
    Info("adam", fo.adam, torch.optim.Adam, ADAM_INPUTS, ("exp_avg", "exp_avg_sq"), ADAM_ERRORS),
    Info("sgd", fo.sgd, torch.optim.SGD,
         [{}, {"lr": 1e-2}, {"lr": torch.tensor(0.01)}, {"weight_decay": 0.5},
          {"weight_decay": 0.1, "maximize": True}], (), SGD_ERRORS),
    Info("sgd_momentum", fo.sgd, torch.optim.SGD,
         [{"momentum": 0.9}, {"momentum": 0.9, "weight_decay": 0.1, "lr": 1e-2},
          {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
          {"momentum": 0.5, "maximize": True}], ("momentum_buffer",), SGD_ERRORS),
]
BY_NAME = {i.name: i for i in INFOS}
ALL = [pytest.param(i, id=i.name) for i in INFOS]
EACH_INPUT = [pytest.param(i, kw, id=f"{i.name}-{j}") for i in INFOS for j, kw in enumerate(i.inputs)]


def fresh(kw):
    return copy.deepcopy(kw)  # tensor lrs are written in place by schedulers


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [Parameter(torch.randn(10, 5, generator=g).to(dtype)),
            Parameter(torch.randn(10, generator=g).to(dtype)),
            Parameter(torch.randn(3, 10, generator=g).to(dtype))]


def clone_params(params):
    return [Parameter(p.detach().clone()) for p in params]


def set_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def loss_step(opt, params, seed, x=None):
    """A real forward/backward through the params, then the step."""
    w, b, v = params
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed)).to(w.dtype)
    opt.zero_grad()
    (torch.tanh(x @ w.t() + b) @ v.t()).square().mean().backward()
    opt.step()


def assert_same_params(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"param {i}: max diff {(x - y).abs().max()}"


def assert_same_state(ours, ref, params_ours, params_ref, keys):
    for i, (p, q) in enumerate(zip(params_ours, params_ref)):
        for k in keys:
            assert torch.equal(ours.state[p][k], ref.state[q][k]), (i, k)
        if "exp_avg" in keys:  # torch's SGD keeps no step (ours does; SGD's math ignores it)
            assert float(ours.state[p]["step"]) == float(ref.state[q]["step"]), i


def state_dicts_equal(a, b, names=True):
    assert a.keys() == b.keys()
    ga = [{k: v for k, v in g.items() if names or k != "param_names"} for g in a["param_groups"]]
    gb = [{k: v for k, v in g.items() if names or k != "param_names"} for g in b["param_groups"]]
    assert ga == gb
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][k]), (i, k)


# ---- construction ------------------------------------------------------------------------

@pytest.mark.parametrize("info", ALL)
def test_construction_errors_are_torchs(info):
    p = make_params()
    for kw, exc, regex in info.errors:
        with pytest.raises(exc, match=regex):
            info.ours(p, **kw)
        # add_param_group checks the group's values too, and leaves the optimizer as it was
        opt = info.ours([p[0]])
        with pytest.raises(exc, match=regex):
            opt.add_param_group({"params": [p[1]], **kw})
        assert len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        info.ours(p[0])
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        info.ours([("w", p[0]), p[1]])
    with pytest.raises(ValueError, match="cannot add param group with names"):
        info.ours([{"params": [p[0]]}, {"params": [("b", p[1])]}])
    with pytest.raises(ValueError, match="cannot add param group without names"):
        info.ours([{"params": [("w", p[0])]}, {"params": [p[1]]}])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        info.ours([{"params": [p[0]]}, {"params": [p[0]]}])
    with pytest.raises(TypeError, match="does not take"):
        info.ours(p, not_an_option=1)


@pytest.mark.parametrize("info", ALL)
def test_defaults_are_torchs(info):
    p = make_params()
    ours, ref = info.ours(p), info.ref(clone_params(p))
    for k, v in ref.defaults.items():
        assert ours.defaults[k] == v, k
    assert ("betas" in ours.defaults) == ("betas" in ref.defaults)
    assert ("momentum" in ours.defaults) == ("momentum" in ref.defaults)


@pytest.mark.parametrize("info", ALL)
def test_refused_or_invalid_values_written_later_raise_before_anything_changes(info):
    p = make_params()
    opt = info.ours(p, **fresh(info.inputs[0]))
    set_grads(p, 1)
    opt.step()
    bad = ([("amsgrad", True, "amsgrad"), ("capturable", True, "capturable"),
            ("betas", (0.9, 1.5), "Invalid beta parameter at index 1"), ("eps", -1.0, "epsilon")]
           if "betas" in opt.defaults else
           [("dampening", 0.1, "dampening"), ("momentum", -1.0, "Invalid momentum value")])
    bad += [("lr", -1.0, "Invalid learning rate"), ("differentiable", True, "differentiable")]
    for key, value, regex in bad:
        group = opt.param_groups[0]
        before = [x.detach().clone() for x in p]
        state = {k: v.clone() for k, v in opt.state[p[0]].items()}
        old, group[key] = group[key], value
        with pytest.raises(ValueError, match=f"param group 0: .*{regex}"):
            opt.step()
        group[key] = old
        assert_same_params(p, before)
        for k, v in state.items():
            assert torch.equal(opt.state[p[0]][k], v), (key, k)
    opt.step()


def test_sgd_without_lr_uses_torchs_default():
    p, q = make_params(), make_params()
    ours, ref = fo.TorchOptimizer(p, fo.sgd, cpu_kernel="torch"), torch.optim.SGD(q)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-3
    for s in range(3):
        loss_step(ours, p, s)
        loss_step(ref, q, s)
    assert_same_params(p, q)


# ---- the math, against torch.optim -----------------------------------------------------------

@pytest.mark.parametrize("info,kw", EACH_INPUT)
def test_matches_torch_optim_with_two_groups(info, kw):
    p = make_params()
    q = clone_params(p)
    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02, "weight_decay": 0.0}]

    ours, ref = info.ours(groups(p), **fresh(kw)), info.ref(groups(q), **fresh(kw))
    for s in range(5):
        loss_step(ours, p, s)
        loss_step(ref, q, s)
        assert_same_params(p, q)
    assert_same_state(ours, ref, p, q, info.keys)
    assert set(ours.state[p[0]]) == {"step", *info.keys}


@pytest.mark.parametrize("info", ALL)
def test_every_group_value_is_read_at_each_step(info):
    p = make_params()
    q = clone_params(p)
    kw = fresh(info.inputs[0])
    ours, ref = info.ours(p, **kw), info.ref(q, **fresh(kw))
    changes = ([{"betas": (0.5, 0.9)}, {"eps": 1e-3}, {"weight_decay": 0.3}, {"lr": 0.05}]
               if "betas" in ours.defaults else
               [{"momentum": 0.5}, {"nesterov": True}, {"momentum": 0.0, "nesterov": False},
                {"momentum": 0.9}, {"weight_decay": 0.3}, {"lr": 0.05}])
    for s, change in enumerate(changes):
        loss_step(ours, p, s)
        loss_step(ref, q, s)
        ours.param_groups[0].update(change)
        ref.param_groups[0].update(change)
    loss_step(ours, p, 99)
    loss_step(ref, q, 99)
    assert_same_params(p, q)


SCHEDULERS = {
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=12,
                                                              cycle_momentum=True),
    "cyclic": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=0.02, step_size_up=3,
                                                          base_momentum=0.8, max_momentum=0.9,
                                                          cycle_momentum=True),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("info", ALL)
def test_schedulers_that_write_betas_or_momentum_match_torch(info, sched):
    p = make_params()
    q = clone_params(p)
    kw = {k: v for k, v in fresh(info.inputs[0]).items() if k != "lr"}
    ours, ref = info.ours(p, **kw), info.ref(q, **kw)
    so, sr = SCHEDULERS[sched](ours), SCHEDULERS[sched](ref)
    for s in range(10):
        loss_step(ours, p, s)
        loss_step(ref, q, s)
        so.step()
        sr.step()
    key = "betas" if "betas" in ours.defaults else "momentum"
    assert ours.param_groups[0][key] == ref.param_groups[0][key]
    assert_same_params(p, q)
    assert_same_state(ours, ref, p, q, info.keys or ("momentum_buffer",))


def test_unknown_and_scheduler_keys_in_groups_are_ignored():
    p = make_params()
    q = clone_params(p)
    extra = {"name": "encoder", "layer_id": 3, "initial_lr": 5.0, "max_lr": 9.0, "swa_lr": 1.0}
    ours = fo.TorchOptimizer([{"params": p, **extra}], fo.adamw, cpu_kernel="torch", lr=1e-2)
    ref = torch.optim.AdamW([{"params": q, **extra}], lr=1e-2)
    for s in range(3):
        loss_step(ours, p, s)
        loss_step(ref, q, s)
    assert_same_params(p, q)
    assert ours.state_dict()["param_groups"][0]["name"] == "encoder"  # kept, as torch keeps it


# ---- per-param state -------------------------------------------------------------------------

@pytest.mark.parametrize("info", [BY_NAME["adamw"], BY_NAME["sgd_momentum"]], ids=["adamw", "sgd_momentum"])
def test_per_param_state_is_the_functional_state(info):
    p = make_params()
    names = ["w", "b", "v"]
    opt = info.ours(list(zip(names, p)), **fresh(info.inputs[0]))
    assert len(opt.state) == 0  # created at the first step, as torch's
    loss_step(opt, p, 0)
    state = opt.fo_states[0]
    fields = fo.optimizers.spec.torch_state_names(state)
    for name, param in zip(names, p):
        view = opt.state[param]
        assert set(view) == {"step", *info.keys}
        for field, key in fields.items():
            assert view[key] is getattr(state, field)[name]  # the very leaf, not a copy
        assert view["step"] is opt.state[p[0]]["step"]  # one count per group
        assert float(view["step"]) == int(state.count) == 1


@pytest.mark.parametrize("info", [BY_NAME["adamw"], BY_NAME["sgd_momentum"]], ids=["adamw", "sgd_momentum"])
def test_writes_into_optimizer_state_change_the_math_as_in_torch(info):
    p = make_params()
    q = clone_params(p)
    kw = fresh(info.inputs[0])
    ours, ref = info.ours(p, **kw), info.ref(q, **fresh(kw))
    key = info.keys[0]
    edits = [
        lambda o, ps: o.state[ps[0]][key].mul_(0.5),  # in place
        lambda o, ps: o.state[ps[1]].__setitem__(key, torch.ones_like(ps[1])),  # replaced
        lambda o, ps: [o.state[x].__setitem__("step", torch.tensor(7.0)) for x in ps],
        lambda o, ps: o.state[ps[2]][key].zero_(),
    ]
    for s, edit in enumerate(edits):
        loss_step(ours, p, s)
        loss_step(ref, q, s)
        edit(ours, p)
        edit(ref, q)
    loss_step(ours, p, 9)
    loss_step(ref, q, 9)
    assert_same_params(p, q)
    assert_same_state(ours, ref, p, q, info.keys)
    assert ours.state[p[1]][key] is ours.fo_states[0][1][1]  # taken into the state again


def test_a_deleted_entry_restarts_that_params_state():
    p = make_params()
    opt = BY_NAME["adamw"].ours(p)
    loss_step(opt, p, 0)
    del opt.state[p[1]]
    with pytest.warns(UserWarning, match="restarts from zero"):
        loss_step(opt, p, 1)
    assert float(opt.state[p[0]]["step"]) == 2
    opt.state.clear()  # a whole reset, as torch: everything starts again
    loss_step(opt, p, 2)
    assert float(opt.state[p[0]]["step"]) == 1


def test_low_precision_params_show_their_master():
    p = make_params(dtype=torch.bfloat16)
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2)
    loss_step(opt, p, 0)
    view = opt.state[p[0]]
    assert set(view) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert view["master"].dtype == torch.float32
    assert torch.equal(view["master"].to(torch.bfloat16), p[0].detach())
    # it loads into torch.optim.AdamW, which keeps the master as unused state and steps
    q = clone_params(p)
    ref = torch.optim.AdamW(q, lr=1e-2)
    ref.load_state_dict(opt.state_dict())
    loss_step(ref, q, 1)
    # and torch's bf16 state loads into ours: the masters come from the params
    ours = fo.TorchOptimizer(clone_params(q), fo.adamw, lr=1e-2)
    ours.load_state_dict(ref.state_dict())
    assert torch.equal(ours.state[ours.param_groups[0]["params"][0]]["master"],
                       q[0].detach().float())



@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_sync_masters_keeps_a_change_to_the_params(delayed):
    """Params changed outside the optimizer (a weight load mid-run) become the masters, also
    with a delayed step in flight, whose landing would otherwise write over the change."""
    p = make_params(dtype=torch.bfloat16)
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, delayed=delayed)
    loss_step(opt, p, 0)
    with torch.no_grad():
        p[0].fill_(0.5)
    opt.sync_masters()
    assert (p[0] == 0.5).all() and (opt.state[p[0]]["master"] == 0.5).all()

# ---- state_dict ------------------------------------------------------------------------------

@pytest.mark.parametrize("named1", [False, True], ids=["to-unnamed", "to-named"])
@pytest.mark.parametrize("named0", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("info", ALL)
def test_state_dict_round_trip_named_and_unnamed(info, named0, named1):
    p = make_params()
    kw = fresh(info.inputs[-1])
    named = lambda ps, yes: [(f"p{i}", x) for i, x in enumerate(ps)] if yes else ps  # noqa: E731
    a = info.ours(named(p, named0), **kw)
    for s in range(4):
        loss_step(a, p, s)
    q = clone_params(p)
    b = info.ours(named(q, named1), **fresh(info.inputs[0]))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    sd = a.state_dict()
    assert all(isinstance(i, int) for g in sd["param_groups"] for i in g["params"])
    for s in range(4, 8):
        loss_step(a, p, s)
        loss_step(b, q, s)
        assert_same_params(p, q)
    state_dicts_equal(a.state_dict(), b.state_dict(), names=False)
    if named0 or named1:
        assert b.state_dict()["param_groups"][0]["param_names"] == ["p0", "p1", "p2"]


@pytest.mark.parametrize("info,kw", EACH_INPUT)
def test_torch_state_dict_loads_and_continues_bit_exact(info, kw):
    p = make_params()
    q = clone_params(p)
    ref = info.ref(q, **fresh(kw))
    for s in range(3):
        loss_step(ref, q, s)
    ours = info.ours(clone_params(q))  # default options: the state_dict brings torch's values
    p = ours.param_groups[0]["params"]
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    for k in ("lr", "betas", "eps", "momentum", "nesterov", "weight_decay", "maximize"):
        if k in ref.param_groups[0]:
            assert ours.param_groups[0][k] == ref.param_groups[0][k], k
    for s in range(3, 6):
        loss_step(ours, p, s)
        loss_step(ref, q, s)
        assert_same_params(p, q)
    assert_same_state(ours, ref, p, q, info.keys)


@pytest.mark.parametrize("info,kw", EACH_INPUT)
def test_our_state_dict_loads_into_torch_and_continues_bit_exact(info, kw):
    p = make_params()
    ours = info.ours(p, **fresh(kw))
    for s in range(3):
        loss_step(ours, p, s)
    q = clone_params(p)
    ref = info.ref(q)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    for s in range(3, 6):
        loss_step(ours, p, s)
        loss_step(ref, q, s)  # torch adds to each param's step in place: they must not be shared
        assert_same_params(p, q)
    assert_same_state(ours, ref, p, q, info.keys)


@pytest.mark.parametrize("info", ALL)
def test_state_dict_saves_and_loads_with_weights_only(info):
    p = make_params()
    opt = info.ours(list(zip("abc", p)), **fresh(info.inputs[-1]))
    for s in range(3):
        loss_step(opt, p, s)
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    state_dicts_equal(loaded, sd)
    q = clone_params(p)
    other = info.ours(list(zip("abc", q)))
    other.load_state_dict(loaded)
    loss_step(opt, p, 3)
    loss_step(other, q, 3)
    assert_same_params(p, q)


def test_non_tensor_step_and_older_state_dicts_load():
    p = make_params()
    opt = BY_NAME["adamw"].ours(p, maximize=True)
    for s in range(3):
        loss_step(opt, p, s)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = st["step"].item()
    for g in sd["param_groups"]:  # options added to torch after the first release
        for flag in ("foreach", "differentiable", "maximize", "capturable", "fused"):
            g.pop(flag)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["maximize"] is True  # a key the state_dict lacks keeps its value
    loss_step(opt, p, 3)
    assert float(opt.state[p[0]]["step"]) == 4


def test_a_failed_load_changes_nothing():
    p = make_params()
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5}]  # noqa: E731
    opt = BY_NAME["adamw"].ours(groups(p), lr=1e-2)
    loss_step(opt, p, 0)
    other_params = make_params(seed=1)
    other_params[2] = Parameter(torch.randn(4, 10))  # group 1's param has another shape
    other = BY_NAME["adamw"].ours(groups(other_params), lr=0.3)
    for s in range(2):
        set_grads(other_params, s)
        other.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"param group 1: param 0: state 'exp_avg' has shape \(4, 10\)"):
        opt.load_state_dict(other.state_dict())
    state_dicts_equal(opt.state_dict(), before)  # group 0 was not overwritten (nor its lr)
    broken = copy.deepcopy(before)
    del broken["state"][broken["param_groups"][1]["params"][0]]["exp_avg_sq"]  # torch would fail
    with pytest.raises(ValueError, match=r"param group 1: param 0: state 'exp_avg_sq' is missing"):
        opt.load_state_dict(broken)
    state_dicts_equal(opt.state_dict(), before)


# ---- hooks -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source, dtype, kw", [
    ("ours", torch.float32, dict(delayed=True)),  # fp32 params with (hidden) masters
    ("ours", torch.float32, dict(delayed=STALE)),
    ("torch", torch.bfloat16, {}),  # a torch.optim checkpoint holds no master
])
def test_load_state_dict_before_the_models_own_load_steps_from_the_model_loaded(source, dtype, kw):
    """A checkpoint without the masters the state keeps, loaded before the model's weights are
    (``opt.load_state_dict(sd); model.load_state_dict(msd)``, as torch.optim allows): the
    masters are taken from the params at the next step, not at the load, so both orders step
    the same (they used to step from the weights the model had before its load)."""
    p = make_params(dtype=dtype)
    a = (torch.optim.AdamW(p, lr=1e-2) if source == "torch"
         else fo.TorchOptimizer(p, fo.adamw, lr=1e-2, **kw))
    for s in range(3):
        loss_step(a, p, s)
    if source == "ours":
        a.flush()
    sd, weights = copy.deepcopy(a.state_dict()), [x.detach().clone() for x in p]
    out = []
    for order in ("model first", "optimizer first"):
        q = make_params(seed=7, dtype=dtype)  # a new model, other weights
        b = fo.TorchOptimizer(q, fo.adamw, lr=1e-2, **kw)
        if order == "optimizer first":
            b.load_state_dict(copy.deepcopy(sd))
        with torch.no_grad():
            for x, w in zip(q, weights):
                x.copy_(w)
        if order == "model first":
            b.load_state_dict(copy.deepcopy(sd))
        for s in range(3, 5):
            loss_step(b, q, s)
        b.flush()
        out.append(q)
    assert_same_params(*out)


def test_loading_a_state_dict_where_some_params_have_no_state_warns():
    """A torch.optim state_dict whose group has a param without state (no grad while it was
    trained: torch starts it at step 1) and others at step 3: the group's one count goes on
    from 3, with a warning naming the spread, as for params whose steps differ."""
    p = make_params()
    ref = torch.optim.AdamW(p, lr=1e-2)
    for s in range(3):
        set_grads(p, s)
        p[1].grad = None
        ref.step()
    assert 1 not in ref.state_dict()["state"]
    ours = fo.TorchOptimizer(clone_params(p), fo.adamw, lr=1e-2)
    with pytest.warns(UserWarning, match=r"steps differ \(0 to 3\)"):
        ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    q = clone_params(p)
    every = torch.optim.AdamW(q, lr=1e-2)
    for s in range(3):
        set_grads(q, s)
        every.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every param at step 3: no warning
        fo.TorchOptimizer(clone_params(q), fo.adamw, lr=1e-2).load_state_dict(
            copy.deepcopy(every.state_dict()))


def test_state_dict_and_load_state_dict_hooks_run_in_order():
    p = torch.rand(2, 3, requires_grad=True)
    opt = fo.TorchOptimizer([p], fo.adamw)
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))

    def post(o, sd):
        sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
        return sd

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd["ran_pre_hook"] is True and "test" not in sd["state"]
    opt.state.pop("test")

    opt.register_load_state_dict_pre_hook(lambda o, sd: sd["param_groups"][0].__setitem__("lr", 0.002))
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[0]["lr"] == 0.002

    def replace(o, sd):
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.003
        return sd

    opt.register_load_state_dict_pre_hook(replace, prepend=True)  # runs first: the other wins
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_post_hook(lambda o: o.state.__setitem__("loaded", True))
    opt.load_state_dict(opt.state_dict())
    assert opt.state["loaded"] is True


def test_step_hooks_run():
    p = torch.tensor([1.0, 1.0], requires_grad=True)
    opt = fo.TorchOptimizer([p], fo.sgd, lr=0.1)
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    g1 = register_optimizer_step_pre_hook(lambda o, a, k: seen.append("gpre"))
    g2 = register_optimizer_step_post_hook(lambda o, a, k: seen.append("gpost"))
    try:
        opt.step()
    finally:
        for h in (h1, h2, g1, g2):
            h.remove()
    opt.step()
    assert seen == ["gpre", "pre", "post", "gpost"]


# ---- copies ----------------------------------------------------------------------------------

@pytest.mark.parametrize("info", ALL)
def test_deepcopy_and_pickle_give_optimizers_that_step(info):
    p = make_params()
    opt = info.ours(list(zip("abc", p)), **fresh(info.inputs[-1]))
    for s in range(3):
        loss_step(opt, p, s)
    twin = copy.deepcopy(opt)
    public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}  # noqa: E731
    assert public(twin) == public(opt)
    restored = pickle.loads(pickle.dumps(opt))
    for other in (twin, restored):
        q = other.param_groups[0]["params"]
        assert all(x is not y for x, y in zip(p, q))
        state_dicts_equal(other.state_dict(), opt.state_dict())
    for s in range(3, 5):
        for o in (opt, twin, restored):
            ps = o.param_groups[0]["params"]
            set_grads(ps, s)
            o.step()
    for other in (twin, restored):
        assert_same_params(p, other.param_groups[0]["params"])


def test_deepcopy_of_model_and_optimizer_together_trains_the_copy():
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-2, cpu_kernel="torch")
    x = torch.randn(8, 5)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    model2, opt2 = copy.deepcopy((model, opt))
    for m, o in ((model, opt), (model2, opt2)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert_same_params(list(model.parameters()), list(model2.parameters()))


# ---- failures and interrupts ---------------------------------------------------------------

def test_a_failed_step_is_recovered_by_load_state_dict():
    from functional_offload.executor import HostExecutor
    from functional_offload.testing import fail_host_kernel

    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    p = [Parameter(torch.randn(64, 48)), Parameter(torch.randn(64))]
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, executor=ex)
    set_grads(p, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    good = [x.detach().clone() for x in p]
    set_grads(p, 1)
    with fail_host_kernel(after=1):
        with pytest.raises(fo.HostStepError):
            opt.step()
    with pytest.raises(fo.StateError, match="load_state_dict"):
        opt.step()
    with pytest.raises(fo.StateError, match="failed part-way"):
        opt.state_dict()
    with torch.no_grad():
        for x, y in zip(p, good):
            x.copy_(y)
    opt.load_state_dict(saved)
    opt.step()
    assert float(opt.state[p[0]]["step"]) == 2


def test_ctrl_c_during_step_completes_every_group_then_raises():
    import _thread
    import threading

    from functional_offload.executor import HostExecutor
    from functional_offload.testing import slow_host_kernel

    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    mk = lambda ps: fo.TorchOptimizer([{"params": ps[:1]}, {"params": ps[1:]}], fo.adamw,  # noqa: E731
                                      lr=1e-2, executor=ex, cpu_kernel="torch")
    p = [Parameter(torch.randn(64, 48)), Parameter(torch.randn(64, 48))]
    q = clone_params(p)
    opt, ref = mk(p), mk(q)
    for s in range(2):
        set_grads(p, s)
        set_grads(q, s)
        ref.step()
        if s == 0:
            opt.step()
            continue
        with slow_host_kernel(0.05):  # three chunks a leaf: each group's step lasts 0.15 s
            timer = threading.Timer(0.08, _thread.interrupt_main)
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
            finally:
                timer.cancel()
    assert_same_params(p, q)  # both groups finished the interrupted step
    assert [float(opt.state[x]["step"]) for x in p] == [2.0, 2.0]
    set_grads(p, 2)
    set_grads(q, 2)
    opt.step()
    ref.step()
    assert_same_params(p, q)
    state_dicts_equal(opt.state_dict(), ref.state_dict())


# ---- the group changes under the state ----------------------------------------------------

def test_params_cast_after_steps_get_their_state_laid_out_again():
    model = torch.nn.Linear(5, 3)
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-2)
    x = torch.randn(4, 5)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mu = opt.state[model.weight]["exp_avg"].clone()
    model.to(torch.bfloat16)  # the same Parameters, now bf16
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], mu)
    model(x.bfloat16()).float().square().mean().backward()
    opt.step()
    view = opt.state[model.weight]
    assert set(view) == {"step", "exp_avg", "exp_avg_sq", "master"} and float(view["step"]) == 3
    assert view["exp_avg"].dtype == view["master"].dtype == torch.float32


def test_delayed_steps_land_before_state_dict():
    p, q = make_params(), make_params()
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, delayed=STALE, cpu_kernel="torch")
    ref = fo.TorchOptimizer(q, fo.adamw, lr=1e-2, cpu_kernel="torch")
    for s in range(3):  # grads that do not depend on the params: the delay changes nothing
        set_grads(p, s)
        set_grads(q, s)
        opt.step()
        ref.step()
    state_dicts_equal(opt.state_dict(), ref.state_dict())
    assert_same_params(p, q)


@pytest.mark.parametrize("max_grad_norm, exact", [(1e-3, True), (1e3, False)])
def test_max_grad_norm_tells_delayed_steps_when_it_clips(max_grad_norm, exact):
    """``delayed=fo.Delay(exact_when_clipped=True)`` with ``max_grad_norm``: a step the clip
    scales lands before ``step`` returns (the params are the run without delay's), one it does
    not scale is delayed (the params have not moved yet after the first step)."""
    p, q = make_params(), make_params()
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, max_grad_norm=max_grad_norm,
                            delayed=fo.Delay(exact_when_clipped=True), cpu_kernel="torch")
    ref = fo.TorchOptimizer(q, fo.adamw, lr=1e-2, max_grad_norm=max_grad_norm, cpu_kernel="torch")
    before = [x.detach().clone() for x in p]
    set_grads(p, 0)
    set_grads(q, 0)
    opt.step()
    ref.step()
    if exact:
        assert_same_params(p, q)
    else:
        assert all(torch.equal(x, b) for x, b in zip(p, before))


def test_errors_name_the_param():
    model = torch.nn.Linear(5, 3)
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw)
    model.weight.grad = torch.zeros(3, 5).to_sparse()
    with pytest.raises(TypeError, match="grad 'weight' has layout torch.sparse_coo"):
        opt.step()
    other = fo.TorchOptimizer(torch.nn.Linear(5, 4).named_parameters(), fo.adamw)
    other.param_groups[0]["params"][0].grad = torch.ones(4, 5)
    other.step()
    with pytest.raises(ValueError, match=r"param 0 \('weight'\): state 'exp_avg' has shape \(4, 5\)"):
        opt.load_state_dict(other.state_dict())


def test_state_dicts_of_the_first_adapter_still_load():
    """The first TorchOptimizer saved names in "params" and the functional state's dotted paths."""
    g = torch.Generator().manual_seed(0)
    mu = [torch.randn(2, 3, generator=g), torch.randn(2, generator=g)]
    nu = [torch.rand(2, 3, generator=g), torch.rand(2, generator=g)]
    old = {"param_groups": [{"lr": 0.01, "weight_decay": 0.01, "params": ["weight", "bias"]}],
           "state": {"0.count": torch.tensor(4), "0.mu.weight": mu[0], "0.mu.bias": mu[1],
                     "0.nu.weight": nu[0], "0.nu.bias": nu[1]}}
    model = torch.nn.Linear(3, 2)
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw)
    opt.load_state_dict(old)
    assert opt.param_groups[0]["lr"] == 0.01
    for p, m, v in zip(model.parameters(), mu, nu):
        assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert float(opt.state[p]["step"]) == 4
    unnamed = fo.TorchOptimizer(list(model.parameters()), fo.sgd, momentum=0.9)
    unnamed.load_state_dict({"param_groups": [{"lr": 0.1, "momentum": 0.9, "params": ["0", "1"]}],
                             "state": {"0.count": torch.tensor(1), "0.momentum.0": mu[0],
                                       "0.momentum.1": mu[1]}})
    assert "param_names" not in unnamed.param_groups[0]
    assert torch.equal(unnamed.state[model.bias]["momentum_buffer"], mu[1])


# ---- state_dicts of other algorithms -------------------------------------------------------

def trained(make, params, steps=2):
    """An optimizer made by ``make(params)`` (torch's or ours) after ``steps`` steps."""
    opt = make(params)
    for s in range(steps):
        loss_step(opt, params, s)
    return opt


TORCH_SGD_MOMENTUM = lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)  # noqa: E731
CROSS_LOADS = [  # (saved by, loaded into ours, torch's class of that algorithm or None)
    ("torch-sgd-momentum", TORCH_SGD_MOMENTUM, "adamw", (fo.adamw, {}), torch.optim.AdamW),
    ("torch-sgd-momentum", TORCH_SGD_MOMENTUM, "adam", (fo.adam, {}), torch.optim.Adam),
    ("torch-adamw", lambda ps: torch.optim.AdamW(ps), "sgd-momentum", (fo.sgd, {"momentum": 0.9}),
     lambda ps: torch.optim.SGD(ps, momentum=0.9)),
    ("torch-adam", lambda ps: torch.optim.Adam(ps), "sgd", (fo.sgd, {}), torch.optim.SGD),
    ("torch-adam", lambda ps: torch.optim.Adam(ps), "lion", (fo.lion, {}), None),
    ("lion", lambda ps: fo.TorchOptimizer(ps, fo.lion), "adamw", (fo.adamw, {}), torch.optim.AdamW),
    ("torch-adamw", lambda ps: torch.optim.AdamW(ps), "adafactor", (fo.adafactor, {}),
     torch.optim.Adafactor),
    ("torch-adafactor", lambda ps: torch.optim.Adafactor(ps), "adamw", (fo.adamw, {}),
     torch.optim.AdamW),
    ("torch-sgd-momentum", TORCH_SGD_MOMENTUM, "adafactor", (fo.adafactor, {}),
     torch.optim.Adafactor),
    ("adafactor", lambda ps: fo.TorchOptimizer(ps, fo.adafactor), "sgd-momentum",
     (fo.sgd, {"momentum": 0.9}), lambda ps: torch.optim.SGD(ps, momentum=0.9)),
    ("sgd-momentum", lambda ps: fo.TorchOptimizer(ps, fo.sgd, momentum=0.9), "lion", (fo.lion, {}),
     None),
    ("adamw", lambda ps: fo.TorchOptimizer(ps, fo.adamw), "sgd-momentum",
     (fo.sgd, {"momentum": 0.9}),
     lambda ps: torch.optim.SGD(ps, momentum=0.9)),
]


def torch_refusal(cls, params, sd):
    """What torch's class raises loading ``sd`` (at the load or at the next step), or None."""
    opt = cls(params)
    try:
        opt.load_state_dict(copy.deepcopy(sd))
        loss_step(opt, params, 9)
    except Exception as e:  # noqa: BLE001 - whatever torch raises is the oracle's refusal
        return e
    return None


@pytest.mark.parametrize("source,saved_by,target,ours,torch_cls",
                         [pytest.param(*c, id=f"{c[0]}-into-{c[2]}") for c in CROSS_LOADS])
def test_a_state_dict_of_another_algorithm_is_refused_before_anything_changes(
        source, saved_by, target, ours, torch_cls):
    sd = trained(saved_by, make_params()).state_dict()
    make, kw = ours
    p = make_params()
    opt = fo.TorchOptimizer(p, make, cpu_kernel="torch", **kw)
    fresh_opt = fo.TorchOptimizer(clone_params(p), make, cpu_kernel="torch", **kw)
    loss_step(opt, p, 0)
    before = copy.deepcopy(opt.state_dict())
    for o in (opt, fresh_opt):
        with pytest.raises(ValueError, match=r"param group 0: param 0: state .*"
                                             r"(missing|another algorithm's)") as err:
            o.load_state_dict(copy.deepcopy(sd))
        msg = str(err.value)
        # the message names the keys: the first param's keys the algorithm does not keep ...
        foreign = [k for k in sd["state"][0] if k != "step" and k not in opt.state[p[0]]]
        assert all(repr(k) in msg for k in foreign)
    state_dicts_equal(opt.state_dict(), before)  # nothing was copied (nor a group value)
    assert len(fresh_opt.state) == 0 and fresh_opt.param_groups[0]["lr"] == opt.defaults["lr"]
    if torch_cls is not None:  # ... and the state key torch's class fails on, if it does
        refusal = torch_refusal(torch_cls, clone_params(p), sd)
        keys = trained(torch_cls, clone_params(p), steps=1).state_dict()["state"].get(0, {})
        if isinstance(refusal, KeyError) and refusal.args[0] in keys:
            assert f"{refusal.args[0]!r} " in msg and "missing" in msg
    loss_step(opt, p, 1)  # and the optimizer goes on


def test_state_keys_of_the_same_algorithm_still_load():
    """Keys other algorithms do not use (a user's own) stay in the view; torch's Adam state
    loads into AdamW (one algorithm in torch); a param without state starts afresh."""
    p = make_params()
    ref = trained(lambda ps: torch.optim.Adam(ps, lr=1e-2), clone_params(p))
    sd = copy.deepcopy(ref.state_dict())
    sd["state"][1]["my_note"] = torch.tensor(3.0)
    del sd["state"][2]
    opt = BY_NAME["adamw"].ours(p)
    with pytest.warns(UserWarning, match="steps differ"):  # param 2 has no state
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[p[1]]["my_note"], torch.tensor(3.0))
    assert opt.state[p[2]]["exp_avg"].count_nonzero() == 0
    sgd = BY_NAME["sgd_momentum"].ours(clone_params(p), momentum=0.9)
    torch_sgd = trained(lambda ps: torch.optim.SGD(ps, lr=0.1), clone_params(p))
    sgd.load_state_dict(torch_sgd.state_dict())  # no state: no step, nor a buffer


# ---- Adafactor -------------------------------------------------------------------------------

def adafactor_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(10, 5), (10,), (3, 10), (2, 3, 4)]
    return [Parameter(torch.randn(s, generator=g)) for s in shapes]


def adafactor_step(opt, params, seed):
    set_grads(params, seed)
    opt.step()


def test_adafactor_state_dicts_round_trip_with_torch():
    """1-D, 2-D and 3-D params: ours -> ours, torch.optim.Adafactor -> ours -> torch; each
    continues bit for bit, and shows torch's keys (no entry for a moment the param lacks)."""
    p = adafactor_params()
    q = clone_params(p)
    ref = torch.optim.Adafactor(q, lr=0.05, weight_decay=0.1)
    for s in range(3):
        adafactor_step(ref, q, s)
    ours = fo.TorchOptimizer(p, fo.adafactor)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch -> ours
    with torch.no_grad():
        for x, y in zip(p, q):
            x.copy_(y)
    for x, y in zip(p, q):
        assert set(ours.state[x]) == set(ref.state[y])
    for s in range(3, 5):
        adafactor_step(ours, p, s)
        adafactor_step(ref, q, s)
        assert_same_params(p, q)
    state_dicts_equal(ours.state_dict(), ref.state_dict())
    again = fo.TorchOptimizer(clone_params(p), fo.adafactor)  # ours -> ours
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    back = torch.optim.Adafactor(clone_params(p))  # ours -> torch
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    others = [again.param_groups[0]["params"], back.param_groups[0]["params"]]
    for s in range(5, 7):
        adafactor_step(ours, p, s)
        adafactor_step(ref, q, s)
        for o, ps in zip((again, back), others):
            adafactor_step(o, ps, s)
            assert_same_params(p, ps)
    for o in (again, back):
        state_dicts_equal(o.state_dict(), ref.state_dict())
    state_dicts_equal(ours.state_dict(), ref.state_dict())


def test_adafactor_refuses_a_state_without_its_moments():
    p = adafactor_params()
    ref = torch.optim.Adafactor(clone_params(p))
    adafactor_step(ref, ref.param_groups[0]["params"], 0)
    sd = copy.deepcopy(ref.state_dict())
    del sd["state"][0]["col_var"]
    sd["state"][1]["row_var"] = sd["state"][0]["row_var"]  # a matrix's moment on a vector
    opt = fo.TorchOptimizer(p, fo.adafactor)
    with pytest.raises(ValueError, match=r"param 0: state 'col_var' is missing"):
        opt.load_state_dict(sd)
    del sd["state"][0]
    with pytest.warns(UserWarning, match=r"steps differ \(0 to 1\)"):  # param 0: no state
        opt.load_state_dict(sd)  # a key the param's layout does not use is kept, as torch keeps it
    assert set(opt.state[p[1]]) == {"step", "variance", "row_var"}


# ---- recovery of a failed step, and a state in a step ----------------------------------------

def small_chunks():
    from functional_offload.executor import HostExecutor

    return HostExecutor(chunk_bytes=4096, slots=2, threads=2)


def bf16_params(seed=0):
    """Low-precision params: the state keeps their fp32 masters (a failed step is recoverable
    from a checkpoint of the state alone)."""
    g = torch.Generator().manual_seed(seed)
    return [Parameter(torch.randn(64, 48, generator=g).bfloat16()),
            Parameter(torch.randn(64, generator=g).bfloat16())]


def bf16_step(opt, params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    opt.step()


def save_states(opt, path, how):
    import torch.distributed.checkpoint as dcp

    import functional_offload.dcp  # noqa: F401 - fo.dcp

    if how == "fo.load":
        fo.save(tuple(opt.fo_states), path)
    elif how == "dcp":
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({"optim": fo.dcp.state_dict(tuple(opt.fo_states))}, checkpoint_id=path)
    else:
        return copy.deepcopy(opt.state_dict())


def load_states(opt, path, how, saved):
    import torch.distributed.checkpoint as dcp

    if how == "fo.load":
        fo.load(path, like=tuple(opt.fo_states))
    elif how == "dcp":
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"optim": fo.dcp.state_dict(tuple(opt.fo_states), loading=True)},
                     checkpoint_id=path)
    else:
        opt.load_state_dict(saved)


@pytest.mark.parametrize("how", ["fo.load", "dcp", "load_state_dict"])
def test_a_failed_step_recovers_from_a_checkpoint_and_the_next_step_is_a_clean_runs(tmp_path, how):
    """The documented recovery: a failed step leaves the states reachable (``fo_states``) but
    refused for saving and stepping; a checkpoint loaded into them (``fo.load``, DCP, or
    ``load_state_dict``) and the model's params restored, the next step is the clean run's."""
    from functional_offload.testing import fail_host_kernel

    p, q = bf16_params(), bf16_params()
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, executor=small_chunks(), cpu_kernel="torch")
    ref = fo.TorchOptimizer(q, fo.adamw, lr=1e-2, executor=small_chunks(), cpu_kernel="torch")
    for s in range(2):
        bf16_step(opt, p, s)
        bf16_step(ref, q, s)
    saved = save_states(opt, str(tmp_path / "ckpt"), how)
    model = [x.detach().clone() for x in p]
    with fail_host_kernel(after=1):
        with pytest.raises(fo.HostStepError):
            bf16_step(opt, p, 2)
    states = opt.fo_states  # reachable for a load ...
    assert len(states) == 1 and states[0] is not None
    with pytest.raises(fo.StateError):  # ... but not saved, nor stepped
        fo.save(tuple(states), tmp_path / "torn")
    with pytest.raises(fo.StateError, match="failed part-way"):
        opt.state_dict()
    with pytest.raises(fo.StateError, match="load_state_dict"):
        bf16_step(opt, p, 2)
    with torch.no_grad():  # the model's checkpoint
        for x, y in zip(p, model):
            x.copy_(y)
    load_states(opt, str(tmp_path / "ckpt"), how, saved)
    assert float(opt.state_dict()["state"][0]["step"]) == 2
    for s in range(2, 4):
        bf16_step(opt, p, s)
        bf16_step(ref, q, s)
        assert_same_params(p, q)
    state_dicts_equal(opt.state_dict(), ref.state_dict())


def test_a_checkpoint_loaded_into_fo_states_is_what_optimizer_state_shows(tmp_path):
    p = make_params()
    opt = BY_NAME["adamw"].ours(p, lr=1e-2)
    loss_step(opt, p, 0)
    fo.save(tuple(opt.fo_states), tmp_path / "ckpt")
    saved = copy.deepcopy(opt.state_dict())
    for s in range(1, 3):
        loss_step(opt, p, s)
    fo.load(tmp_path / "ckpt", like=tuple(opt.fo_states))
    state_dicts_equal(opt.state_dict(), saved)
    q = clone_params(p)
    ref = BY_NAME["adamw"].ours(q, lr=1e-2)
    ref.load_state_dict(saved)
    loss_step(opt, p, 3)
    loss_step(ref, q, 3)
    assert_same_params(p, q)
    state_dicts_equal(opt.state_dict(), ref.state_dict())


def test_a_failed_optimizer_is_not_copied_pickled_or_synced():
    """A copy or a pickle would save the half-applied step as a usable state."""
    from functional_offload.testing import fail_host_kernel

    p = bf16_params()
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, executor=small_chunks())
    bf16_step(opt, p, 0)
    with fail_host_kernel(after=1):
        with pytest.raises(fo.HostStepError):
            bf16_step(opt, p, 1)
    for call in (lambda: copy.deepcopy(opt), lambda: pickle.dumps(opt), opt.sync_masters):
        with pytest.raises(fo.StateError, match="failed part-way.*load_state_dict"):
            call()


def test_an_optimizer_in_a_step_refuses_reads_copies_loads_and_syncs():
    """While another thread's step runs, the calls that read or write the state raise
    StateError and change nothing: the step then completes as a clean run's."""
    import threading

    from functional_offload.testing import slow_host_kernel

    p, q = bf16_params(), bf16_params()
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, executor=small_chunks(), cpu_kernel="torch")
    ref = fo.TorchOptimizer(q, fo.adamw, lr=1e-2, executor=small_chunks(), cpu_kernel="torch")
    bf16_step(opt, p, 0)
    bf16_step(ref, q, 0)
    saved = copy.deepcopy(opt.state_dict())
    other = copy.deepcopy(saved)
    other["param_groups"][0]["lr"] = 0.5
    calls = {"state_dict": opt.state_dict, "fo_states": lambda: opt.fo_states,
             "load_state_dict": lambda: opt.load_state_dict(copy.deepcopy(other)),
             "deepcopy": lambda: copy.deepcopy(opt), "pickle": lambda: pickle.dumps(opt),
             "sync_masters": opt.sync_masters}
    refused, errors = {}, []
    with slow_host_kernel(0.2):  # three chunks: the step lasts 0.6 s
        worker = threading.Thread(target=lambda: bf16_step(opt, p, 1))
        worker.start()
        try:
            while worker.is_alive():  # until the step holds the state
                try:
                    opt.state_dict()
                except fo.StateError:
                    break
            for name, call in calls.items():
                try:
                    call()
                    errors.append(name)
                except fo.StateError as e:
                    refused[name] = str(e)
        finally:
            worker.join()
    assert not errors, errors
    assert all("in use by another step" in m for m in refused.values()), refused
    bf16_step(ref, q, 1)
    assert_same_params(p, q)
    state_dicts_equal(opt.state_dict(), ref.state_dict())


@pytest.mark.parametrize("fails", [True, False], ids=["failed", "completed"])
def test_a_load_drops_a_delayed_step_in_flight_instead_of_landing_it(fails):
    """``delayed=STALE``: the step in flight is dropped by a load, whether it failed in the
    background (the load recovers at once) or not (the params restored from the model's
    checkpoint stay as restored); training then goes on as from the checkpoint."""
    from functional_offload.testing import fail_host_kernel

    p, q = bf16_params(), bf16_params()
    opt = fo.TorchOptimizer(p, fo.adamw, lr=1e-2, delayed=STALE, executor=small_chunks())
    ref = fo.TorchOptimizer(q, fo.adamw, lr=1e-2, executor=small_chunks())
    bf16_step(opt, p, 0)
    bf16_step(ref, q, 0)
    saved = copy.deepcopy(opt.state_dict())  # lands the step
    model = [x.detach().clone() for x in p]
    with fail_host_kernel(after=1) if fails else contextlib.nullcontext():
        bf16_step(opt, p, 1)  # in flight (failing in the background)
        with torch.no_grad():
            for x, y in zip(p, model):
                x.copy_(y)
        opt.load_state_dict(copy.deepcopy(saved))
    assert_same_params(p, model)
    for s in range(1, 3):
        bf16_step(opt, p, s)
        bf16_step(ref, q, s)
    opt.flush()
    assert_same_params(p, q)
    state_dicts_equal(opt.state_dict(), ref.state_dict())
