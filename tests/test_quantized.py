"""Quantized params (TransformerEngine's fp8 weights, here a stand-in with the same two methods):
an fp32 master always, stepped exactly as a bf16 param's master is; the param written whole, once
per step, through its quantizer; checkpoints; the errors for the modes that cannot write them.
The same against TransformerEngine itself on the GPU: ``test_te_cuda.py``."""

from __future__ import annotations

import pytest
import torch

import functional_offload as fo
from conftest import KERNELS, step_by
from functional_offload.testing import fail_host_kernel
from registry import OPTIMIZERS

ENTRIES = [e for e in OPTIMIZERS if e.name in ("adamw", "adam", "sgd-nesterov", "lion")]
N = 70_001  # above the packed size


def fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` on an e4m3 grid of one power-of-two scale from its amax (current scaling), as bf16
    (which holds every such value exactly)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    scale = 2.0 ** int(torch.floor(torch.log2(torch.tensor(448.0 / amax)))) if amax > 0 else 1.0
    return ((x.detach().float() * scale).to(torch.float8_e4m3fn).float() / scale).bfloat16()


class Fp8Param(torch.Tensor):
    """TransformerEngine's ``Float8Tensor`` as the library sees it: a bf16-typed param whose values
    are fp8 codes times a scale, written only through ``quantize_`` (which counts its calls) and
    read through ``dequantize``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, values: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> "Fp8Param":
        t = fp8(values).to(dtype).as_subclass(cls).requires_grad_(values.requires_grad)
        t.writes = 0
        return t

    fail = False  # set on the class: every quantize_ raises

    def quantize_(self, src: torch.Tensor) -> "Fp8Param":
        if Fp8Param.fail:
            raise RuntimeError("injected failure of quantize_")
        with torch.no_grad():
            torch.Tensor.copy_(self, fp8(src).to(self.dtype))
        self.writes += 1
        return self

    def dequantize(self, *, dtype=None) -> torch.Tensor:
        self.reads = getattr(self, "reads", 0) + 1
        return self.as_subclass(torch.Tensor).to(dtype or self.dtype, copy=True)

    def get_data_tensors(self) -> tuple:
        return (self.as_subclass(torch.Tensor),)


def _params(quantized: bool) -> dict:
    torch.manual_seed(0)
    values = {"w": torch.randn(N), "b": torch.randn(5, 7)}
    make = (lambda v: Fp8Param(v).requires_grad_()) if quantized else (
        lambda v: fp8(v).requires_grad_())
    return {k: make(v) for k, v in values.items()}


def _train(entry, quantized: bool, kernel: str, mode: str, max_norm: float, steps: int = 4):
    params = _params(quantized)
    opt = fo.chain(fo.clip_by_global_norm(max_norm), entry.make(**entry.hypers, cpu_kernel=kernel))
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in params.items()}
        state = step_by(opt, state, params, grads, mode)
    return params, state[-1]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["plain", "stream"])
@pytest.mark.parametrize("max_norm", [1e9, 1e-2], ids=["clip-never", "clip-scales"])
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_quantized_param_steps_its_master_as_a_bf16_param_and_is_written_whole(
        entry, kernel, mode, max_norm):
    """Same grads, same start: the fp32 masters and moments of quantized params are bit-identical
    to those of bf16 params; each quantized param is its bf16 twin quantized, written once per
    step (never piece by piece)."""
    pq, sq = _train(entry, True, kernel, mode, max_norm)
    pb, sb = _train(entry, False, kernel, mode, max_norm)
    for k in pq:
        assert sq.master[k].dtype == torch.float32
        assert torch.equal(sq.master[k], sb.master[k]), k
        for field in ("mu", "nu", "momentum"):
            if hasattr(sq, field) and not isinstance(getattr(sq, field), tuple):
                assert torch.equal(getattr(sq, field)[k], getattr(sb, field)[k]), (k, field)
        assert torch.equal(pq[k].dequantize(), fp8(pb[k])), k
        assert pq[k].writes == 4, k
        assert type(pq[k]) is Fp8Param


def test_quantized_fp32_param_gets_a_master_too():
    """A quantized param of nominal dtype fp32 is no fp32 param: updates below its fp8 step would
    vanish without a master, so it gets one, and small steps add up in it."""
    torch.manual_seed(0)
    x = torch.randn(1000)
    p = Fp8Param(x, torch.float32)
    opt = fo.sgd(lr=1e-4)
    state = opt.init({"w": p})
    start = p.dequantize(dtype=torch.float32)
    for _ in range(50):
        _, state = opt.update({"w": torch.ones(1000)}, state)
    assert state.master["w"].dtype == torch.float32
    torch.testing.assert_close(state.master["w"], start - 50 * 1e-4, rtol=0, atol=1e-5)
    assert p.writes == 50
    assert torch.equal(p.dequantize(), fp8(state.master["w"]).float())


def test_quantized_checkpoint_round_trip_is_exact(tmp_path):
    """Saving and loading the state of quantized params continues exactly as not doing so."""
    entry = next(e for e in ENTRIES if e.name == "adamw")
    grads = [{k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)).bfloat16()
              for k, v in _params(True).items()} for i in range(4)]

    def run(round_trip: bool):
        params = _params(True)
        opt = fo.chain(fo.clip_by_global_norm(1.0), entry.make(**entry.hypers))
        state = opt.init(params)
        for i, g in enumerate(grads):
            if i == 2 and round_trip:
                fo.save(state, tmp_path / "s")
                state = fo.load(tmp_path / "s", like=opt.init(params))
            _, state = opt.update(g, state)
        return params, state[-1]

    (pa, sa), (pb, sb) = run(False), run(True)
    for k in pa:
        assert torch.equal(sa.master[k], sb.master[k]) and torch.equal(sa.mu[k], sb.mu[k])
        assert torch.equal(pa[k].dequantize(), pb[k].dequantize())


def test_a_failed_step_is_recovered_as_a_completed_step_writes(tmp_path):
    """After a host step failed half-way, loading the checkpoint sets each quantized param as a
    completed host step does: quantized from the value copied up (bf16), not from the fp32
    master."""
    params = _params(True)
    opt = fo.adamw(1e-2, executor=fo.executor.HostExecutor(chunk_bytes=1 << 16))
    grads = {k: torch.randn(v.shape).bfloat16() for k, v in params.items()}
    params, state = opt.update(grads, opt.init(params))
    fo.save(state, tmp_path / "s")
    saved = {k: v.dequantize() for k, v in params.items()}
    with fail_host_kernel(after=1), pytest.raises(fo.HostStepError):
        opt.update(grads, state)
    state = fo.load(tmp_path / "s", like=state)
    for k, p in params.items():
        assert torch.equal(p.dequantize(), saved[k]), k
        assert torch.equal(p.dequantize(), fp8(state.master[k].bfloat16())), k


def test_torch_optimizer_keeps_the_master_of_an_fp32_typed_quantized_param():
    """``fo.TorchOptimizer``'s state_dict holds the fp32 master of a quantized param also when
    the param's nominal dtype is fp32 (the param holds fewer bits than its master), and a load
    continues exactly."""
    torch.manual_seed(0)
    make = lambda: Fp8Param(torch.randn(N), torch.float32).requires_grad_()  # noqa: E731
    grads = [torch.randn(N) * 1e-3 for _ in range(4)]

    def run(round_trip: bool):
        torch.manual_seed(0)
        p = make()
        opt = fo.TorchOptimizer([p], fo.adamw, lr=1e-3)
        for i, g in enumerate(grads):
            if i == 2 and round_trip:
                sd = opt.state_dict()
                assert "master" in sd["state"][0]
                q = make()
                opt = fo.TorchOptimizer([q], fo.adamw, lr=1e-3)
                opt.load_state_dict(sd)
                with torch.no_grad():
                    q.copy_(p.dequantize())
                p = q
            p.grad = g.clone()
            opt.step()
        return p.dequantize()

    assert torch.equal(run(False), run(True))


def test_a_plan_reads_no_quantized_param():
    params = _params(True)
    fo.plan(fo.adamw(1e-3), params)
    assert all(getattr(p, "reads", 0) == 0 for p in params.values())


def test_quantized_params_refused_where_they_cannot_be_written():
    params = _params(True)
    with pytest.raises(ValueError, match="'b'.*delayed update cannot land"):
        fo.adamw(lr=1e-3, delayed=True).init(params)
    with pytest.raises(TypeError, match="'b'.*adafactor"):
        fo.adafactor(lr=1e-3).init(params)
    with pytest.raises(ValueError, match="'a' and 'b' hold the same quantized tensor's data"):
        fo.adamw(lr=1e-3).init({"a": params["w"], "b": params["w"]})
    twin = params["w"].as_subclass(torch.Tensor).detach().as_subclass(Fp8Param)
    with pytest.raises(ValueError, match="'a' and 'b' hold the same quantized tensor's data"):
        fo.adamw(lr=1e-3).init({"a": params["w"], "b": twin})  # another object, the same data
    with pytest.raises(TypeError, match="'b'.*keep an fp32 master"):
        fo.adamw(lr=1e-3, master_dtype=torch.float64).init(params)
    with pytest.raises(TypeError, match="'x'.*nominal dtype torch.float64"):
        fo.adamw(lr=1e-3).init({"x": Fp8Param(torch.randn(8), torch.float64)})


def test_a_failed_quantized_write_on_the_host_names_the_param_and_marks_the_state_failed():
    params = _params(True)
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    Fp8Param.fail = True
    try:
        with pytest.raises(RuntimeError, match="param 'b' failed: RuntimeError: injected failure"):
            opt.update({k: torch.randn(v.shape).bfloat16() for k, v in params.items()}, state)
    finally:
        Fp8Param.fail = False
    with pytest.raises(fo.StateError, match="failed"):
        opt.update({k: torch.randn(v.shape).bfloat16() for k, v in params.items()}, state)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_quantized_write_on_the_device_marks_the_state_failed():
    """A device-resident quantized param's write failing after its master was stepped leaves a
    changed state: it is marked failed (not reset to be stepped again)."""
    params = {"w": Fp8Param(torch.randn(1000).cuda())}
    opt = fo.adamw(1e-2, placement=fo.placement.on_device())
    state = opt.init(params)
    Fp8Param.fail = True
    try:
        with pytest.raises(RuntimeError, match="injected failure of quantize_"):
            opt.update({"w": torch.randn(1000).bfloat16().cuda()}, state)
    finally:
        Fp8Param.fail = False
    with pytest.raises(fo.StateError, match="failed"):
        opt.update({"w": torch.randn(1000).bfloat16().cuda()}, state)
