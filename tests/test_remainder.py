"""The split master (``store_param_remainders=True``): its bit format, exactness against the fp32
master for every registry optimizer that offers it, in every host form, checkpoints across the
two formats, and the errors for what it does not support."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import functional_offload as fo
from conftest import delay_of, step_by
from functional_offload.kernels import native, remainder
from functional_offload.testing import fail_host_kernel
from registry import OPTIMIZERS

ENTRIES = [e for e in OPTIMIZERS if e.remainders]
ONE_PER_FORM = [e for e in ENTRIES if e.name in ("adamw", "adafactor")]  # element-wise, leaf-granular
KERNELS = ["torch"] + (["native"] if native.module() is not None else [])
N = 70_001  # above the packed size: the leaf gets a split master on the host


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _master(state, key: str) -> torch.Tensor:
    m = state.master[key]
    return remainder.join(m) if remainder.is_split(m) else m


def test_a_base_and_its_residual_join_within_a_256th_of_a_bf16_step():
    """The look-ahead's bf16 base and one-byte residual (``split_base``) join back to its fp32
    value but for its low byte (toward zero), infinities and NaNs kept."""
    torch.manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), dtype=torch.int32)
    bits[:8] = torch.tensor([0, -2**31, 0x7F800000, -0x00800000, 0x7FC00000, 0x3F808000, 0x3F80FFFF, 1])
    values = bits.view(torch.float32)
    hi, res = torch.empty(values.shape, dtype=torch.bfloat16), torch.empty(values.shape, dtype=torch.int8)
    remainder.split_base(values, hi, res)
    assert torch.equal(hi.view(torch.int16).int() & 0xFFFF, (bits >> 16) & 0xFFFF)
    assert torch.equal(res.int() & 0xFF, (bits >> 8) & 0xFF)
    joined = remainder.join_base(hi, res)
    assert torch.equal(_bits(joined), bits & ~0xFF)  # the low byte dropped: toward zero
    assert torch.isinf(joined[2:4]).all() and torch.isnan(joined[4])
    finite = torch.isfinite(values)
    ulp = (values[finite].abs().to(torch.bfloat16).float() * 2.0 ** -7).clamp_min(2.0 ** -133)
    assert ((joined[finite] - values[finite]).abs() <= ulp * 2.0 ** -8).all()


def test_split_holds_every_fp32_bit_pattern():
    """Every value but a NaN comes back bit for bit; a NaN (whatever its payload: the GPU's
    canonical ``0x7fffffff`` included) as a quiet NaN of its sign, with a NaN high half."""
    torch.manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), dtype=torch.int32)
    bits[:9] = torch.tensor([0, -2**31, 0x7F800000, 0x7FC00000, 0x3F808000, 0x3F818000,
                             0x7FFFFFFF, -1, 0x7F80FFFF])
    values = bits.view(torch.float32)
    m = remainder.split_(torch.empty((2, values.numel()), dtype=torch.int16), values)
    joined, nan = remainder.join(m), values.isnan()
    assert torch.equal(_bits(joined)[~nan], bits[~nan])
    assert joined[nan].isnan().all() and torch.equal(joined[nan].signbit(), values[nan].signbit())
    assert (m[1][nan] == 0).all() and int(nan.sum()) > 1000
    hi = remainder.high(m).float()
    assert torch.equal(hi.isnan(), nan)  # a NaN master's param is a NaN, and only then
    finite = torch.isfinite(values) & torch.isfinite(values.to(torch.bfloat16).float())
    tie = (bits & 0xFFFF) == 0x8000
    # to nearest, as the fp32 format's cast, except at exact ties: away from zero
    assert torch.equal(hi[finite & ~tie], values.to(torch.bfloat16).float()[finite & ~tie])
    up = values[finite & tie].abs() < hi[finite & tie].abs()
    assert up.all() and int((finite & tie).sum()) >= 2
    assert hi[2] == float("inf")


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_nan_master_keeps_a_nan_param_whatever_its_payload(kernel):
    """A step whose update is a NaN of a payload with bit 15 set (from a NaN ``nu`` of bits
    ``0x7fffffff``, the GPU's canonical NaN, loaded from a checkpoint) leaves a NaN param, not
    the ``-0.0`` the rounded high half would carry into; the other elements step on."""
    torch.manual_seed(0)
    params = {"w": torch.randn(N).bfloat16()}
    opt = fo.adamw(1e-2, store_param_remainders=True, cpu_kernel=kernel)
    state = opt.init(params)
    sd = fo.state_dict(state)
    bad = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
    sd["nu.w"][:2] = bad
    state = fo.load_state_dict(sd, state)
    params, state = opt.update({"w": torch.ones(N).bfloat16()}, state)
    w = params["w"].detach()
    assert w[:2].isnan().all() and not w[2:].isnan().any()
    assert remainder.join(state.master["w"])[:2].isnan().all()
    assert torch.equal(w.view(torch.int16), state.master["w"][0])  # the param is the high half


def _train(entry, rem: bool, kernel: str, mode: str, max_norm: float, steps: int = 6):
    """``steps`` updates of bf16 params by fixed grads (independent of the params), in ``mode``:
    "plain" (update), "stream" (fo.stream around a backward giving those grads), "delayed",
    "ahead" (delayed with the look-ahead)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(N).bfloat16().requires_grad_(),
              "m": torch.randn(300, 240).bfloat16().requires_grad_(),  # Adafactor: factored
              "b": torch.randn(5, 7).bfloat16().requires_grad_()}  # small: packed, fp32 master
    opt = fo.chain(fo.clip_by_global_norm(max_norm),
                   entry.make(**entry.hypers, cpu_kernel=kernel, delayed=delay_of(mode),
                              store_param_remainders=rem))
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in params.items()}
        state = step_by(opt, state, params, grads, mode)
    fo.flush(state)
    return params, state[-1]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["plain", "stream", "delayed", "ahead"])
@pytest.mark.parametrize("max_norm", [1e9, 1e-2], ids=["clip-never", "clip-scales"])
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_split_master_is_bit_identical_to_the_fp32_master(entry, kernel, mode, max_norm):
    if mode in ("delayed", "ahead") and not entry.delayed:
        pytest.skip("no delayed mode")
    if kernel == "native" and not entry.native:
        pytest.skip("no native op")
    p32, s32 = _train(entry, False, kernel, mode, max_norm)
    p16, s16 = _train(entry, True, kernel, mode, max_norm)
    assert remainder.is_split(s16.master["w"]) and remainder.is_split(s16.master["m"])
    for k in p32:
        assert torch.equal(_bits(_master(s16, k)), _bits(_master(s32, k))), k
        for field in ("mu", "nu", "momentum", "row_var", "col_var", "variance"):
            a, b = getattr(s32, field, ()), getattr(s16, field, ())
            if a != () and a[k] is not None:
                assert torch.equal(a[k], b[k]), (k, field)
    for k in ("w", "m"):
        assert torch.equal(p16[k].detach(), remainder.high(s16.master[k]))  # the high half
        tie = (_bits(_master(s32, k)) & 0xFFFF) == 0x8000
        differ = p16[k].detach() != p32[k].detach()
        assert not (differ & ~tie).any(), k  # the params differ only where the master is halfway
    assert not remainder.is_split(s16.master["b"])  # small: an fp32 master in every mode
    assert torch.equal(p16["b"].detach(), p32["b"].detach())


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_split_master_holds_the_fp32_masters_bits_over_many_steps(entry):
    """60 steps, the clip scaling every step: the masters stay the fp32 master's bits (a split
    that lost a bit would show as a drift growing with the steps)."""
    kernel = KERNELS[-1] if entry.native else "torch"
    p32, s32 = _train(entry, False, kernel, "plain", 1e-2, steps=60)
    p16, s16 = _train(entry, True, kernel, "plain", 1e-2, steps=60)
    for k in p32:
        assert torch.equal(_bits(_master(s16, k)), _bits(_master(s32, k))), k


@pytest.mark.parametrize("entry", ONE_PER_FORM, ids=lambda e: e.name)
def test_a_checkpoint_of_either_master_format_loads_into_the_other(entry, tmp_path):
    params, state = _train(entry, True, KERNELS[-1] if entry.native else "torch", "plain", 1e9)
    path = os.fspath(tmp_path / "opt.safetensors")
    fo.save(state, path)
    assert fo.state_dict(state)["master.w"].dtype == torch.float32
    for rem in (False, True):
        like = entry.make(**entry.hypers, store_param_remainders=rem).init(params)
        loaded = fo.load(path, like)
        assert remainder.is_split(loaded.master["w"]) == rem
        assert torch.equal(_bits(_master(loaded, "w")), _bits(_master(state, "w")))
        back = entry.make(**entry.hypers, store_param_remainders=not rem).init(params)
        again = fo.load_state_dict(fo.state_dict(loaded), back)
        assert torch.equal(_bits(_master(again, "w")), _bits(_master(state, "w")))


@pytest.mark.parametrize("entry", ONE_PER_FORM, ids=lambda e: e.name)
def test_a_failed_step_of_split_masters_recovers_from_the_checkpoint(entry, tmp_path):
    torch.manual_seed(0)
    params = {"w": torch.randn(N).bfloat16(), "m": torch.randn(300, 240).bfloat16()}
    opt = entry.make(**entry.hypers, store_param_remainders=True,
                     executor=fo.executor.HostExecutor(chunk_bytes=1 << 16))
    grads = {k: torch.randn(v.shape).bfloat16() for k, v in params.items()}
    params, state = opt.update(grads, opt.init(params))
    path = os.fspath(tmp_path / "opt.safetensors")
    fo.save(state, path)
    saved = {k: v.clone() for k, v in params.items()}
    with fail_host_kernel(after=1), pytest.raises(fo.HostStepError):
        opt.update(grads, state)
    assert any(not torch.equal(params[k], saved[k]) for k in params)  # half stepped in place
    with pytest.raises(fo.StateError):
        fo.save(state, path)
    state = fo.load(path, like=state)
    for k in params:  # set from the loaded master's high half
        assert torch.equal(params[k], saved[k]), k
        assert torch.equal(params[k], remainder.high(state.master[k])), k


def test_bad_options_name_what_to_fix():
    with pytest.raises(TypeError, match="store_param_remainders must be True or False"):
        fo.adamw(store_param_remainders=1)
    with pytest.raises(ValueError, match="master_dtype=torch.float32"):
        fo.adamw(store_param_remainders=True, master_dtype=torch.float64)
    with pytest.raises(ValueError, match="store_param_remainders"):
        fo.TorchOptimizer([torch.nn.Parameter(torch.zeros(3))], fo.adamw, store_param_remainders=True)


def test_a_param_whose_dtype_changed_is_refused_naming_it():
    params = {"w": torch.nn.Parameter(torch.randn(N).bfloat16())}
    opt = fo.adamw(store_param_remainders=True)
    state = opt.init(params)
    _, state = opt.update({"w": torch.ones(N).bfloat16()}, state)
    params["w"].data = params["w"].data.float()  # module.float()
    with pytest.raises(TypeError, match="'w'.*split master"):
        opt.update({"w": torch.ones(N)}, state)


def test_a_remainder_only_master_is_its_param_and_its_remainder():
    """A remainder-only split master (``(1, *shape)``) holds the low 16 bits; its param holds
    the high half: joined with the param it is the fp32 value, and writing a value into it
    writes the param's bits too, as the two-row master holds them."""
    g = torch.Generator().manual_seed(0)
    value = torch.randn(3, 500, generator=g) * torch.logspace(-30, 30, 500)
    value[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0])
    full = remainder.split_(torch.empty((2, 3, 500), dtype=torch.int16), value)
    param = torch.zeros(3, 500, dtype=torch.bfloat16)
    lean = remainder.split_(torch.empty((1, 3, 500), dtype=torch.int16), value, param)
    assert remainder.is_lean(lean) and not remainder.is_lean(full)
    assert torch.equal(param.view(torch.int16), full[0]) and torch.equal(lean[0], full[1])
    assert torch.equal(remainder.join(lean, param).view(torch.int32),
                       remainder.join(full).view(torch.int32))
    hi, lo = remainder.flat_halves(lean, param)
    assert hi.data_ptr() == param.data_ptr() and lo.data_ptr() == lean.data_ptr()
    fresh = remainder.new_split(param, torch.full((1, 3, 500), 7, dtype=torch.int16))
    assert not fresh.any()  # the master equals the param: remainder zero
    with pytest.raises(ValueError, match="needs its contiguous bf16 param"):
        remainder.join(lean)
    with pytest.raises(ValueError, match="needs its contiguous bf16 param"):
        remainder.join(lean, param.float())
    with pytest.raises(ValueError, match="needs its contiguous bf16 param"):
        remainder.join(lean, param[:, :400])
    with pytest.raises(ValueError, match="needs its contiguous bf16 param"):
        remainder.join(lean, torch.zeros(500, 3, dtype=torch.bfloat16).t())


def test_a_remainder_only_master_follows_its_param_reshaped():
    """A param reshaped in place (its elements and their order kept, as ``param.data =
    param.data.view(...)``) still is the high half of its remainder-only master, element for
    element: joined and split in the master's shape."""
    value = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    full = remainder.split_(torch.empty((2, 6, 8), dtype=torch.int16), value)
    param = torch.zeros(6, 8, dtype=torch.bfloat16)
    lean = remainder.split_(torch.empty((1, 6, 8), dtype=torch.int16), value, param)
    turned = param.view(8, 6)
    assert torch.equal(_bits(remainder.join(lean, turned)), _bits(value))
    remainder.split_(lean, value * 3, turned)
    remainder.split_(full, value * 3)
    assert torch.equal(turned.view(torch.int16).view(6, 8), full[0])
    assert torch.equal(_bits(remainder.join(lean, turned)), _bits(value * 3))
    with pytest.raises(ValueError, match="holds no high half"):
        remainder.high(lean)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("cases, ok", [("halves_cases.py", "halves ok"),
                                       ("quantize_cases.py", "quantize ok"),
                                       ("adam_stored_cases.py", "adam stored ok")],
                         ids=["halves", "8bit-moments", "adamw-one-pass"])
def test_the_triton_kernels_give_the_torch_ops_bits_in_triton_s_interpreter(cases, ok):
    """The one-pass GPU kernels of the state formats (the split master's halves joined and
    split; 8-bit moments quantized and dequantized; AdamW on a split master with 8-bit
    moments), run by Triton's interpreter on the CPU (a fresh process: the interpreter is
    chosen when the kernels are defined)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(here, cases)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and ok in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("bad", ["hi", "lo", "mu", "nu", "grad"])
def test_the_one_pass_adamw_refuses_tensors_of_other_sizes(bad):
    """Halves, moments or a grad of another element count than the grad's are refused, naming
    the sizes, before anything is written (the kernel would read and write past them)."""
    from functional_offload.kernels import adam_cuda, blockwise
    n = 1000
    t = {"hi": torch.zeros(n, dtype=torch.int16), "lo": torch.zeros(n, dtype=torch.int16),
         "grad": torch.ones(n), "mu": blockwise.quantize(torch.ones(n), True),
         "nu": blockwise.quantize(torch.ones(n), False)}
    t[bad] = torch.cat([t[bad], t[bad][:260]])  # one more block's bytes, or 260 more elements
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(ValueError, match=r"adamw_split_q8: a grad of \d+ elements needs halves"):
        adam_cuda.adamw_split_q8(t["hi"], t["lo"], t["grad"], t["mu"], t["nu"], 1e-3, 0.9, 0.999,
                                 1e-8, 0.1, 1)
    assert all(torch.equal(t[k], before[k]) for k in t)


def test_a_scalar_master_splits_and_joins():
    """A 0-dim param's split master (both forms) holds its fp32 value exactly."""
    for value in (torch.tensor(1.2345678), torch.tensor(-3.5e-3), torch.tensor(float("inf"))):
        full = remainder.split_(torch.empty((2,), dtype=torch.int16), value)
        assert torch.equal(_bits(remainder.join(full)), _bits(value))
        param = torch.tensor(0.5).bfloat16()
        lean = remainder.split_(torch.empty((1,), dtype=torch.int16), value, param)
        assert torch.equal(_bits(remainder.join(lean, param)), _bits(value))
        assert torch.equal(param.view(torch.int16), full[0])


def test_cpu_params_keep_both_halves_on_the_host():
    """Only a GPU param's bits can stand for the host master's high half (a CPU param's host
    step writes the param where the run's forms expect it unchanged): CPU params keep both."""
    params = {"w": torch.randn(300, 700).bfloat16()}
    for mode in ("plain", "delayed"):
        state = fo.adamw(store_param_remainders=True, delayed=delay_of(mode)).init(params)
        assert state.master["w"].shape == (2, 300, 700), mode


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_high_half_set_to_zero_in_place_joins_to_about_zero_not_a_nan(kernel):
    """No split gives a high half of +-0 with a negative remainder; a param zeroed in place
    (pruning) over a remainder-only master's remainder does: the master joins to within the
    remainder of zero, not to the NaN that borrowing from the high half would wrap to, in the
    torch ops and the native kernel, and steps on."""
    lo = torch.tensor([-5, -1, 7, -32768], dtype=torch.int16)
    for zero in (0, -32768):  # +0, -0
        hi = torch.full((4,), zero, dtype=torch.int16)
        v = remainder.join_halves(hi, lo)
        assert torch.isfinite(v).all() and (v.abs() < 1e-38).all(), (zero, v)
    params = {"w": torch.randn(100_000).bfloat16()}  # (a small leaf keeps an fp32 master)
    opt = fo.adamw(1e-3, weight_decay=0.1, store_param_remainders=True, cpu_kernel=kernel)
    state = opt.init(params)
    state.master["w"][0, :64] = 0  # as a lean master's param zeroed, its remainder kept
    state.master["w"][1, :64] = -3
    params, state = opt.update({"w": torch.ones(100_000).bfloat16()}, state)
    assert torch.isfinite(params["w"]).all() and torch.isfinite(remainder.join(state.master["w"])).all()
    assert (params["w"][:64].float().abs() <= 2e-3).all()


def test_plan_counts_the_remainder_alone_for_gpu_params_and_both_halves_for_cpu_params():
    """``fo.plan``'s host bytes: the split master of a GPU param (a plan's meta param stands for
    one) keeps the remainder alone, 2 bytes an element; with 8-bit moments 4.03 in all."""
    def host(device, **kw):
        params = {"w": torch.zeros(1024, 1024, dtype=torch.bfloat16, device=device)}
        opt = fo.adamw(1e-3, placement=fo.placement.on_host(), store_param_remainders=True, **kw)
        plan = fo.plan(opt, params)
        assert plan.host_bytes_per_param == plan.host_bytes / (1 << 20)
        assert f"({plan.host_bytes_per_param:.2f} per element there)" in plan.summary()
        return plan.host_bytes_per_param
    assert host("meta") == 10 and host("cpu") == 12
    assert host("meta", mu_dtype=torch.uint8, nu_dtype=torch.uint8) == pytest.approx(4.03, abs=0.01)


def test_plan_counts_the_remainder_alone_for_a_gpu_params_state_on_the_device():
    """Kept on the device, a GPU bf16 param's split master is its remainder alone too (2 bytes
    an element where both halves took as many as an fp32 master's 4): ``fo.plan``'s device
    bytes (a meta param stands for a GPU one)."""
    params = {"w": torch.zeros(1024, 1024, dtype=torch.bfloat16, device="meta")}
    for rem, moments, per in [(True, {}, 10), (False, {}, 12),
                              (True, dict(mu_dtype=torch.uint8, nu_dtype=torch.uint8), 4.03)]:
        opt = fo.adamw(1e-3, placement=fo.placement.on_device(), store_param_remainders=rem,
                       **moments)
        plan = fo.plan(opt, params)
        assert plan.host_bytes == 0
        assert plan.device_bytes / (1 << 20) == pytest.approx(per, abs=0.01), (rem, moments)
