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
