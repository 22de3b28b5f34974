"""CUDA tests (marker ``cuda``) of the split master: GPU params whose state is on the host (the
new param copied up from the pinned high half), on the device (the device math on joined fp32
values) and split between them, bit for bit the fp32 master's trajectory."""

from __future__ import annotations

import pytest
import torch

import functional_offload as fo
from conftest import delay_of, step_by
from functional_offload.executor import HostExecutor
from functional_offload.kernels import remainder

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
SHAPES = {"w": (300, 700), "v": (90_001,), "b": (37,)}  # "b" is packed on the host: fp32 master


def _master(state, key: str) -> torch.Tensor:
    m = state.master[key]
    return (remainder.join(m) if remainder.is_split(m) else m).cpu().view(torch.int32)


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
        if rem and mode not in ("delayed", "ahead"):
            m = state[-1].master["w"]
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
        assert torch.equal(_master(s16, k), _master(s32, k)), k
        assert torch.equal(s16.mu[k].cpu(), s32.mu[k].cpu()) and torch.equal(s16.nu[k].cpu(), s32.nu[k].cpu())
        assert torch.equal(s16.ema[k].cpu(), s32.ema[k].cpu()), k
        tie = (_master(s32, k) & 0xFFFF) == 0x8000
        differ = (p16[k].detach() != p32[k].detach()).cpu()
        assert not (differ & ~tie).any(), k


def test_host_split_masters_are_pinned_and_copied_up_from_there():
    params = {"w": torch.randn(100_000, device=DEV).bfloat16()}
    state = fo.adamw(store_param_remainders=True).init(params)
    assert remainder.is_split(state.master["w"]) and state.master["w"].is_pinned()


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
    assert remainder.join(state.master["v"].cpu())[:3].isnan().all()
