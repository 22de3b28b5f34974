"""Bad input raises an error naming the leaf and the fix, and leaves the state usable."""

import pytest
import torch

import functional_offload as fo
from conftest import grad_seq, make_params


@pytest.fixture(params=["adamw", "chain"])
def setup(request):
    params = make_params()
    opt = fo.adamw(1e-2)
    if request.param == "chain":
        opt = fo.chain(fo.scale(1.0), opt)
    return params, opt, opt.init(params), grad_seq(params, 1)[0]


def bad_grads(good):
    g = dict(good)
    no_scale = {k: v for k, v in g.items() if k != "scale"}
    yield "structure", ValueError, "does not match the params tree", no_scale
    yield "shape", ValueError, "'scale' has shape", dict(g, scale=torch.zeros(3, 5))
    yield ("dtype", TypeError, r"'scale' has dtype torch.float64.*\.to\(torch.float32\)",
           dict(g, scale=g["scale"].double()))
    yield "device", ValueError, "'scale' is on meta", dict(g, scale=torch.zeros(3, 5, 7, device="meta"))
    yield "type", TypeError, "'scale' is a list", dict(g, scale=[1.0])


def test_bad_grads_raise_and_state_stays_usable(setup):
    params, opt, state, good = setup
    snapshot = {k: v.clone() for k, v in fo.state_dict(state).items()}
    p_before = params["scale"].clone()
    for name, exc, msg, grads in bad_grads(good):
        with pytest.raises(exc, match=msg):
            opt.update(grads, state)
    for k, v in fo.state_dict(state).items():
        assert torch.equal(v, snapshot[k]), k
    assert torch.equal(params["scale"], p_before)
    params, state = opt.update(good, state)
    assert int(fo.state_dict(state)[next(k for k in fo.state_dict(state) if k.endswith("count"))]) == 1


@pytest.mark.parametrize("kwargs,msg", [
    (dict(lr=-1.0), "lr must be"),
    (dict(lr=1e-3, betas=(1.0, 0.9)), r"betas\[0\] must be in \[0, 1\)"),
    (dict(lr=1e-3, betas=(0.9, -0.1)), r"betas\[1\]"),
    (dict(lr=1e-3, betas=0.9), "pair"),
    (dict(lr=1e-3, eps=-1.0), "eps"),
    (dict(lr=1e-3, weight_decay=float("nan")), "weight_decay"),
])
def test_bad_hyperparameters(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        fo.adamw(**kwargs)


def test_bad_sgd_and_clip_and_dtypes():
    with pytest.raises(ValueError, match="nesterov"):
        fo.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        fo.sgd(0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="max_norm"):
        fo.clip_by_global_norm(0.0)
    with pytest.raises(TypeError, match="mu_dtype"):
        fo.adamw(1e-3, mu_dtype=torch.int32)
    with pytest.raises(TypeError, match="master_dtype"):
        fo.adamw(1e-3, master_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="'n' has dtype torch.int64"):
        fo.adamw(1e-3).init({"n": torch.zeros(2, dtype=torch.int64)})


def test_a_device_kernel_that_is_not_there_is_refused_naming_it():
    with pytest.raises(ValueError, match="device_kernel must be 'torch' or 'te', got 'cuda'"):
        fo.adamw(1e-3, device_kernel="cuda")
    with pytest.raises(TypeError, match="device_kernel"):
        fo.sgd(0.1, device_kernel="te")  # TransformerEngine's kernel is Adam's
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # not installed, or no GPU: its import raises RuntimeError there
        with pytest.raises(RuntimeError, match="device_kernel='te' needs TransformerEngine"):
            fo.adam(1e-3, device_kernel="te")


def test_negative_scheduled_lr_raises_before_any_change():
    params = make_params()
    opt = fo.sgd(lambda n: 0.1 - 0.1 * n, momentum=0.9)
    state = opt.init(params)
    g = grad_seq(params, 3)
    params, state = opt.update(g[0], state)
    params, state = opt.update(g[1], state)  # lr 0.0 here
    snap = params["scale"].clone()
    with pytest.raises(ValueError, match="lr schedule returned -0.1.* at step 2"):
        opt.update(g[2], state)
    assert torch.equal(params["scale"], snap) and int(state.count) == 2


def test_wrong_state_type():
    opt = fo.adamw(1e-3)
    with pytest.raises(TypeError, match="AdamState"):
        opt.update({}, fo.sgd(0.1).init({"w": torch.zeros(1)}))


@pytest.mark.parametrize("make,kwargs,names", [
    (fo.adamw, dict(lr=1e38), ["lr"]),  # the step size lr / (1 - beta1) overflows
    (fo.adam, dict(lr=1e38), ["lr"]),
    (fo.adam, dict(lr=1e-3, weight_decay=1e39), ["weight_decay"]),
    (fo.adamw, dict(lr=1e30, weight_decay=1e10), ["lr", "weight_decay"]),  # 1 - lr * wd
    (fo.lion, dict(lr=1e39), ["lr"]),
    (fo.sgd, dict(lr=1e39, momentum=0.9), ["lr"]),
    (fo.sgd, dict(lr=1e39, weight_decay=1e39), ["lr"]),  # the first scalar that overflows
    (fo.adafactor, dict(lr=1e39), ["lr"]),
])
def test_an_unrepresentable_scalar_names_only_the_options_that_make_it(make, kwargs, names):
    given = ", ".join(f"{k}={kwargs[k]!r}" for k in names)
    with pytest.raises(ValueError) as e:
        make(**kwargs)
    msg = str(e.value)
    assert f": {given} give" in msg and msg.endswith(f"use a smaller {' or '.join(names)}"), msg
    others = {"beta1", "beta2", "eps", "momentum", "weight_decay", "lr"} - set(names)
    assert not any(k in msg for k in others), msg


def test_an_unrepresentable_scheduled_value_names_its_option_at_the_step():
    opt = fo.adamw(lambda n: 1e-3 if n == 0 else 1e38)
    params = {"w": torch.zeros(2)}
    params, state = opt.update({"w": torch.ones(2)}, opt.init(params))
    with pytest.raises(ValueError,
                       match=r"adamw: lr=1e\+38 gives a kernel scalar .*use a smaller lr$"):
        opt.update({"w": torch.ones(2)}, state)
    assert int(state.count) == 1


def test_unrepresentable_scalars_of_a_spec_without_named_fields_name_every_option():
    from typing import NamedTuple

    from functional_offload.optimizers.spec import check_representable
    from functional_offload.optimizers.sgd import spec

    class Derived(NamedTuple):
        step_size: float

    sgd = spec(False, False)._replace(scalars=lambda h: [h.step_size])
    with pytest.raises(ValueError, match="the hyperparameters lr, weight_decay give a kernel "
                                         "scalar of 1e[+]39.*use smaller values"):
        check_representable(sgd, Derived(1e39), ["lr", "weight_decay"])


def test_a_labels_tree_that_does_not_fit_gives_the_totals():
    params = {f"l{i}": torch.zeros(2) for i in range(9)}
    labels = {"l0": "a", **{f"x{i}": "a" for i in range(7)}}
    with pytest.raises(ValueError) as e:
        fo.partition({"a": fo.sgd(0.1)}, labels).init(params)
    msg = str(e.value)
    assert "does not match the params (9 leaves)" in msg, msg
    assert "without a label ['l1', 'l2', 'l3', 'l4', 'l5'] and 3 more (8 in all)" in msg, msg
    assert "labels of no param ['x0', 'x1', 'x2', 'x3', 'x4'] and 2 more (7 in all)" in msg, msg


@pytest.mark.parametrize("params", [{"a.b": torch.ones(2), "a": {"b": torch.ones(2)}},
                                    {0: torch.ones(2), "0": torch.ones(2)}])
def test_params_whose_dotted_paths_coincide_are_refused_at_init(params):
    """A checkpoint names each leaf's state by its dotted path: two leaves with one path are
    refused at ``init``, naming it, not at the first save."""
    with pytest.raises(ValueError, match=r"dotted path '(a\.b|0)'.*rename one"):
        fo.adamw(1e-2).init(params)
