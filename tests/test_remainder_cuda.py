"""CUDA tests (marker ``cuda``) of the split master: GPU params whose state is on the host (the
new param copied up from the pinned high half), on the device (the device math on joined fp32
values) and split between them, bit for bit the fp32 master's trajectory."""

from __future__ import annotations

import pytest
import torch

import functional_offload as fo
from conftest import delay_of, step_by
from functional_offload.executor import HostExecutor
from functional_offload.kernels import remainder, remainder_cuda
from halves_cases import check as check_halves

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
SHAPES = {"w": (300, 700), "v": (90_001,), "b": (37,)}  # "b" is packed on the host: fp32 master


def _master(state, params, key: str) -> torch.Tensor:
    m = state.master[key]
    return (remainder.join(m, params[key]) if remainder.is_split(m) else m).cpu().view(torch.int32)


def _train(rem: bool, placement, mode: str, max_norm: float, steps: int = 8):
    torch.manual_seed(0)
    params = {k: torch.randn(s, device=DEV).bfloat16().requires_grad_() for k, s in SHAPES.items()}
    ex = HostExecutor(chunk_bytes=1 << 17, slots=3)  # many chunks: slots reused within a step
    opt = fo.chain(fo.clip_by_global_norm(max_norm),
                   fo.adamw(lr=1e-2, weight_decay=0.1, placement=placement, executor=ex,
                            delayed=delay_of(mode), store_param_remainders=rem, ema_decay=0.9))
    state = opt.init(params)
    g = torch.Generator(device=DEV).manual_seed(1)
    highs_match = True
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g, device=DEV).bfloat16() for k, v in params.items()}
        state = step_by(opt, state, params, grads, mode)
        m = state[-1].master["w"]
        if rem and mode not in ("delayed", "ahead") and not remainder.is_lean(m):
            highs_match &= torch.equal(params["w"].detach(), remainder.high(m).to(DEV))
    fo.flush(state)
    return params, state[-1], highs_match


PLACEMENTS = {"host": fo.placement.on_host, "device": fo.placement.on_device,
              "half": lambda: fo.placement.offload_fraction(0.5)}


@pytest.mark.parametrize("mode", ["plain", "stream", "delayed", "ahead"])
@pytest.mark.parametrize("max_norm", [1e9, 1e-2], ids=["clip-never", "clip-scales"])
@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_split_master_on_gpu_params_is_bit_identical(where, mode, max_norm):
    p32, s32, _ = _train(False, PLACEMENTS[where](), mode, max_norm)
    p16, s16, highs = _train(True, PLACEMENTS[where](), mode, max_norm)
    assert highs  # after every step the GPU param is the high half
    assert any(m is not None and remainder.is_split(m) for m in s16.master.values())
    for k in SHAPES:
        assert torch.equal(_master(s16, p16, k), _master(s32, p32, k)), k
        assert torch.equal(s16.mu[k].cpu(), s32.mu[k].cpu()) and torch.equal(s16.nu[k].cpu(), s32.nu[k].cpu())
        assert torch.equal(s16.ema[k].cpu(), s32.ema[k].cpu()), k
        tie = (_master(s32, p32, k) & 0xFFFF) == 0x8000
        differ = (p16[k].detach() != p32[k].detach()).cpu()
        assert not (differ & ~tie).any(), k


@pytest.mark.parametrize("mode", ["plain", "stream", "delayed", "ahead"])
@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_host_split_masters_of_gpu_params_keep_the_remainder_alone(where, mode):
    """A GPU bf16 param's split master keeps the remainder alone (2 bytes an element; on the
    host, pinned): its param is the high half. On the host a delayed update with a look-ahead
    keeps both halves (its landing reads the new values apart from the params); on the device
    every mode keeps the remainder alone."""
    _, state, _ = _train(True, PLACEMENTS[where](), mode, 1e9, steps=1)
    m = state.master["w"]
    assert remainder.is_split(m)
    if m.device.type == "cpu" and mode == "ahead":
        assert m.shape == (2, *SHAPES["w"]) and not remainder.is_lean(m)
    else:
        assert m.shape == (1, *SHAPES["w"]) and remainder.is_lean(m)
        assert m.is_pinned() or m.device.type == "cuda"
    b = state.master["b"]
    assert b.dtype == torch.float32 or b.device.type == "cuda"  # packed on the host: fp32


@pytest.mark.parametrize("engine", ["cpu", "gpu", "both"])
@pytest.mark.parametrize("into", ["lean", "device", "fp32"])
def test_a_remainder_only_master_checkpoints_its_fp32_value(engine, into, tmp_path):
    """Saved, a remainder-only master is its fp32 value (joined with its param's bits); loaded
    into a fresh state of fresh params, it writes their bits (the high half) with its remainder,
    and training goes on bit for bit as if never saved; loaded into the device's split master
    or an fp32 master, it is the same value."""
    def make(into_, seed):
        torch.manual_seed(seed)
        params = {k: torch.randn(s, device=DEV).bfloat16() for k, s in SHAPES.items()}
        chunks = {} if engine == "cpu" else {"engine_chunk_bytes": 1 << 21}
        ex = HostExecutor(chunk_bytes=1 << 17, slots=3, engine=engine, **chunks,
                          gpu_share=0.5 if engine == "both" else None)
        placement = fo.placement.on_device() if into_ == "device" else fo.placement.on_host()
        opt = fo.adamw(1e-2, weight_decay=0.1, placement=placement,
                       executor=ex if into_ != "device" else None,
                       store_param_remainders=into_ != "fp32")
        return params, opt, opt.init(params)

    g = torch.Generator(device=DEV).manual_seed(1)
    grads = [{k: torch.randn(s, generator=g, device=DEV).bfloat16() for k, s in SHAPES.items()}
             for _ in range(4)]
    params, opt, state = make("lean", 0)
    assert remainder.is_lean(state.master["w"])
    for gr in grads[:2]:
        params, state = opt.update(gr, state)
    fo.save(state, tmp_path / "s.fo")
    saved = fo.state_dict(state)
    p2, opt2, like = make(into, 7)  # other params: the load sets the lean one's high halves
    loaded = fo.load(tmp_path / "s.fo", like=like)
    back = fo.state_dict(loaded)
    for k in saved:
        assert torch.equal(back[k].cpu(), saved[k].cpu()), k
    if into == "lean":
        assert torch.equal(p2["w"], params["w"]) and torch.equal(p2["v"], params["v"])
        for gr in grads[2:]:
            params, state = opt.update(gr, state)
            p2, loaded = opt2.update(gr, loaded)
        for k in SHAPES:
            assert torch.equal(p2[k], params[k]), k
        after, want = fo.state_dict(loaded), fo.state_dict(state)
        assert all(torch.equal(after[k].cpu(), want[k].cpu()) for k in want)


@pytest.mark.parametrize("where", ["device", "engine"])
def test_a_nan_update_on_the_gpu_gives_a_nan_param(where):
    """A NaN grad makes a NaN update: CUDA's AdamW writes the canonical NaN ``0x7fffffff``, whose
    low half is negative; the split master keeps it a NaN param (not the ``-0.0`` that rounding
    it would carry into), on the device path and on the GPU engine, and the rest steps on."""
    torch.manual_seed(0)
    params = {"v": torch.randn(90_000, device=DEV).bfloat16()}  # cut into chunks
    placement = fo.placement.on_device() if where == "device" else fo.placement.on_host()
    ex = HostExecutor(engine="gpu", engine_chunk_bytes=1 << 17) if where == "engine" else None
    opt = fo.adamw(1e-2, placement=placement, executor=ex, store_param_remainders=True)
    state = opt.init(params)
    g = torch.ones(90_000, device=DEV).bfloat16()
    g[:3] = float("nan")
    params, state = opt.update({"v": g}, state)
    v = params["v"].detach().cpu()
    assert v[:3].isnan().all() and not v[3:].isnan().any()
    assert remainder.join(state.master["v"].cpu(), params["v"].cpu())[:3].isnan().all()


def test_a_gpu_param_zeroed_in_place_is_followed_by_its_remainder_only_master():
    """The param is the high half: zeroed in place between steps (pruning), its master is zero
    within its remainder, and the next step starts from there (not from a NaN)."""
    params, state, _ = _train(True, PLACEMENTS["host"](), "plain", 1e9, steps=2)
    assert remainder.is_lean(state.master["w"])
    with torch.no_grad():
        params["w"][:100].zero_()
    assert (remainder.join(state.master["w"], params["w"])[:100].abs() < 1e-38).all()
    opt = fo.adamw(lr=1e-3, placement=fo.placement.on_host(), store_param_remainders=True)
    state = opt.init(params)
    with torch.no_grad():
        params["w"][:100].zero_()
    params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state)
    assert torch.isfinite(params["w"]).all() and (params["w"][:100].float().abs() <= 2e-3).all()


def test_a_remainder_only_master_whose_param_changed_is_refused_by_save_and_load(tmp_path):
    """Saving or loading needs the param as the high half: a param cast since is refused,
    naming the leaf, before anything is copied (the state stays usable)."""
    params = {"w": torch.randn(300, 700, device=DEV).bfloat16()}
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), store_param_remainders=True)
    state = opt.init(params)
    params, state = opt.update({"w": torch.ones_like(params["w"])}, state)
    fo.save(state, tmp_path / "s.fo")
    w = params["w"]
    w.data = w.data.float()
    with pytest.raises(fo.CheckpointError, match="'w'.*remainder alone"):
        fo.save(state, tmp_path / "t.fo")
    with pytest.raises(fo.CheckpointError, match="'w'.*remainder alone"):
        fo.load(tmp_path / "s.fo", like=state)
    w.data = w.data.bfloat16()
    params, state = opt.update({"w": torch.ones_like(params["w"])}, state)  # still usable


def test_a_scalar_bf16_param_on_the_device_steps_with_a_split_master():
    """A 0-dim bf16 GPU param (a learnable scale) with its state on the device: its split
    master is its remainder alone and steps as the fp32 master does."""
    outs = []
    for rem in (False, True):
        torch.manual_seed(0)
        params = {"s": torch.tensor(0.75, device=DEV).bfloat16(),
                  "w": torch.randn(300, 700, device=DEV).bfloat16()}
        opt = fo.adamw(1e-2, placement=fo.placement.on_device(), store_param_remainders=rem)
        state = opt.init(params)
        for _ in range(3):
            params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state)
        outs.append((params, state))
    (p32, s32), (p16, s16) = outs
    assert remainder.is_lean(s16.master["s"]) and s16.master["s"].shape == (1,)
    for k in ("s", "w"):
        assert torch.equal(_master(s16, p16, k), _master(s32, p32, k)), k


@pytest.mark.parametrize("rem, moments", [(True, torch.uint8), (True, torch.float32),
                                          (False, torch.uint8)], ids=["r8", "r32", "8bit"])
def test_decoded_device_math_casts_the_grads_batch_by_batch(rem, moments):
    """The device math on stored formats (split masters, 8-bit moments) takes fp32 copies of a
    batch of leaves at a time, the bf16 grads' included: the step's memory above the state is
    bounded by the batch, not by an fp32 copy of all the grads."""
    from functional_offload.optimizers.spec import BATCH
    n = BATCH  # 8 leaves of a batch each: 4 B a grad element would be 8 batches' worth
    params = {f"w{i}": torch.zeros(n, device=DEV, dtype=torch.bfloat16) for i in range(8)}
    formats = {} if moments == torch.float32 else {"mu_dtype": moments, "nu_dtype": moments}
    opt = fo.adamw(1e-3, placement=fo.placement.on_device(), store_param_remainders=rem, **formats)
    state = opt.init(params)
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    params, state = opt.update(grads, state)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    assert grown < 4 * 8 * n, (grown, 4 * 8 * n)  # less than one fp32 copy of the grads
    assert all(torch.all(p == p.flatten()[0]) and p.flatten()[0] < 0 for p in params.values())


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("moments", [torch.float32, torch.uint8], ids=["fp32", "8bit"])
def test_a_gpu_param_reshaped_in_place_is_followed_by_its_split_master(where, moments, tmp_path):
    """``param.data = param.data.view(...)`` between steps (the elements and their order kept):
    the split master (remainder-only on the device) steps on as the fp32 master does, nothing
    marked failed, and the state saves and loads."""
    outs = []
    formats = {} if moments == torch.float32 else {"mu_dtype": moments, "nu_dtype": moments}
    for rem in (False, True):
        torch.manual_seed(0)
        params = {"w": torch.randn(48, 64, device=DEV).bfloat16()}
        opt = fo.adamw(1e-2, placement=PLACEMENTS[where](), store_param_remainders=rem, **formats)
        state = opt.init(params)
        for shape in ((48, 64), (64, 48), (64, 48), (3072,)):
            params["w"].data = params["w"].data.view(shape)
            params, state = opt.update({"w": torch.full(shape, 0.5, device=DEV).bfloat16()}, state)
        outs.append((params, state))
    (p32, s32), (p16, s16) = outs
    assert remainder.is_lean(s16.master["w"]) == (where == "device")  # host: both halves kept
    assert torch.equal(p16["w"], p32["w"]) and p16["w"].shape == (3072,)
    assert torch.equal(_master(s16, p16, "w"), _master(s32, p32, "w"))
    fo.save(s16, tmp_path / "s.fo")
    loaded = fo.load(tmp_path / "s.fo", like=s16)
    assert torch.equal(_master(loaded, p16, "w"), _master(s32, p32, "w"))


def test_the_gpu_kernels_join_and_split_as_the_torch_ops():
    """On a CUDA device the split master's halves are joined and split by the one-pass Triton
    kernels (where Triton imports), with the torch ops' bits."""
    pytest.importorskip("triton")
    assert remainder_cuda.available(torch.zeros(1, device=DEV))
    check_halves("cuda")
    hi = torch.tensor([0x3F80, 0x4000, -0x4080, 0x1234], dtype=torch.int16, device=DEV)
    buf = torch.zeros(8, dtype=torch.bfloat16, device=DEV)
    for out in (buf[:4], torch.zeros(4, dtype=torch.float64, device=DEV),
                torch.zeros(6, device=DEV)):  # not the halves' fp32 values: refused, as the
        with pytest.raises(RuntimeError):    # torch ops refuse them, nothing written
            remainder.join_halves(hi, hi.clone(), out)
    assert not buf.any()


def _one_pass_against_the_fp32_master(engine: str, opt, wd: float, monkeypatch) -> list:
    """A split master with 8-bit moments and an fp32 master with the same 8-bit moments, each
    stepped 6 times on the GPU (device resident, or the GPU engine's host state): their masters
    and moments the same bits, their params too but at the master's ties. Returns the one-pass
    kernel's calls."""
    from functional_offload.kernels import adam_cuda
    calls = []
    one_pass = adam_cuda.adamw_split_q8
    monkeypatch.setattr(adam_cuda, "adamw_split_q8",
                        lambda *a, **k: calls.append(1) or one_pass(*a, **k))
    outs = []
    for rem in (False, True):
        torch.manual_seed(0)
        params = {"w": torch.randn(300, 700, device=DEV).bfloat16(),
                  "v": (torch.randn(90_001, device=DEV) * 1e3).bfloat16()}
        where = (fo.placement.on_device() if engine == "device" else fo.placement.on_host())
        ex = HostExecutor(engine="gpu") if engine == "gpu-engine" else None
        o = opt(1e-2, weight_decay=wd, placement=where, executor=ex, store_param_remainders=rem,
                mu_dtype=torch.uint8, nu_dtype=torch.uint8)
        state = o.init(params)
        g = torch.Generator(device=DEV).manual_seed(1)
        for _ in range(6):
            grads = {k: torch.randn(v.shape, generator=g, device=DEV).bfloat16()
                     for k, v in params.items()}
            params, state = o.update(grads, state)
        fo.flush(state)
        outs.append((params, state))
    (p32, s32), (p16, s16) = outs
    for k in ("w", "v"):
        assert torch.equal(_master(s16, p16, k), _master(s32, p32, k)), k
        assert torch.equal(s16.mu[k].cpu(), s32.mu[k].cpu()), k
        assert torch.equal(s16.nu[k].cpu(), s32.nu[k].cpu()), k
        tie = (_master(s32, p32, k) & 0xFFFF) == 0x8000  # the split's param rounds ties otherwise
        assert not ((p16[k] != p32[k]).cpu() & ~tie).any(), k
    return calls


@pytest.mark.parametrize("engine", ["device", "gpu-engine"])
@pytest.mark.parametrize("opt, wd", [(fo.adamw, 0.1), (fo.adamw, 0.0), (fo.adam, 0.0)],
                         ids=["adamw", "adamw-no-decay", "adam"])
def test_adamw_in_one_pass_on_stored_formats_steps_as_the_fp32_master(engine, opt, wd, monkeypatch):
    """The one-pass kernel (which this torch's fused AdamW agrees with) steps a split master
    with 8-bit moments bit for bit as torch's fused AdamW steps the fp32 master between the
    formats' decoding and encoding."""
    pytest.importorskip("triton")
    from functional_offload.kernels import adam_cuda
    assert adam_cuda.agrees(DEV), "this torch's fused AdamW rounds otherwise than the kernel"
    assert _one_pass_against_the_fp32_master(engine, opt, wd, monkeypatch)


@pytest.mark.parametrize("engine", ["device", "gpu-engine"])
def test_where_torch_rounds_otherwise_the_six_passes_step_the_stored_formats(engine, monkeypatch):
    """Where the probe finds torch's fused AdamW rounding otherwise than the one-pass kernel,
    the kernel is not used and the stored formats still step as the fp32 master."""
    from functional_offload.kernels import adam_cuda
    monkeypatch.setattr(adam_cuda, "agrees", lambda device: False)
    assert not _one_pass_against_the_fp32_master(engine, fo.adamw, 0.1, monkeypatch)


@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_adafactors_split_master_on_gpu_params_is_bit_identical(where):
    """Adafactor (not element-wise: each host leaf joined, stepped and split whole; the device
    math on the joined values) with split masters on GPU params, clipped (scaling), with an
    EMA: the fp32 master's masters, factors and EMA bit for bit; the params differ only at
    halfway masters. Host state keeps both halves, device state the remainder alone."""
    def train(rem: bool):
        torch.manual_seed(0)
        params = {k: torch.randn(s, device=DEV).bfloat16() for k, s in SHAPES.items()}
        opt = fo.chain(fo.clip_by_global_norm(1e-2), fo.adafactor(
            1e-2, weight_decay=0.1, placement=PLACEMENTS[where](), ema_decay=0.9,
            store_param_remainders=rem))
        state = opt.init(params)
        g = torch.Generator(device=DEV).manual_seed(1)
        for _ in range(6):
            grads = {k: torch.randn(v.shape, generator=g, device=DEV).bfloat16()
                     for k, v in params.items()}
            params, state = opt.update(grads, state)
        return params, state[-1]

    p32, s32 = train(False)
    p16, s16 = train(True)
    for k in SHAPES:
        m = s16.master[k]
        if k != "b" or m.device.type == "cuda":  # the small host leaf keeps an fp32 master
            assert remainder.is_split(m) and remainder.is_lean(m) == (m.device.type == "cuda"), k
        assert torch.equal(_master(s16, p16, k), _master(s32, p32, k)), k
        for field in ("row_var", "col_var", "variance", "ema"):
            a, b = getattr(s32, field)[k], getattr(s16, field)[k]
            assert (a is None) == (b is None) and (a is None or torch.equal(a.cpu(), b.cpu())), (k, field)
        tie = (_master(s32, p32, k) & 0xFFFF) == 0x8000
        differ = (p16[k] != p32[k]).cpu()
        assert not (differ & ~tie).any(), k
