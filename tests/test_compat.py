"""The torch.optim adapter, the Megatron option mapping and the placement report."""

import dataclasses
import json

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.compat import optimizer_from_megatron
from functional_offload.kernels import remainder
from conftest import grad_seq


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def train(model, opt, steps, sched=None, clip=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        model(x).square().mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched:
            sched.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


SCHEDS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda n: 1 / (1 + n)),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=1e-4),
}


@pytest.mark.parametrize("sched", ["none", *SCHEDS])
def test_adapter_matches_torch_optim_with_schedulers(sched):
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    a, b = make_model(), make_model()
    ours = fo.TorchOptimizer(a.named_parameters(), fo.adamw, cpu_kernel="torch", **kw)
    ref = torch.optim.AdamW(b.parameters(), **kw)
    got = train(a, ours, 12, SCHEDS[sched](ours) if sched != "none" else None)
    want = train(b, ref, 12, SCHEDS[sched](ref) if sched != "none" else None)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


def test_adapter_matches_functional_api_and_clip():
    a = make_model()
    params = {k: v.detach().clone() for k, v in a.named_parameters()}
    ours = fo.TorchOptimizer(a.named_parameters(), fo.sgd, lr=0.1, momentum=0.9, max_grad_norm=0.5)
    got = train(a, ours, 6)
    fopt = fo.chain(fo.clip_by_global_norm(0.5), fo.sgd(0.1, momentum=0.9))
    b = make_model()
    state = fopt.init(params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(32, 8, generator=gen)
        ps = {k: v.detach().requires_grad_() for k, v in params.items()}  # shares storage
        loss = torch.func.functional_call(b, ps, (x,)).square().mean()
        grads = dict(zip(ps, torch.autograd.grad(loss, list(ps.values()))))
        params, state = fopt.update(grads, state)
    for k in got:
        assert torch.allclose(got[k], params[k], rtol=1e-6, atol=1e-7), k


def test_param_groups_have_their_own_hyperparameters():
    a, b = make_model(), make_model()
    groups = lambda m: [{"params": [m[0].weight, m[2].weight], "weight_decay": 0.5},  # noqa: E731
                        {"params": [m[0].bias, m[2].bias], "lr": 1e-3, "weight_decay": 0.0}]
    ours = fo.TorchOptimizer(groups(a), fo.adamw, lr=1e-2, cpu_kernel="torch")
    ref = torch.optim.AdamW(groups(b), lr=1e-2)
    got, want = train(a, ours, 5), train(b, ref, 5)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_adapter_state_dict_round_trip_resume_bit_exact(tmp_path):
    straight = make_model()
    o = fo.TorchOptimizer(straight.named_parameters(), fo.adamw, lr=1e-2)
    s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
    train(straight, o, 4, s, seed=1)
    want = train(straight, o, 4, s, seed=2)

    m = make_model()
    o = fo.TorchOptimizer(m.named_parameters(), fo.adamw, lr=1e-2)
    s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
    train(m, o, 4, s, seed=1)
    torch.save({"opt": o.state_dict(), "sched": s.state_dict(), "model": m.state_dict()}, tmp_path / "ck.pt")
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    m2 = make_model(seed=5)
    m2.load_state_dict(ck["model"])
    o2 = fo.TorchOptimizer(m2.named_parameters(), fo.adamw, lr=1e-2)
    s2 = torch.optim.lr_scheduler.CosineAnnealingLR(o2, T_max=10)
    o2.load_state_dict(ck["opt"])
    s2.load_state_dict(ck["sched"])
    got = train(m2, o2, 4, s2, seed=2)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_adapter_rejects_unknown_options_and_mismatched_state():
    with pytest.raises(TypeError, match="momentum"):
        fo.TorchOptimizer(make_model().parameters(), fo.adamw, momentum=0.9)
    a = fo.TorchOptimizer(make_model().named_parameters(), fo.adamw)
    b = fo.TorchOptimizer(list(make_model().parameters())[:3], fo.adamw)
    with pytest.raises(ValueError, match="doesn't match the size"):  # torch's message
        b.load_state_dict(a.state_dict())
    c = fo.TorchOptimizer(list(make_model().parameters()), fo.adamw)
    c.load_state_dict(a.state_dict())  # names do not decide loading (torch's rule)


def test_adapter_names_a_param_reshaped_between_steps_and_steps_it_afresh_once_dropped():
    """A param reshaped (same element count) after its state was made: the step is refused
    saying so, nothing changed, and dropping its state starts it afresh as torch.optim would."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 6)
    opt = fo.TorchOptimizer(m.parameters(), fo.adamw, lr=1e-3)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    bias_before = opt.state[m.bias]["exp_avg"].clone()
    m.weight.data = m.weight.data.reshape(4, 6).clone()
    m.weight.grad, m.bias.grad = torch.randn(4, 6), torch.randn(6)
    with pytest.raises(ValueError, match=r"param 0: .*reshaped since its state was made"):
        opt.step()
    assert torch.equal(opt.state[m.bias]["exp_avg"], bias_before)
    del opt.state[m.weight]
    opt.step()
    assert opt.state[m.weight]["exp_avg"].shape == (4, 6)
    assert not torch.equal(opt.state[m.bias]["exp_avg"], bias_before)


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_a_group_without_grads_keeps_its_step_as_in_torch(delayed):
    """A param group none of whose params has a grad (a frozen backbone) is left alone, as
    torch.optim leaves it: its step count does not advance, so once unfrozen its bias
    corrections start from step 1 and the params equal torch.optim.AdamW's bit for bit."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    (b1, h1), (b2, h2) = build(), build()
    delay = fo.Delay(lookahead=False) if delayed else False
    ours = fo.TorchOptimizer([{"params": list(b1.parameters())}, {"params": list(h1.parameters())}],
                             fo.adamw, cpu_kernel="torch", lr=1e-2, delayed=delay)
    ref = torch.optim.AdamW([{"params": list(b2.parameters())}, {"params": list(h2.parameters())}],
                            lr=1e-2)
    x = torch.randn(32, 16)
    for step in range(8):
        for b, h, o in ((b1, h1, ours), (b2, h2, ref)):
            b.requires_grad_(step >= 5)  # the backbone frozen for 5 steps
            o.zero_grad(set_to_none=True)
            if o is ours:
                o.flush()  # the forward reads landed params (no land_before_forward here)
            h(b(x)).square().mean().backward()
            o.step()
    ours.flush()
    assert int(ours.state[b1.weight]["step"]) == int(ref.state[b2.weight]["step"]) == 3
    for p, q in zip([*b1.parameters(), *h1.parameters()], [*b2.parameters(), *h2.parameters()]):
        assert torch.equal(p, q)


def _megatron_pair(make, grads, params):
    """The params after ``grads`` under ``make()`` (each a fresh optimizer and params)."""
    opt = make()
    p = optree.tree_map(torch.clone, params)
    s = opt.init(p)
    for g in grads:
        p, s = opt.update(g, s)
    return p


def test_megatron_options_map_to_the_same_optimizer():
    params = {k: v.detach() for k, v in make_model().named_parameters()}
    grads = [optree.tree_map(lambda p: torch.randn_like(p) * 3, params) for _ in range(5)]
    decays = {k: not k.endswith(".bias") for k in params}  # Megatron: no decay for biases
    got = _megatron_pair(lambda: optimizer_from_megatron(
        lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, clip_grad=1.0,
        optimizer_cpu_offload=True, optimizer_offload_fraction=0.5), grads, params)
    want = _megatron_pair(lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(
        1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, weight_decay_mask=decays)),
        grads, params)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    sgd = optimizer_from_megatron(optimizer="sgd", lr=0.1, clip_grad=0.0, sgd_momentum=0.5)
    assert isinstance(sgd.init(params), fo.SGDState)
    adam = optimizer_from_megatron(lr=0.1, decoupled_weight_decay=False, exp_avg_dtype="bf16")
    st = adam.init(params)[1]
    assert st.mu["0.weight"].dtype == torch.bfloat16 and st.nu["0.weight"].dtype == torch.float32


def test_megatron_decay_rule_and_split_master():
    params = {"blocks.0.attn.q_layernorm.weight": torch.ones(4), "blocks.0.attn.qkv.weight":
              torch.ones(4, 4), "blocks.0.attn.qkv.bias": torch.ones(4), "head": torch.ones(4, 4)}
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    for qk, kept in ((False, {"blocks.0.attn.qkv.weight", "head"}),
                     (True, {"blocks.0.attn.qkv.weight", "head", "blocks.0.attn.q_layernorm.weight"})):
        opt = optimizer_from_megatron(lr=0.5, weight_decay=0.5, clip_grad=0.0,
                                      apply_wd_to_qk_layernorm=qk)
        p, _ = opt.update(grads, opt.init(optree.tree_map(torch.clone, params)))
        assert {k for k in p if not torch.equal(p[k], params[k])} == kept, qk
    bf = {"w": torch.randn(300, 300).bfloat16()}  # past the size of leaves packed with fp32 masters
    on = dict(lr=1e-3, optimizer_cpu_offload=True)
    split = optimizer_from_megatron(use_precision_aware_optimizer=True, **on).init(bf)[1]
    plain = optimizer_from_megatron(**on).init(bf)[1]  # store_param_remainders needs the former
    assert remainder.is_split(split.master["w"]) and not remainder.is_split(plain.master["w"])


class _Config:  # the fields of Megatron's OptimizerConfig that a test sets; others keep defaults
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_megatron_config_object_and_keywords():
    params = {k: v.detach() for k, v in make_model().named_parameters()}
    grads = [optree.tree_map(lambda p: torch.randn_like(p), params) for _ in range(3)]
    cfg = _Config(lr=1e-2, weight_decay=0.1, adam_beta2=0.95, clip_grad=0.5, bf16=True,
                  optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, timers=None)
    a = _megatron_pair(lambda: optimizer_from_megatron(cfg), grads, params)
    b = _megatron_pair(lambda: optimizer_from_megatron(
        lr=1e-2, weight_decay=0.1, adam_beta2=0.95, clip_grad=0.5, optimizer_cpu_offload=True),
        grads, params)
    c = _megatron_pair(lambda: optimizer_from_megatron(cfg, lr=2e-2), grads, params)  # keyword wins
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)


def test_megatron_real_optimizer_config():
    """Megatron-core's own OptimizerConfig, and its own weight-decay rule as the mask's oracle."""
    mc = pytest.importorskip("megatron.core.optimizer")
    model = torch.nn.ModuleDict({"embedding": torch.nn.Embedding(10, 8),
                                 "norm": torch.nn.LayerNorm(8), "proj": torch.nn.Linear(8, 8)})
    params = {k: v.detach() for k, v in model.named_parameters()}
    cfg = mc.OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=True, optimizer_cpu_offload=True,
                             optimizer_offload_fraction=0.5, adam_beta2=0.95, clip_grad=1.0)
    zero_wd = [k for k in mc.get_standard_config_overrides(cfg)]
    want = {n: not any(key.matches(p, n) for key in zero_wd) for n, p in params.items()}
    assert sorted(n for n, d in want.items() if d) == ["embedding.weight", "proj.weight"]
    grads = [optree.tree_map(lambda p: torch.randn_like(p), params) for _ in range(3)]
    got = _megatron_pair(lambda: optimizer_from_megatron(cfg), grads, params)
    ref = _megatron_pair(lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(
        1e-2, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=want,
        placement=fo.placement.offload_fraction(0.5))), grads, params)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    with pytest.raises(ValueError, match="'adam' and 'sgd'"):
        optimizer_from_megatron(mc.OptimizerConfig(lr=1e-3, optimizer="muon"))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5), r"\[0, 1\]"),
    (dict(optimizer_offload_fraction=-0.1), r"\[0, 1\]"),
    (dict(optimizer_cpu_offload=True, decoupled_weight_decay=False), "decoupled_weight_decay"),
    (dict(optimizer="lamb"), "'adam' and 'sgd'"),
    (dict(exp_avg_dtype="fp8"), "exp_avg_dtype"),
    (dict(main_params_dtype="fp16"), "main_params_dtype"),
    (dict(fp16=True), "loss scaling"),
    (dict(decoupled_lr=1e-4), "decoupled_lr"),
    (dict(lr=None), "lr is None"),
    (dict(exp_avg_sq_dtype="fp16"), "exp_avg_sq_dtype"),  # TE scales fp16 moments; we would not
    (dict(adam_beta1=1.5), "adam_beta1"),
    (dict(sgd_momentum=-0.5, optimizer="sgd"), "sgd_momentum"),
    (dict(clip_grad=None), "clip_grad"),
    (dict(clip_grad=True), "clip_grad"),
    (dict(optimizer_offload_fraction="0.5"), "optimizer_offload_fraction"),
    (dict(optimizer="sgd", use_precision_aware_optimizer=True), "optimizer='adam' only"),
    (dict(exp_avg_dtype=torch.uint8), "block-wise.*megatron_weight_decay_mask"),
    (dict(optimizer="sgd", device_kernel="te"), "Adam's"),
])
def test_megatron_option_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        optimizer_from_megatron(**{"lr": 1e-3, **kwargs})


def test_megatron_unknown_fields_and_leaves_are_named():
    with pytest.raises(TypeError, match="adam_beta3"):
        optimizer_from_megatron(lr=1e-3, adam_beta3=0.9)
    with pytest.raises(TypeError, match="adam_beta_2"):  # a misspelt field of a config object
        optimizer_from_megatron(_Config(lr=1e-3, adam_beta_2=0.95))
    newer = dataclasses.make_dataclass("Newer", [("lr", float, 1e-3), ("adam_beta2", float, 0.95),
                                                 ("new_knob", float, 0.0)])
    optimizer_from_megatron(newer())  # a newer Megatron's field passes at its default...
    with pytest.raises(TypeError, match="new_knob"):  # ...and is named once it is set
        optimizer_from_megatron(newer(new_knob=1.0))
    with pytest.raises(ValueError, match="'adam' and 'sgd'"):  # a dict is a config too
        optimizer_from_megatron({"lr": 1e-3, "optimizer": "muon"})
    opt = optimizer_from_megatron(lr=1e-3)
    with pytest.raises(TypeError, match="leaf .0.0. is a str"):
        opt.init(list(make_model().named_parameters()))


def test_placement_report_table_and_json(tmp_path):
    params = {"w": torch.zeros(4, 4, dtype=torch.bfloat16), "b": torch.zeros(4)}
    state = fo.adamw(1e-3).init(params)
    rep = fo.placement_report(state)
    paths = [r["path"] for r in rep.rows]
    assert paths == ["count", "mu.b", "mu.w", "nu.b", "nu.w", "master.w"]
    assert rep.host_bytes == 8 + 16 + 64 + 16 + 64 + 64 and rep.device_bytes == 0
    assert "master.w" in str(rep) and "float32" in str(rep)
    data = json.loads(rep.to_json(tmp_path / "r.json"))
    assert data["host_bytes"] == rep.host_bytes
    assert json.loads((tmp_path / "r.json").read_text())["leaves"][5]["shape"] == [4, 4]


@pytest.mark.parametrize("options, error, match", [
    (dict(optimizer_cpu_offload="no"), TypeError, "optimizer_cpu_offload must be True or False"),
    (dict(apply_wd_to_qk_layernorm="False"), TypeError, "apply_wd_to_qk_layernorm must be True"),
    (dict(adam_eps=float("inf")), ValueError, "adam_eps must be a number"),
    (dict(optimizer="sgd", exp_avg_dtype="bf16"), ValueError, "exp_avg_dtype='bf16' is Adam's"),
])
def test_megatron_loose_values_are_refused_naming_the_field(options, error, match):
    with pytest.raises(error, match=match):
        fo.compat.optimizer_from_megatron(lr=1e-3, **options)


def test_megatron_clips_by_an_fp32_norm():
    """Megatron computes the clip's norm and factor in fp32 for bf16 grads; torch's
    ``clip_grad_norm_`` (our default) in bf16. The Megatron mapping clips as Megatron."""
    params = {k: v.detach().bfloat16() for k, v in make_model().named_parameters()}
    g = torch.Generator().manual_seed(5)
    grads = [optree.tree_map(lambda p: (torch.randn(p.shape, generator=g) * 3).bfloat16(), params)
             for _ in range(4)]
    decays = {k: not k.endswith(".bias") for k in params}

    def adamw() -> fo.GradientTransformation:
        return fo.adamw(1e-2, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=decays)

    got = _megatron_pair(lambda: optimizer_from_megatron(
        lr=1e-2, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0), grads, params)
    fp32 = _megatron_pair(lambda: fo.chain(
        fo.clip_by_global_norm(1.0, norm_dtype=torch.float32), adamw()), grads, params)
    bf16 = _megatron_pair(lambda: fo.chain(fo.clip_by_global_norm(1.0), adamw()), grads, params)
    assert all(torch.equal(got[k], fp32[k]) for k in got)
    assert any(not torch.equal(got[k], bf16[k]) for k in got)


def test_megatron_mapping_takes_the_delayed_update():
    """``delayed`` (no Megatron field) reaches the optimizer: with fo.Delay(lookahead=False) and
    the landing hooks, the same params as without it."""
    out = []
    for delayed in (False, fo.Delay(lookahead=False)):
        model = make_model()
        params = dict(model.named_parameters())
        opt = optimizer_from_megatron(lr=1e-2, clip_grad=1.0, optimizer_cpu_offload=True,
                                      delayed=delayed)
        holder = [opt.init(params)]
        hooks = fo.land_before_forward(model, lambda: holder[0])
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            _, holder[0] = opt.update({k: p.grad for k, p in params.items()}, holder[0])
            model.zero_grad(set_to_none=True)
        fo.flush(holder[0])
        hooks.remove()
        out.append([p.detach().clone() for p in params.values()])
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_megatron_mapping_takes_the_librarys_options():
    """``executor`` and ``cpu_kernel`` (no Megatron fields) reach the optimizer: torch's host
    kernel gives torch.optim.AdamW's bits, and a GPU engine's executor refuses CPU params."""
    model = make_model()
    params = dict(model.named_parameters())
    ref = [p.detach().clone().requires_grad_() for p in params.values()]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0)
    opt = optimizer_from_megatron(lr=1e-2, weight_decay=0.0, clip_grad=0.0,
                                  optimizer_cpu_offload=True, cpu_kernel="torch",
                                  executor=fo.executor.HostExecutor(threads=1))
    state = opt.init(params)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = {k: torch.randn(p.shape, generator=g) for k, p in params.items()}
        for r, x in zip(ref, grads.values()):
            r.grad = x.clone()
        torch_opt.step()
        params, state = opt.update(grads, state)
    assert all(torch.equal(p, r) for p, r in zip(params.values(), ref))
    gpu = optimizer_from_megatron(lr=1e-2, optimizer_cpu_offload=True,
                                  executor=fo.executor.HostExecutor(engine="gpu"))
    with pytest.raises(ValueError, match="engine='gpu'"):
        gpu.init(dict(make_model().named_parameters()))


def test_megatron_decay_rule_is_public_and_the_mappings_own():
    """Building the chain by hand with ``megatron_weight_decay_mask`` (e.g. for 8-bit moments)
    decays what the mapping decays."""
    outs = []
    for by_hand in (False, True):
        model = make_model()
        params = dict(model.named_parameters())
        opt = (fo.chain(fo.clip_by_global_norm(1.0, norm_dtype=torch.float32),
                        fo.adamw(1e-2, weight_decay=0.1,
                                 weight_decay_mask=fo.compat.megatron_weight_decay_mask))
               if by_hand else optimizer_from_megatron(lr=1e-2, weight_decay=0.1))
        state = opt.init(params)
        for g in grad_seq(params, 3):
            params, state = opt.update(g, state)
        outs.append([p.detach().clone() for p in params.values()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    mask = fo.compat.megatron_weight_decay_mask(dict(make_model().named_parameters()))
    assert any(mask.values()) and not all(mask.values())
