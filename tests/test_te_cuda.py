"""TransformerEngine (TE 2.20) modules trained by functional_offload, against TE's own
``transformer_engine.pytorch.optimizers.FusedAdam(master_weights=True)``.

Run on a GPU box with TransformerEngine: ``pytest -m cuda tests/test_te_cuda.py``. Elsewhere every
test is collected and skipped (on a machine without a GPU ``import transformer_engine`` raises
``RuntimeError``, hence the broad ``except`` below).

How the comparisons are built. Two copies of a model, built from one seed, trained on the same
batches by two AdamW implementations that both run fp32 math on fp32 masters, differ after a step
only by operation order: a few fp32 ulps of each master. Those ulps decide now and then on which
side of a bf16 (or fp8) rounding boundary a param lands, the two forwards then differ, and from
there the trajectories part chaotically: on a CPU stand-in for the bf16 model below (a bf16 torch
transformer of the same sizes, two AdamW implementations) the masters agreed to 2e-7 for two
steps, then differed by 1.3e-3 at the third and 4e-3 at the fifth — LayerNorm gains start at 1.0
and reach a bf16 rounding boundary together after two steps of lr=1e-3, and attention key biases
get pure rounding-noise gradients (softmax ignores them), which Adam turns into full ``lr`` steps.
So each step is compared from a common state: the bf16 comparison copies our params and state
into TE's model and ``FusedAdam`` after every compared step (public
``FusedAdam.set_scaled_state``); the fp8 comparison checks the first step against TE's own run
directly and every step against a fresh ``FusedAdam`` fed our state from before the step and
the same grads. The delayed-update test uses the oracle of tests/test_delayed.py instead. Identical params then give
identical forwards and grads, which each test checks (with deterministic attention,
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``), so what remains is the optimizers' own rounding.

Only public attributes of our state are read: the ``AdamState`` fields ``count``, ``master``,
``mu``, ``nu`` of ``state[1]`` (a chain's state is the tuple of its parts' states).
"""

import re

import pytest
import torch

import functional_offload as fo
from conftest import STALE
from functional_offload.executor import HostExecutor

try:
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.optimizers import FusedAdam
    from transformer_engine.common import recipe as te_recipe
except Exception:  # TE missing, or no GPU: its import raises RuntimeError there
    te = FusedAdam = te_recipe = None
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(te is None or not torch.cuda.is_available(),
                                                   reason="needs TransformerEngine and a GPU")]

DEV = torch.device("cuda")
SEED = 1234
HIDDEN, FFN, HEADS, LAYERS, VOCAB = 256, 1024, 4, 2, 256
BATCH, SEQ = 4, 64  # 256 tokens: every GEMM dimension a multiple of 32 (fp8 and MXFP8 need it)
STEPS = 5
LR, BETAS, EPS, WD, MAX_NORM = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0

# One AdamW step from the same fp32 state and the same grads: TE's kernel folds the decay into
# the update (theta - lr * (m_hat / (sqrt(v_hat) + eps) + wd * theta)), ours decays first and
# adds -lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) (torch's order; the host's native kernel has its
# own), so the masters differ by a few fp32 ulps of the value (2**-24 each) plus a few ulps of the
# update (|update| ~ lr): rtol 1e-5 leaves over 100 ulps of margin, atol 1e-8 covers values near
# zero. A real error is far above: the decay alone moves a master by lr * wd = 1e-4 of itself
# per step, a 1 % error of the step is 1e-5 absolute.
MASTER_RTOL, MASTER_ATOL = 1e-5, 1e-8
# Moments: m = b1*m + (1-b1)*g (TE) against torch's lerp, v likewise: a few ulps of each; atol
# is relative to the tensor's largest entry (m can cancel to near zero).
MOMENT_RTOL, MOMENT_ATOL = 1e-5, 1e-6
# bf16 has 8 significant bits: one step is at most 2**-7 of the value. Two masters within the
# tolerance above round to the same bf16 value or to neighbours.
BF16_STEP = 2.0 ** -7
# e4m3 (the fp8 format of weights in every recipe here) has 3 mantissa bits: in the normal range
# a step is at most 2**-3 of the value, so rounding to nearest errs by at most 2**-4 of it; the
# subnormal step is 2**-9 of the scaled unit (see _e4m3_floor for the absolute term).
E4M3_STEP, E4M3_ROUND, E4M3_MAX = 2.0 ** -3, 2.0 ** -4, 448.0


# ---- models, data, optimizers -------------------------------------------------------------

class TEStack(torch.nn.Module):
    """te.Linear -> LAYERS te.TransformerLayer -> residual te.LayerNormMLP -> te.LayerNormLinear
    head; batch-first activations [BATCH, SEQ, HIDDEN], no dropout."""

    def __init__(self, dtype):
        super().__init__()
        self.embed = te.Linear(HIDDEN, HIDDEN, params_dtype=dtype)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                layer_number=i + 1, self_attn_mask_type="causal",
                                attn_input_format="bshd", params_dtype=dtype)
            for i in range(LAYERS))
        self.mlp = te.LayerNormMLP(HIDDEN, FFN, params_dtype=dtype)
        self.head = te.LayerNormLinear(HIDDEN, VOCAB, params_dtype=dtype)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        h = h + self.mlp(h)
        return self.head(h)


class FP8Block(torch.nn.Module):
    """te.Linear then a residual te.LayerNormMLP, bf16 params_dtype (fp8 weights when built under
    ``te.quantized_model_init``)."""

    def __init__(self):
        super().__init__()
        self.proj = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16)
        self.mlp = te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16)

    def forward(self, x):
        h = self.proj(x)
        return h + self.mlp(h)


def _build_bf16(monkeypatch):
    """A TEStack in bf16, from SEED (two calls give identical models). DotProductAttention reads
    NVTE_ALLOW_NONDETERMINISTIC_ALGO when it is built: 0 selects a deterministic backend, so two
    models with the same params compute the same grads bit for bit."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    torch.manual_seed(SEED)
    return TEStack(torch.bfloat16)


def _recipe(name):
    """The recipe ``name``, or skip with TE's own reason where the GPU cannot run it."""
    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.skip(f"FP8: {why}")
    if name == "mxfp8":
        ok, why = te.is_mxfp8_available(return_reason=True)  # sm_90 (H100/H200): not available
        if not ok:
            pytest.skip(f"MXFP8: {why}")
    return {"delayed": te_recipe.DelayedScaling, "current": te_recipe.Float8CurrentScaling,
            "mxfp8": te_recipe.MXFP8BlockScaling}[name]()


def _build_fp8(rec):
    """An FP8Block whose weights are quantized (primary fp8 weights) with ``rec``, from SEED."""
    torch.manual_seed(SEED)
    with te.quantized_model_init(enabled=True, recipe=rec):
        return FP8Block()


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(DEV, torch.bfloat16),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(DEV)) for _ in range(n)]


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _fp8_loss(model, x, rec):
    """Forward under ``te.autocast`` with ``rec``, loss = mean of squares, backward outside it."""
    with te.autocast(enabled=True, recipe=rec):
        out = model(x)
    loss = out.float().square().mean()
    loss.backward()
    return loss.detach().item()


FUSED_STATE = ("master_param", "exp_avg", "exp_avg_sq")  # FusedAdam's names for master, mu, nu


def _fused_state(opt, p):
    """FusedAdam's (master, exp_avg, exp_avg_sq) of ``p``, fp32, through its public
    ``get_unscaled_state``."""
    return tuple(opt.get_unscaled_state(p, name) for name in FUSED_STATE)


def _fused_adam(params, **kw):
    return FusedAdam(list(params), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                     adam_w_mode=True, **kw)


def _ours(fraction, **kw):
    return fo.chain(fo.clip_by_global_norm(MAX_NORM),
                    fo.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             placement=fo.placement.offload_fraction(fraction),
                             executor=HostExecutor(chunk_bytes=256 << 10, threads=4), **kw))


# ---- comparisons --------------------------------------------------------------------------

@torch.no_grad()
def _value(p):
    """A param's value in fp32: dequantized for TE's quantized tensors (public ``dequantize``)."""
    if isinstance(p, te.QuantizedTensor):
        return p.dequantize(dtype=torch.float32)
    return p.detach().to(torch.float32, copy=True)


def _close(got, want, what, rtol, atol):
    got = got.detach().to(DEV, torch.float32)
    want = want.detach().to(DEV, torch.float32)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _close_state(m, mu, nu, want, what):
    """Master and moments against ``want = (master, exp_avg, exp_avg_sq)`` of one step."""
    assert m.dtype == torch.float32, f"{what}: master is {m.dtype}"
    _close(m, want[0], f"master of {what}", MASTER_RTOL, MASTER_ATOL)
    for name, got, ref in (("exp_avg", mu, want[1]), ("exp_avg_sq", nu, want[2])):
        _close(got, ref, f"{name} of {what}", MOMENT_RTOL,
               MOMENT_ATOL * float(ref.abs().max()) + 1e-30)


def _close_bf16(got, want, what):
    """bf16 params rounded from masters within MASTER_* of each other: at most one bf16 step."""
    _close(got, want, what, BF16_STEP + MASTER_RTOL, MASTER_ATOL)


def _e4m3_floor(quantized, *like):
    """An upper bound, in value units, on the e4m3 subnormal step (2**-9 of the scaled unit)
    of ``quantized`` (dequantized values) and of values ``like`` it. From the scales' rule: the
    per-tensor scale is 448 / amax (current scaling: the tensor's own amax; delayed scaling: the
    largest of the amax history, within a few percent of the current one over these few steps
    of lr=1e-3) and an MXFP8 block's power-of-two scale is at most twice its block's amax / 448,
    so twice the largest magnitude / 448 bounds 1 / scale. From the data, should a scale lag
    further (a delayed scale still at its initial 1): the smallest nonzero magnitude of
    ``quantized`` is a multiple of the step, and with thousands of weights spread around zero
    some fall on the first one; twice it."""
    amax = max(float(t.abs().max()) for t in (quantized, *like))
    nonzero = quantized.abs()[quantized != 0]
    data = 2 * float(nonzero.min()) if nonzero.numel() else 0.0
    return max(2.0 ** -9 * 2 * amax / E4M3_MAX, data) + 1e-30


def _assert_same_grads(params, want, t, what="TE's"):
    for k, p in params.items():
        assert p.grad is not None and torch.equal(p.grad, want[k]), (
            f"step {t}: the grad of {k!r} differs from {what} model's with the same params and "
            "inputs: TE's forward/backward is not deterministic on this box "
            "(NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 was set), so the optimizers got different input")


def _check_placement(inner, fraction):
    devices = {m.device.type for m in inner.master.values()}
    assert devices == {1.0: {"cpu"}, 0.5: {"cpu", "cuda"}, 0.0: {"cuda"}}[fraction], devices


def _snapshot(inner):
    """Copies of our state's master, mu and nu per leaf, on the GPU."""
    return {k: tuple(x[k].detach().to(DEV, torch.float32, copy=True)
                     for x in (inner.master, inner.mu, inner.nu)) for k in inner.master}


def _fused_adam_step(before, grads, step):
    """TE's FusedAdam, one step from ``before`` ({leaf: (master, mu, nu)}, fp32) at step number
    ``step``, on ``grads`` clipped as torch.nn.utils.clip_grad_norm_ clips them (in bf16, leaves
    in build order): fp32 params (= the masters, ``master_weights`` off) with exp_avg /
    exp_avg_sq set through its public ``set_scaled_state``. Returns {leaf: (master, exp_avg,
    exp_avg_sq)} after the step."""
    holders = []
    for g in grads.values():
        h = torch.nn.Parameter(torch.empty_like(g))
        h.grad = g.detach().clone()
        holders.append(h)
    torch.nn.utils.clip_grad_norm_(holders, MAX_NORM)
    shadow = {k: torch.nn.Parameter(before[k][0].clone()) for k in grads}
    opt = _fused_adam(shadow.values())
    for (k, p), h in zip(shadow.items(), holders):
        opt.set_scaled_state(p, "exp_avg", before[k][1].clone())
        opt.set_scaled_state(p, "exp_avg_sq", before[k][2].clone())
        p.grad = h.grad.float()
    opt.param_groups[0]["step"] = step - 1  # step() counts it up to `step` for bias correction
    opt.step()
    return {k: (p.detach(), opt.get_unscaled_state(p, "exp_avg"),
                opt.get_unscaled_state(p, "exp_avg_sq")) for k, p in shadow.items()}


# ---- 1. bf16 TE model: every mode against FusedAdam(master_weights=True) ------------------

MODES = {"host": (1.0, False), "half": (0.5, False), "device": (0.0, False), "stream": (1.0, True)}


@pytest.mark.parametrize("mode", list(MODES))
def test_bf16_te_model_steps_match_fused_adam(mode, monkeypatch):
    """A bf16 model of te.Linear, te.TransformerLayer, te.LayerNormMLP and te.LayerNormLinear,
    built twice from one seed. TE's copy steps with ``clip_grad_norm_`` + ``FusedAdam(
    master_weights=True)``, ours with ``chain(clip_by_global_norm, adamw)`` with its state on
    the host, half and half, on the device, or streamed during backward (``fo.stream``), five
    steps on the same batches. Before each step the two models hold the same params, so their
    losses and grads are equal bit for bit (checked); after it our fp32 masters and moments equal
    FusedAdam's to a few fp32 ulps (MASTER_*, MOMENT_*: both run one fp32 AdamW step on fp32
    masters, in different op order) and the bf16 params are within one bf16 step of TE's (rounded
    from masters that close; nearly all equal). Then TE's copy takes our params and state (param
    copy_, ``FusedAdam.set_scaled_state``), so each step is compared from a common state (see the
    module docstring for why the free-running trajectories cannot be compared tightly)."""
    fraction, streamed = MODES[mode]
    ref_model, model = _build_bf16(monkeypatch), _build_bf16(monkeypatch)
    ref = dict(ref_model.named_parameters())
    params = dict(model.named_parameters())
    live = dict(params)
    assert list(ref) == list(params)
    for k in params:
        assert params[k].dtype == torch.bfloat16 and torch.equal(params[k], ref[k]), k
    ref_opt = _fused_adam(ref.values(), master_weights=True)
    opt = _ours(fraction)
    state = opt.init(params)
    _check_placement(state[1], fraction)

    for t, (x, y) in enumerate(_batches(STEPS), 1):
        ref_loss = _ce(ref_model(x), y)
        ref_loss.backward()
        raw = {k: p.grad.clone() for k, p in ref.items()}
        torch.nn.utils.clip_grad_norm_(list(ref.values()), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        loss = _ce(model(x), y)
        if streamed:
            with fo.stream(opt, state) as s:
                loss.backward()
            assert len(s.arrived) == len(params)  # every leaf handed over during backward
            _assert_same_grads(params, raw, t)
            params, state = s.finish()
        else:
            loss.backward()
            _assert_same_grads(params, raw, t)
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        assert loss.detach().item() == ref_loss.detach().item(), t

        inner = state[1]
        assert int(inner.count) == t and ref_opt.param_groups[0]["step"] == t
        differ = total = 0
        for k, p in ref.items():
            assert params[k] is live[k], k  # updated in place: the TE module sees the new values
            _close_state(inner.master[k], inner.mu[k], inner.nu[k], _fused_state(ref_opt, p),
                         f"{k} at step {t}")
            _close_bf16(params[k], p, f"param {k} at step {t}")
            differ += int((params[k] != p).sum())
            total += p.numel()
        assert differ <= 1e-3 * total, f"step {t}: {differ} of {total} bf16 params differ"

        with torch.no_grad():  # TE's copy takes our params and state: the next step starts equal
            for k, p in ref.items():
                p.copy_(params[k])
                for name, ours in zip(FUSED_STATE, (inner.master, inner.mu, inner.nu)):
                    ref_opt.set_scaled_state(p, name, ours[k].to(DEV, torch.float32, copy=True))


# ---- 2. delayed updates on the bf16 TE model ----------------------------------------------

DELAYED_STEPS = 20


@pytest.mark.parametrize("delay", ["ahead", "stale"])
def test_delayed_update_on_a_bf16_te_model(delay, monkeypatch):
    """``adamw(delayed=True)`` (the look-ahead; "ahead") and ``delayed=Delay(lookahead=False)``
    ("stale"), state on the host, 20 steps cycling two batches, clipped. The oracle is the one of
    tests/test_delayed.py: our non-delayed update replayed on a copy of the initial params with
    the grads the delayed run's backwards produced. A delayed update changes when a step lands,
    never its math: after ``fo.flush`` the state (masters, moments, count) and the params equal
    the replay's bit for bit. What the forwards read: stale, the params one update behind (the
    replay's after t-1 updates, bit for bit); ahead, the second forward the initial params (the
    first update has nothing to land), from the fourth on much closer to the replay's after t
    updates than the last step's are (Adam's landing leaves a fraction of the last landing's error
    plus bf16 rounding: 0.64, 0.26, then about 0.2 of a step on a CPU stand-in of this model; a
    stale read is a whole step away). The loss on the first batch falls by a quarter or more."""
    model = _build_bf16(monkeypatch)
    params = dict(model.named_parameters())
    start = {k: v.detach().clone() for k, v in params.items()}
    opt = _ours(1.0, delayed=True if delay == "ahead" else STALE)
    state = opt.init(params)
    data = _batches(2, seed=7)
    seen, grads, losses = [], [], []
    for t in range(DELAYED_STEPS):
        x, y = data[t % 2]
        seen.append({k: v.detach().clone() for k, v in params.items()})
        loss = _ce(model(x), y)
        loss.backward()
        losses.append(loss.detach().item())
        grads.append({k: p.grad.clone() for k, p in params.items()})
        params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
    fo.flush(state)

    ref = _ours(1.0)
    q = {k: v.clone() for k, v in start.items()}
    r = ref.init(q)
    replay = [{k: v.clone() for k, v in q.items()}]
    for g in grads:
        q, r = ref.update(g, r)
        replay.append({k: v.clone() for k, v in q.items()})
    torch.cuda.synchronize()

    got, want = fo.state_dict(state), fo.state_dict(r)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].cpu(), want[k].cpu()), k
    for k in params:
        assert torch.equal(params[k], q[k]), k
    if delay == "stale":
        for t in range(1, DELAYED_STEPS):
            for k in params:
                assert torch.equal(seen[t][k], replay[t - 1][k]), (t, k)
    else:
        for k in params:
            assert torch.equal(seen[1][k], replay[0][k]), k
        mats = [k for k, v in start.items() if v.ndim >= 2]  # LayerNorm gains (1.0) move by far
        for t in range(3, DELAYED_STEPS):                   # less than their bf16 step: left out
            err = sum(float((seen[t][k].float() - replay[t][k].float()).norm()) ** 2 for k in mats)
            step = sum(float((replay[t][k].float() - replay[t - 1][k].float()).norm()) ** 2
                       for k in mats)
            assert err ** 0.5 < 0.5 * step ** 0.5, (t, (err / step) ** 0.5)
    assert losses[DELAYED_STEPS - 2] < 0.75 * losses[0], losses


# ---- 3. fp8 primary weights ----------------------------------------------------------------

SCALINGS = ["delayed", "current", "mxfp8"]
QUANTIZED = ["mlp.fc1_weight", "mlp.fc2_weight", "proj.weight"]


@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["host", "device"])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_primary_weights_match_fused_adam(scaling, fraction):
    """te.Linear + te.LayerNormMLP built under ``te.quantized_model_init`` (their three weights
    quantized: Float8Tensor for delayed and current scaling, MXFP8Tensor for MXFP8, skipped where
    TE says the GPU lacks it), forward under ``te.autocast`` with the same recipe, five steps.
    TE's copy trains first with FusedAdam(master_weights=True), then ours.

    - Init: our master of each param is fp32, where the placement puts it, and equals
      ``p.dequantize(dtype=torch.float32)`` (bf16 params: ``p.float()``).
    - Every step: the quantized params are the same objects, of the same class; masters and
      moments equal a fresh FusedAdam's one step from our state before the step on the same
      grads (MASTER_*, MOMENT_*); each quantized param dequantizes to within rounding to
      nearest of its new master (2**-4 of the value, plus 2**-8 for the bf16 the host's value
      travels up in, plus a subnormal term: _e4m3_floor), differs from the last step's, and is
      exactly what its own quantizer makes of the new master (device state) or of the master
      rounded to the param's nominal dtype (host state: the value copied up); bf16 params are
      their masters rounded, exactly.
    - Step 1 against TE's own run (same params and grads, checked): masters and moments to
      MASTER_* / MOMENT_*; quantized params within one e4m3 step (2**-3 of the value, plus
      2**-8 where a host leaf's bf16 value moved the per-tensor scale, plus two subnormal steps)
      of FusedAdam's. Not equal: TE quantizes its own master, a few ulps from ours, and with
      current scaling the amax, so the scale, and so every element differs in its last bits;
      where our host leaves quantize the bf16 value, a bf16 value on an e4m3 midpoint also ties
      to even. bf16 params within one bf16 step. Later steps are not compared with TE's run:
      from there the two runs part through those roundings."""
    rec = _recipe(scaling)
    data = [x for x, _ in _batches(STEPS, seed=3)]

    ref_model = _build_fp8(rec)
    ref = dict(ref_model.named_parameters())
    assert sorted(k for k, p in ref.items() if isinstance(p, te.QuantizedTensor)) == QUANTIZED
    kinds = {k: type(p) for k, p in ref.items()}
    start = {k: _value(p) for k, p in ref.items()}
    ref_opt = _fused_adam(ref.values(), master_weights=True)
    ref_losses = []
    for t, x in enumerate(data, 1):
        ref_losses.append(_fp8_loss(ref_model, x, rec))
        if t == 1:
            ref_grads = {k: p.grad.clone() for k, p in ref.items()}
        torch.nn.utils.clip_grad_norm_(list(ref.values()), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if t == 1:
            first = {k: (tuple(x.clone() for x in _fused_state(ref_opt, p)), _value(p))
                     for k, p in ref.items()}
    torch.cuda.synchronize()

    model = _build_fp8(rec)
    params = dict(model.named_parameters())
    live = dict(params)
    for k, p in params.items():
        assert type(p) is kinds[k] and torch.equal(_value(p), start[k]), k
    opt = _ours(fraction)
    state = opt.init(params)
    inner = state[1]
    _check_placement(inner, fraction)
    for k, p in params.items():
        assert inner.master[k].dtype == torch.float32, k
        assert torch.equal(inner.master[k].to(DEV), _value(p)), k
    last = {k: _value(params[k]) for k in QUANTIZED}

    for t, x in enumerate(data, 1):
        before = _snapshot(state[1])
        loss = _fp8_loss(model, x, rec)
        grads = {k: p.grad for k, p in params.items()}
        if t == 1:
            assert loss == ref_losses[0]
            _assert_same_grads(params, ref_grads, t)
        want = _fused_adam_step(before, grads, t)
        params, state = opt.update(grads, state)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

        inner = state[1]
        assert int(inner.count) == t
        for k, p in params.items():
            what = f"{k} at step {t}"
            assert p is live[k] and type(p) is kinds[k], what
            _close_state(inner.master[k], inner.mu[k], inner.nu[k], want[k], what)
            master = inner.master[k].to(DEV)
            if k in QUANTIZED:
                value = _value(p)
                _close(value, master, f"dequantized {what} against its master",
                       E4M3_ROUND + 2.0 ** -8, _e4m3_floor(value, master))
                assert not torch.equal(value, last[k]), f"{what}: not re-quantized"
                twin = p.detach().clone()  # the param's own quantizer, from what we promise
                twin.quantize_(master if inner.master[k].is_cuda else master.to(p.dtype))
                assert torch.equal(_value(twin), value), f"{what}: not its quantized master"
                last[k] = value
            else:
                assert torch.equal(p, master.to(torch.bfloat16)), what
            if t == 1:
                _close_state(inner.master[k], inner.mu[k], inner.nu[k], first[k][0],
                             f"{what} vs TE's run")
                if k in QUANTIZED:
                    value = _value(p)
                    _close(value, first[k][1], f"dequantized {what} vs TE's run",
                           E4M3_STEP + 2.0 ** -8, 2 * _e4m3_floor(value, first[k][1]))
                else:
                    _close_bf16(p, first[k][1], f"{what} vs TE's run")


@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["host", "device"])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_checkpoint_round_trip_is_exact(scaling, fraction, tmp_path):
    """fp8 primary weights: ``fo.save`` after 3 steps, ``fo.load(..., like=opt.init(params))``
    into a second model trained the same 3 steps, 2 more steps: the params (dequantized) and the
    whole state equal those of the run that went on without the round trip, bit for bit (the
    fp32 masters, moments and count are saved as they are, and the quantizer state lives in the
    TE model, which both runs built the same way). The second run's own state after 3 steps is
    checked equal to the saved one first: TE's fp8 training is deterministic here."""
    rec = _recipe(scaling)
    data = [x for x, _ in _batches(5, seed=5)]

    def run(steps, state, model, opt):
        params = dict(model.named_parameters())
        for x in steps:
            _fp8_loss(model, x, rec)
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return state

    def copy(sd):
        return {k: v.detach().cpu().clone() for k, v in sd.items()}

    model = _build_fp8(rec)
    opt = _ours(fraction)
    state = run(data[:3], opt.init(dict(model.named_parameters())), model, opt)
    fo.save(state, tmp_path / "s")
    saved = copy(fo.state_dict(state))
    state = run(data[3:], state, model, opt)
    want_state = copy(fo.state_dict(state))
    want_params = {k: _value(p) for k, p in model.named_parameters()}

    model2 = _build_fp8(rec)
    params2 = dict(model2.named_parameters())
    opt2 = _ours(fraction)
    own = run(data[:3], opt2.init(params2), model2, opt2)
    own_sd = fo.state_dict(own)
    assert own_sd.keys() == saved.keys()
    for k in saved:
        assert torch.equal(own_sd[k].cpu(), saved[k]), f"TE's fp8 run is not deterministic: {k}"
    state2 = fo.load(tmp_path / "s", like=opt2.init(params2))
    loaded = fo.state_dict(state2)
    for k in saved:
        assert loaded[k].dtype == saved[k].dtype and torch.equal(loaded[k].cpu(), saved[k]), k
    state2 = run(data[3:], state2, model2, opt2)
    got_state = fo.state_dict(state2)
    assert got_state.keys() == want_state.keys()
    for k in want_state:
        assert torch.equal(got_state[k].cpu(), want_state[k]), k
    for k, p in model2.named_parameters():
        assert torch.equal(_value(p), want_params[k]), k


REFUSING = {"delayed": lambda: fo.adamw(LR, delayed=True),  # state on the host (the default)
             "adafactor": lambda: fo.adafactor(LR)}


@pytest.mark.parametrize("option", list(REFUSING))
def test_quantized_param_is_refused_where_it_cannot_be_written(option):
    """An fp8 param is written whole, through its quantizer, once its new value is computed.
    ``adamw(delayed=True)`` with its state on the host lands params from values kept in the
    param's dtype, and adafactor's host step runs leaf by leaf: neither can write it, and
    ``init`` raises (``ValueError`` / ``TypeError``) naming the param's path.
    ``store_param_remainders=True`` is accepted: a quantized param's bits cannot be the high half
    of its master, so it keeps a whole fp32 master, the dequantized param. The weight has
    131,072 elements, more than a packed host leaf holds (65,536), so no size rule applies."""
    rec = _recipe("delayed")
    torch.manual_seed(SEED)
    with te.quantized_model_init(enabled=True, recipe=rec):
        model = torch.nn.ModuleDict({"proj": te.Linear(HIDDEN, 2 * HIDDEN, bias=False,
                                                       params_dtype=torch.bfloat16)})
    params = dict(model.named_parameters())
    assert list(params) == ["proj.weight"] and isinstance(params["proj.weight"], te.QuantizedTensor)
    opt = REFUSING[option]()
    with pytest.raises((TypeError, ValueError), match=re.escape("proj.weight")):
        opt.init(params)
    for kw in ({}, {"store_param_remainders": True}):
        master = fo.adamw(LR, **kw).init(params).master["proj.weight"]
        assert type(master) is torch.Tensor and master.dtype == torch.float32, kw
        assert torch.equal(master.to(DEV), _value(params["proj.weight"])), kw


# ---- activation offload on TE layers ------------------------------------------------------

def _grads_of(model, x, y, run=None):
    """Loss and grads of ``model`` on one batch; ``run(model, x)`` in place of the forward."""
    model.zero_grad(set_to_none=True)
    loss = _ce(run(model, x) if run else model(x), y)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["offload", "recompute", "budget"])
def test_activation_offload_on_te_layers_gives_identical_grads(mode, monkeypatch):
    """``fo.ActivationOffload`` over the te.TransformerLayer stack (one group per layer, the
    embedding and head excluded): TE's saved tensors (its fp32 LayerNorm statistics, attention's
    softmax state, bf16 inputs of its GEMMs) offloaded to the host and back, or the layer
    recomputed, or as a budget of 70 % of no offload's peak plans, give bit for bit the loss and
    grads of no offload (deterministic attention) at every step."""
    model = _build_bf16(monkeypatch).to(DEV)
    x, y = _batches(1)[0]
    _grads_of(model, x, y)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    want_loss, want = _grads_of(model, x, y)
    peak = torch.cuda.max_memory_allocated() - base
    n = len(model.layers)
    if mode == "budget":
        off = fo.ActivationOffload(n, budget_bytes=int(0.7 * peak), min_bytes=1 << 10)
    else:
        off = fo.ActivationOffload(n, 0, min_bytes=1 << 10, recompute_groups=[0]) \
            if mode == "recompute" else fo.ActivationOffload(n, n - 1, min_bytes=1 << 10)
    off.wrap(model.layers)

    def run(m, x):
        with off.record(exclude=m):
            return m(x)

    for _ in range(7 if mode == "budget" else 3):  # the budget's profiling and checking steps
        loss, got = _grads_of(model, x, y, run)
        assert torch.equal(loss, want_loss)
        for k in want:
            assert torch.equal(got[k], want[k]), k
    assert (off.stats["offloaded_bytes"] > 0) == (mode != "recompute")


def test_te_cpu_offload_context_gives_identical_grads_as_ours(monkeypatch):
    """TransformerEngine's own activation offload (``get_cpu_offload_context``) on the same
    stack gives the grads of no offload too (the peer of the test above, so the two are compared
    on equal terms in benchmarks/activation_offload.py)."""
    model = _build_bf16(monkeypatch).to(DEV)
    x, y = _batches(1)[0]
    want_loss, want = _grads_of(model, x, y)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=len(model.layers) - 1,
                                               model_layers=len(model.layers))

    def run(m, x):
        h = m.embed(x)
        for layer in m.layers:
            with context:
                h = layer(h)
            h = sync(h)
        h = h + m.mlp(h)
        return m.head(h)

    for _ in range(2):
        loss, got = _grads_of(model, x, y, run)
        assert torch.equal(loss, want_loss)
        for k in want:
            assert torch.equal(got[k], want[k]), k


# ---- 7. TransformerEngine's fused Adam as the device kernel (device_kernel="te") ---------

def _kernel_params(dtypes):
    """A GPT-block-like tree of device params: bf16 (or fp16) weights and biases, fp32 norms."""
    torch.manual_seed(SEED)
    shapes = {"blocks.0.attn.weight": (96, 64), "blocks.0.attn.bias": (96,),
              "blocks.0.ln.weight": (64,), "blocks.1.mlp.weight": (128, 64),
              "blocks.1.mlp.bias": (128,), "blocks.1.ln.weight": (64,)}
    return {k: torch.randn(s, device=DEV).to(dtypes["ln" if ".ln." in k else "w"])
            for k, s in shapes.items()}


def _kernel_grads(params, steps):
    """Per step, grads in each param's dtype; the first bias has none on the second step."""
    g = torch.Generator(device=DEV).manual_seed(SEED + 1)
    out = []
    for t in range(steps):
        gs = {k: torch.randn(p.shape, device=DEV, generator=g).to(p.dtype) for k, p in params.items()}
        if t == 1:
            gs["blocks.0.attn.bias"] = None
        out.append(gs)
    return out


def _no_decay(path):
    return path.endswith("bias") or ".ln." in path


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_te_device_kernel_steps_as_fused_adam_bit_for_bit(decoupled):
    """``device_kernel="te"`` with the state on the device: masters, moments and params equal
    ``FusedAdam(master_weights=True)``'s bit for bit at every step, with a weight-decay mask
    (two param groups there), fp32 params beside bf16 ones and a leaf without a grad."""
    dtypes = {"w": torch.bfloat16, "ln": torch.float32}
    ours, theirs = _kernel_params(dtypes), _kernel_params(dtypes)
    theirs = {k: torch.nn.Parameter(v) for k, v in theirs.items()}
    make = fo.adamw if decoupled else fo.adam
    opt = make(LR, betas=BETAS, eps=EPS, weight_decay=WD, placement=fo.placement.on_device(),
               weight_decay_mask=lambda ps: {k: not _no_decay(k) for k in ps},
               device_kernel="te")
    state = opt.init(ours)
    fa = FusedAdam([{"params": [p for k, p in theirs.items() if not _no_decay(k)]},
                    {"params": [p for k, p in theirs.items() if _no_decay(k)], "weight_decay": 0.0}],
                   lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=decoupled,
                   master_weights=True)
    for t, gs in enumerate(_kernel_grads(ours, 4)):
        for k, p in theirs.items():
            p.grad = None if gs[k] is None else gs[k].clone()
        fa.step()
        ours, state = opt.update(gs, state)
        for k, p in theirs.items():
            assert torch.equal(ours[k], p.detach()), f"step {t}: param {k}"
            m, mu, nu = _fused_state(fa, p)  # (an fp32 param's master there is not stepped)
            if ours[k].dtype != torch.float32:
                assert torch.equal(state.master[k], m), f"step {t}: master {k}"
            assert torch.equal(state.mu[k], mu) and torch.equal(state.nu[k], nu), f"step {t}: moments {k}"


def test_te_device_kernel_with_half_the_state_on_the_host():
    """``offload_fraction(0.5)``: the host leaves step as with torch's device kernel, bit for
    bit; the device leaves (fp16 and fp32 params, an EMA) within the rounding of the two
    kernels' arithmetic; the EMA follows the masters."""
    dtypes = {"w": torch.float16, "ln": torch.float32}
    runs = {}
    for kernel in ("te", "torch"):
        params = _kernel_params(dtypes)
        opt = fo.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD, ema_decay=0.9,
                       placement=fo.placement.offload_fraction(0.5), device_kernel=kernel,
                       executor=HostExecutor(chunk_bytes=256 << 10, threads=2))
        state = opt.init(params)
        for gs in _kernel_grads(params, 3):
            params, state = opt.update(gs, state)
        fo.flush(state)
        runs[kernel] = (params, state)
    (p_te, s_te), (p_torch, s_torch) = runs["te"], runs["torch"]
    host = [k for k in p_te if s_te.mu[k].device.type == "cpu"]
    assert host and len(host) < len(p_te)
    for k in p_te:
        a, b = s_te.master[k], s_torch.master[k]
        a = p_te[k] if a is None else a
        b = p_torch[k] if b is None else b
        if k in host:
            assert torch.equal(a, b) and torch.equal(p_te[k], p_torch[k]), k
            assert torch.equal(s_te.ema[k], s_torch.ema[k]), k
        else:
            _close(a, b, f"master {k}", MASTER_RTOL, MASTER_ATOL)
            _close(s_te.ema[k], s_torch.ema[k], f"ema {k}", MASTER_RTOL, MASTER_ATOL)
            _close(s_te.mu[k], s_torch.mu[k], f"mu {k}", MOMENT_RTOL,
                   MOMENT_ATOL * float(s_torch.mu[k].abs().max()))
            assert torch.equal(p_te[k], a.to(p_te[k].dtype)), f"param {k} is its master rounded"
