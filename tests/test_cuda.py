"""CUDA tests (marker ``cuda``): offloaded trajectories against an all-on-GPU torch.optim run.

Run on the GPU box: ``pytest -m cuda``. They skip on machines without a GPU.
"""

import optree
import pytest
import torch

import functional_offload as fo
from conftest import STALE
from functional_offload.executor import HostExecutor

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(8 * 8 * 8, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 3, 8, 8, generator=g).to(DEV), torch.randint(0, 10, (16,), generator=g).to(DEV))
            for _ in range(n)]


def reference(cls, kw, data, accumulate=1, dtype=torch.float32):
    torch.manual_seed(0)
    model = ConvNet().to(DEV, dtype)
    opt = cls(model.parameters(), **kw)
    for i, (x, y) in enumerate(data):
        torch.nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.named_parameters()}


def ours(make, data, accumulate=1, dtype=torch.float32, sync_every=True):
    torch.manual_seed(0)
    model = ConvNet().to(DEV, dtype)
    params = dict(model.named_parameters())
    opt = make()
    state = opt.init(params)
    for i, (x, y) in enumerate(data):
        torch.nn.functional.cross_entropy(model(x.to(dtype)), y).backward()  # grads accumulate in .grad
        if (i + 1) % accumulate == 0:
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
            for p in params.values():
                p.grad = None
            if sync_every:
                torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {k: v.detach() for k, v in params.items()}, state


def close(a, b, atol=1e-3, rtol=1e-5):
    for k in b:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=rtol), (k, (a[k] - b[k]).abs().max())


CASES = {
    "adamw": (fo.adamw, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "adam": (fo.adam, torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01)),
    "sgd": (fo.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)),
}


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_trajectory_matches_gpu_reference(case, fraction, steps):
    mk, cls, kw = CASES[case]
    data = batches(2 * steps)
    want = reference(cls, kw, data, accumulate=2)
    got, state = ours(lambda: mk(**kw, placement=fo.placement.offload_fraction(fraction),
                                 executor=HostExecutor(chunk_bytes=64 << 10, threads=4,
                                                       worker_elements=1)),
                      data, accumulate=2)
    close(got, want)
    plan = fo.placement.offload_fraction(fraction).plan(got)
    moments = state.mu if case != "sgd" else state.momentum
    for (k, m), host in zip(sorted(moments.items()), plan.host_mask()):
        assert m.device.type == ("cpu" if host else "cuda"), k
        if host:
            assert state.master[k].device.type == "cpu" and state.master[k].dtype == torch.float32


def test_back_to_back_steps_without_sync_race_check():
    data = batches(30, seed=3)
    want = reference(torch.optim.AdamW, dict(lr=1e-3), data)
    got, _ = ours(lambda: fo.adamw(1e-3, placement=fo.placement.offload_fraction(0.5),
                                   executor=HostExecutor(chunk_bytes=16 << 10, slots=3, threads=4,
                                                         worker_elements=1)),
                  data, sync_every=False)
    close(got, want)


def test_bf16_model_fp32_masters_partial_fraction():
    data = batches(10, seed=5)
    want = reference(torch.optim.AdamW, dict(lr=1e-3), data)  # fp32 reference
    got, state = ours(lambda: fo.adamw(1e-3, placement=fo.placement.offload_fraction(0.5)),
                      data, dtype=torch.bfloat16)
    devices = {m.device.type for m in optree.tree_leaves(state.master)}
    assert devices == {"cpu", "cuda"}
    for k, p in got.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, state.master[k].to(p.device, torch.bfloat16))
    close({k: v.float().to(DEV) for k, v in state.master.items()}, want, atol=5e-2, rtol=5e-2)


def test_gpu_checkpoint_round_trip_and_replacement(tmp_path):
    data = batches(4, seed=7)
    got, state = ours(lambda: fo.adamw(1e-3, placement=fo.placement.on_host()), data, dtype=torch.bfloat16)
    fo.save(state, tmp_path / "opt")
    torch.manual_seed(0)
    params = {k: v.clone() for k, v in got.items()}
    like = fo.adamw(1e-3, placement=fo.placement.offload_fraction(0.5)).init(params)
    loaded = fo.load(tmp_path / "opt", like)
    for k in state.master:
        assert torch.equal(loaded.master[k].cpu(), state.master[k].cpu())
        assert loaded.master[k].dtype == torch.float32
    assert {m.device.type for m in optree.tree_leaves(loaded.mu)} == {"cpu", "cuda"}
    assert int(loaded.count) == 4


def test_no_pinned_allocation_after_init_and_native_kernel_used():
    from functional_offload.kernels import native
    assert native.module() is not None
    ex = HostExecutor(chunk_bytes=1 << 20)
    params = {"w": torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)}
    opt = fo.adamw(1e-3, executor=ex)
    state = opt.init(params)
    pinned = ex.pinned_bytes
    assert pinned == 4 * 2 * (1 << 20)
    for _ in range(5):
        params, state = opt.update({"w": torch.randn_like(params["w"])}, state)
    assert ex.pinned_bytes == pinned
    ex = HostExecutor(chunk_bytes=1 << 20)  # a delayed step's ring: slots for its bigger chunks
    opt = fo.adamw(1e-3, executor=ex, delayed=fo.Delay(lookahead=False))
    state = opt.init(params)
    assert ex.pinned_bytes == 4 * 2 * 4 * (1 << 20)
    for _ in range(3):
        params, state = opt.update({"w": torch.randn_like(params["w"])}, state)
    fo.flush(state)
    assert ex.pinned_bytes == 4 * 2 * 4 * (1 << 20)


@pytest.mark.parametrize("pin", [False, True])
def test_upload_casts_as_copy_does_and_keeps_the_stream_order(pin):
    """HostExecutor.upload: each destination equals ``dst.copy_(src)`` bit for bit (casts on the
    host, chunks through the two staging buffers turned over many times, pinned sources of the
    destination's dtype copied directly), after the work queued before on the caller's stream,
    and read after it by the work queued later."""
    ex = HostExecutor(chunk_bytes=4096)
    g = torch.Generator().manual_seed(0)
    sizes = [1, 3, 1000, 1024, 1025, 5000, 70001, 64]
    dtypes = [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
              (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)]
    srcs, dsts = [], []
    for k, n in enumerate(sizes):
        src_dtype, dst_dtype = dtypes[k % len(dtypes)]
        src = (torch.randn(n, generator=g) * 1e3).to(src_dtype)
        srcs.append(src.pin_memory() if pin else src)
        dsts.append(torch.zeros(n, dtype=dst_dtype, device=DEV))
    expected = [torch.empty_like(d).copy_(s) for d, s in zip(dsts, srcs)]
    busy = torch.empty(1 << 28, device=DEV)
    for _ in range(40):  # the stream is busy a while (~1 GiB written each), then fills them
        busy.fill_(1.0)
    for d in dsts:
        d.fill_(7)
    ex.upload(DEV, dsts, srcs)
    sums = [d.double().sum() for d in dsts]  # read on the caller's stream after the copies
    for d, e, s in zip(dsts, expected, sums):
        assert torch.equal(d.view(torch.uint8), e.view(torch.uint8))
        assert s.item() == e.double().sum().item()


def test_cpu_and_gpu_kernels_agree():
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(4096, generator=g).to(DEV)}
    grads = [{"w": torch.randn(4096, generator=g).to(DEV)} for _ in range(10)]
    outs = []
    for pl in (fo.placement.on_device(), fo.placement.on_host()):
        params = {"w": p["w"].clone()}
        opt = fo.adamw(1e-2, weight_decay=0.1, placement=pl, cpu_kernel="native")
        s = opt.init(params)
        for gr in grads:
            params, s = opt.update(gr, s)
        outs.append(params["w"])
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["adamw", "sgd"])
def test_delayed_update_matches_hand_written_delayed_loop(case):
    mk, cls, kw = CASES[case]
    data = batches(8, seed=11)
    torch.manual_seed(0)
    ref = ConvNet().to(DEV)
    ropt = cls(ref.parameters(), **kw)
    prev = None
    for x, y in data + [(None, None)]:  # the trailing (None, None) is the final flush
        cur = None
        if x is not None:
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            cur = [p.grad.clone() for p in ref.parameters()]
            ropt.zero_grad(set_to_none=True)
        if prev is not None:
            for p, g in zip(ref.parameters(), prev):
                p.grad = g
            ropt.step()
            ropt.zero_grad(set_to_none=True)
        prev = cur
    want = {k: v.detach() for k, v in ref.named_parameters()}

    torch.manual_seed(0)
    model = ConvNet().to(DEV)
    params = dict(model.named_parameters())
    opt = mk(**kw, placement=fo.placement.on_host(), delayed=STALE,
             executor=HostExecutor(chunk_bytes=64 << 10, threads=4))
    state = opt.init(params)
    for x, y in data:  # no synchronization between steps
        torch.nn.functional.cross_entropy(model(x), y).backward()
        params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        for p in params.values():
            p.grad = None
    fo.flush(state)
    torch.cuda.synchronize()
    close({k: v.detach() for k, v in params.items()}, want)


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_streamed_update_equals_plain_on_gpu(fraction, guarded):
    """Bare: the host leaves' steps run during backward. Guarded and clipped: the chain's update
    runs after backward, and step 3 (a NaN loss) is skipped whole."""
    data = batches(6, seed=13)
    outs = []
    for streamed in (False, True):
        torch.manual_seed(0)
        model = ConvNet().to(DEV, torch.bfloat16)
        params = dict(model.named_parameters())
        opt = fo.adamw(1e-3, weight_decay=0.1, placement=fo.placement.offload_fraction(fraction),
                       executor=HostExecutor(chunk_bytes=64 << 10, threads=4))
        if guarded:
            opt = fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(0.5), opt))
        state = opt.init(params)
        for j, (x, y) in enumerate(data):  # back to back, no synchronization
            loss = torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)), y)
            if guarded and j == 3:
                loss = loss * float("nan")
            if streamed:
                with fo.stream(opt, state) as s:
                    loss.backward()
                params, state = s.finish()
            else:
                loss.backward()
                params, state = opt.update({k: p.grad for k, p in params.items()}, state)
            for p in params.values():
                p.grad = None
        torch.cuda.synchronize()
        if guarded:
            assert int(state.total_notfinite) == 1 and int(state.inner_state[-1].count) == 5
        outs.append(({k: v.detach().clone() for k, v in params.items()}, fo.state_dict(state)))
    for k in outs[0][0]:
        assert torch.equal(outs[0][0][k], outs[1][0][k]), k
    for k in outs[0][1]:
        assert torch.equal(outs[0][1][k].cpu(), outs[1][1][k].cpu()), k



@pytest.mark.parametrize("placement", ["on_host", "on_device", "half"])
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov", "lion", "adafactor"])
def test_registry_optimizers_on_the_gpu(name, placement):
    """Every optimizer of the registry with GPU params, its state on the host, on the device or
    half and half, against its oracle run on the GPU."""
    from registry import OPTIMIZERS
    e = {x.name: x for x in OPTIMIZERS}[name]
    where = {"on_host": fo.placement.on_host(), "on_device": fo.placement.on_device(),
             "half": fo.placement.offload_fraction(0.5)}[placement]
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 48, generator=g).to(DEV), "b": torch.randn(48, generator=g).to(DEV),
              "m": torch.randn(3, 40, 5, generator=g).to(DEV)}
    grads = [{k: torch.randn(v.shape, generator=g).to(DEV) for k, v in params.items()} for _ in range(10)]
    want = e.oracle(params, grads)
    opt = e.make(**e.hypers, placement=where, executor=HostExecutor(chunk_bytes=16 << 10, threads=4))
    p = {k: v.clone() for k, v in params.items()}
    s = opt.init(p)
    for gr in grads:
        p, s = opt.update(gr, s)
    torch.cuda.synchronize()
    close(p, want, atol=1e-5, rtol=1e-5)


def test_device_groups_with_missing_grads_decay_mask_and_ema():
    """Device-resident state in several groups (bf16 and fp32 params in one group, a
    weight-decay mask) with some leaves' grads None on odd steps and an EMA: the same state as
    the host step (torch kernel) after every step."""
    g = torch.Generator().manual_seed(0)
    shapes = {"a": ((64, 32), torch.bfloat16), "b": ((32,), torch.bfloat16), "c": ((16, 8), torch.float32),
              "d": ((8,), torch.float32), "e": ((5, 3, 2), torch.bfloat16)}
    params = {k: torch.randn(s, generator=g).to(DEV, dt) for k, (s, dt) in shapes.items()}
    mask = {"a": True, "b": False, "c": True, "d": False, "e": True}
    grads = [{k: None if step % 2 and (step + i) % 3 == 0 else torch.randn(p.shape, generator=g).to(DEV, p.dtype)
              for i, (k, p) in enumerate(params.items())} for step in range(6)]
    states = []
    for where, kernel in ((fo.placement.on_device(), "auto"), (fo.placement.on_host(), "torch")):
        opt = fo.adamw(1e-2, weight_decay=0.1, weight_decay_mask=mask, ema_decay=0.9,
                       placement=where, cpu_kernel=kernel)
        p = {k: v.clone() for k, v in params.items()}
        s = opt.init(p)
        for gr in grads:
            p, s = opt.update(gr, s)
        torch.cuda.synchronize()
        states.append((p, fo.state_dict(s)))
    (p_dev, s_dev), (p_host, s_host) = states
    close(p_dev, p_host, atol=1e-5, rtol=1e-5)
    assert set(s_dev) <= set(s_host)  # the host one has masters of the fp32 params too
    for k in s_dev:
        assert torch.allclose(s_dev[k].cpu().double(), s_host[k].cpu().double(), atol=1e-5, rtol=1e-5), k


def test_device_group_follows_a_param_dtype_change():
    """fp32 params with device-resident state (no masters) and one of them cast to fp64 between
    updates: the next update groups it apart (the fused kernel takes one dtype) and steps it as
    the same loop does on the CPU. (Cast to fp16 it would be refused: a half-precision param
    steps through a master, which it was not given at init.)"""
    results = []
    for dev in (DEV, torch.device("cpu")):
        g = torch.Generator().manual_seed(0)
        p = {"a": torch.randn(16, 8, generator=g).to(dev), "b": torch.randn(8, generator=g).to(dev)}
        opt = fo.adamw(1e-2, placement=fo.placement.on_device(), cpu_kernel="torch")
        s = opt.init(p)
        p, s = opt.update({k: torch.randn(v.shape, generator=g).to(dev) for k, v in p.items()}, s)
        p["b"].data = p["b"].data.double()
        p, s = opt.update({k: torch.randn(v.shape, generator=g).to(dev, v.dtype) for k, v in p.items()}, s)
        results.append({k: v.cpu() for k, v in p.items()})
    assert results[0]["b"].dtype == torch.float64
    close(results[0], results[1], atol=1e-5, rtol=1e-5)


# ---- the failure contract on the GPU (streams, copies, events in flight) -------------------

def _gpu_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 8)).to(DEV, torch.bfloat16)


def _snapshot(state):
    return {k: v.clone() for k, v in fo.state_dict(state).items()}


def test_stream_of_a_detached_state_on_the_gpu():
    model = _gpu_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = fo.adamw(1e-2, executor=HostExecutor(chunk_bytes=16 << 10, threads=4))
    state = opt.init(params)
    with pytest.raises(ValueError, match="params=model"):
        fo.stream(opt, state)
    before = {k: v.clone() for k, v in params.items()}
    with fo.stream(opt, state, params=model) as s:
        model(torch.randn(32, 64, device=DEV, dtype=torch.bfloat16)).float().square().mean().backward()
    params, state = s.finish()
    torch.cuda.synchronize()
    assert len(s.arrived) == len(params) and all(not torch.equal(params[k], before[k]) for k in params)


@pytest.mark.parametrize("front", ["none", "clip"])
def test_exception_in_backward_aborts_the_streamed_step_on_the_gpu(front):
    model = _gpu_model()
    params = dict(model.named_parameters())
    inner = fo.adamw(1e-2, executor=HostExecutor(chunk_bytes=16 << 10, threads=4))
    opt = inner if front == "none" else fo.chain(fo.clip_by_global_norm(1e6), inner)
    state = opt.init(params)
    snap, p_before = _snapshot(state), {k: v.detach().clone() for k, v in params.items()}

    class Boom(Exception):
        pass

    model[0].register_full_backward_hook(lambda *a: (_ for _ in ()).throw(Boom()))
    x = torch.randn(32, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(Boom):
        with fo.stream(opt, state):
            model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    if front == "clip":  # speculative: exactly as it was, params too
        assert all(torch.equal(v, snap[k]) for k, v in _snapshot(state).items())
        assert all(torch.equal(params[k], p_before[k]) for k in params)
    else:
        try:
            same = all(torch.equal(v, snap[k]) for k, v in _snapshot(state).items())
        except fo.StateError:
            same = None
        assert same in (None, True)


def test_delayed_faults_on_the_gpu(tmp_path):
    """Ctrl-C during a flush lands the step; a background failure is raised once and then the
    state is refused; a load waits for the step in flight."""
    import _thread
    import threading
    from functional_offload.testing import fail_host_kernel, slow_host_kernel
    model = _gpu_model()
    params = dict(model.named_parameters())
    # (a delayed step's chunks are four of these: ~11 chunks of 0.02 s each below)
    opt = fo.adamw(1e-2, delayed=STALE, executor=HostExecutor(chunk_bytes=4096, threads=4))
    state = opt.init(params)
    grads = lambda: {k: torch.randn_like(v) for k, v in params.items()}  # noqa: E731
    params, state = opt.update(grads(), state)
    fo.save(state, tmp_path / "good")
    with slow_host_kernel(0.02):
        params, state = opt.update(grads(), state)
        threading.Timer(0.03, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            fo.flush(state)
    fo.flush(state)
    torch.cuda.synchronize()
    for k, p in params.items():
        assert torch.equal(p, state.master[k].to(DEV, p.dtype)), k
    with slow_host_kernel(0.02):
        params, state = opt.update(grads(), state)
        state = fo.load(tmp_path / "good", like=state)
    fo.flush(state)
    saved = fo.load(tmp_path / "good", like=opt.init({k: v.detach().clone() for k, v in params.items()}))
    assert all(torch.equal(v, fo.state_dict(saved)[k]) for k, v in fo.state_dict(state).items())
    good = (tmp_path / "good").read_bytes()
    with fail_host_kernel(after=1):
        params, state = opt.update(grads(), state)
        with pytest.raises(fo.HostStepError):
            fo.save(state, tmp_path / "good")
    with pytest.raises(fo.StateError, match="failed"):
        fo.save(state, tmp_path / "good")
    assert (tmp_path / "good").read_bytes() == good


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_documented_recovery_on_the_gpu_restores_params_too(tmp_path, dtype):
    """A failed host step for GPU params (their state in host memory, each with a master
    there) left part of the params on the GPU stepped: fo.load into the failed state puts them
    back from the masters it loads, and the next updates equal a run that never failed."""
    from functional_offload.testing import fail_host_kernel
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(40000, generator=g).to(DEV, dtype)}
    grads = [{k: torch.randn(v.shape, generator=g).to(DEV, dtype) for k, v in base.items()}
             for _ in range(3)]
    mk = lambda: fo.adamw(1e-2, placement=fo.placement.on_host(),  # noqa: E731
                          executor=HostExecutor(chunk_bytes=4096, slots=2, threads=2, worker_elements=1))
    opt = mk()
    params = {k: v.clone() for k, v in base.items()}
    state = opt.init(params)
    params, state = opt.update(grads[0], state)
    fo.save(state, tmp_path / "opt")
    kept = {k: v.clone() for k, v in params.items()}
    with fail_host_kernel(after=3):
        with pytest.raises(fo.HostStepError):
            opt.update(grads[1], state)
    torch.cuda.synchronize()
    assert not torch.equal(params["w"], kept["w"])  # half stepped
    state = fo.load(tmp_path / "opt", like=state)
    assert torch.equal(params["w"], kept["w"])
    for gs in grads[1:]:
        params, state = opt.update(gs, state)
    ref = mk()
    q = {k: v.clone() for k, v in base.items()}
    s = ref.init(q)
    for gs in grads:
        q, s = ref.update(gs, s)
    assert torch.equal(params["w"], q["w"])
