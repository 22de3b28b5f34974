"""Grad streaming: updates start during backward and equal the plain update bit for bit."""

import threading
import time

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor
from functional_offload.testing import slow_host_kernel
from conftest import STALE, KERNELS


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 4)).to(dtype)


def train(model, opt, streamed, steps=5, dtype=torch.float32, nan_step=None, committed=False):
    params = dict(model.named_parameters())
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    counts, kept = [], []
    for step in range(steps):
        loss = model(torch.randn(32, 16, generator=g).to(dtype)).float().square().mean()
        if step == nan_step:
            loss = loss * float("nan")
        if streamed:
            with fo.stream(opt, state) as s:
                loss.backward()
                counts.append(len(s.arrived))  # handed over during backward
            params, state = s.finish()
            kept.append(s.committed)
        else:
            loss.backward()
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
    return (params, state, counts, kept) if committed else (params, state, counts)


def assert_same(pa, sa, pb, sb):
    """Params and state (every saved tensor) equal bit for bit."""
    for x, y in zip(optree.tree_leaves(pa), optree.tree_leaves(pb), strict=True):
        assert torch.equal(x, y)
    da, db = fo.state_dict(sa), fo.state_dict(sb)
    assert da.keys() == db.keys()
    for k in da:
        assert torch.equal(da[k], db[k]), k


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", ["adamw", "sgd"])
def test_streamed_equals_plain_bit_for_bit(make, dtype, kernel):
    mk = (lambda: fo.adamw(1e-2, weight_decay=0.1, cpu_kernel=kernel,
                           executor=HostExecutor(chunk_bytes=4096, threads=2))) if make == "adamw" else \
         (lambda: fo.sgd(0.05, momentum=0.9, cpu_kernel=kernel, executor=HostExecutor(chunk_bytes=4096, threads=2)))
    a, b = make_model(dtype), make_model(dtype)
    pa, sa, _ = train(a, mk(), streamed=False, dtype=dtype)
    pb, sb, counts = train(b, mk(), streamed=True, dtype=dtype)
    assert counts == [6] * 5  # every param was handed over before backward returned
    for x, y in zip(optree.tree_leaves(pa), optree.tree_leaves(pb)):
        assert torch.equal(x, y)
    da, db = fo.state_dict(sa), fo.state_dict(sb)
    for k in da:
        assert torch.equal(da[k], db[k]), k


def test_frozen_params_and_weight_decay_mask():
    a, b = make_model(), make_model()
    for m in (a, b):
        m[0].weight.requires_grad_(False)
    mask = lambda p: {k: v.ndim > 1 for k, v in p.items()}  # noqa: E731
    mk = lambda: fo.adamw(1e-2, weight_decay=0.3, weight_decay_mask=mask)  # noqa: E731
    pa, _, _ = train(a, mk(), streamed=False)
    pb, _, counts = train(b, mk(), streamed=True)
    assert counts == [5] * 5
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


FRONTS = {
    "clip": lambda opt: fo.chain(fo.clip_by_global_norm(0.05), opt),  # clips every step here
    "noclip": lambda opt: fo.chain(fo.clip_by_global_norm(1e6), opt),  # never clips
    "guard+clip": lambda opt: fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(0.05), opt)),
    "guard+noclip": lambda opt: fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1e6), opt)),
    "guard": lambda opt: fo.apply_if_finite(opt),  # kept whole unless a grad is not finite
    "scale": lambda opt: fo.chain(fo.scale(1.0), opt),  # no global scale: grads are held
}


@pytest.mark.parametrize("front", sorted(FRONTS))
@pytest.mark.parametrize("make", ["adamw", "sgd"])
def test_streamed_chain_equals_unstreamed_chain_bit_for_bit(make, front):
    """Clipping and the guard in front: the step runs ahead during backward as if the clip
    factor were 1 and the grads finite, and is kept or redone (clip) or dropped (guard, step 2
    has a NaN loss) at finish — bit for bit the chain's update either way."""
    def mk():
        ex = HostExecutor(chunk_bytes=4096, threads=2)
        opt = (fo.adamw(1e-2, weight_decay=0.1, executor=ex) if make == "adamw"
               else fo.sgd(0.05, momentum=0.9, executor=ex))
        return FRONTS[front](opt)
    a, b = make_model(torch.bfloat16), make_model(torch.bfloat16)
    nan_step = 2 if front.startswith("guard") else None
    pa, sa, _ = train(a, mk(), streamed=False, dtype=torch.bfloat16, nan_step=nan_step)
    pb, sb, counts, committed = train(b, mk(), streamed=True, dtype=torch.bfloat16,
                                      nan_step=nan_step, committed=True)
    assert counts == [6] * 5  # every leaf started during backward
    if front == "scale":
        assert committed == [None] * 5
    else:  # "noclip" keeps every step that ran ahead; "clip" redoes the steps it clips
        assert all(c is True for i, c in enumerate(committed) if i != nan_step) \
            if front.endswith("noclip") or front == "guard" else False in committed
        if nan_step is not None:
            assert committed[nan_step] is None  # a skipped step: nothing was committed
    if nan_step is not None:
        inner = sb.inner_state if front == "guard" else sb.inner_state[-1]
        assert int(sb.total_notfinite) == 1 and int(inner.count) == 4
    assert_same(pa, sa, pb, sb)


def test_stream_rejects_transforms_delayed_and_second_gradients():
    model = make_model()
    params = dict(model.named_parameters())
    clip = fo.clip_by_global_norm(1.0)
    with pytest.raises(TypeError, match="takes an Optimizer"):
        fo.stream(clip, clip.init(params))
    delayed = fo.adamw(1e-2, delayed=STALE)
    dstate = delayed.init(params)
    with pytest.raises(ValueError, match="one of them"):
        with fo.stream(delayed, dstate):
            pass
    delayed.update({k: torch.zeros_like(v) for k, v in params.items()}, dstate)  # still usable
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="second gradient"):
        with fo.stream(opt, state):
            model(x).sum().backward()
            model(x).sum().backward()  # an accumulation streamed twice


def test_streaming_a_chain_around_a_delayed_optimizer_runs_its_update():
    """A clipped chain ending in a delayed optimizer: finish is the chain's update, which
    starts the delayed step; flushing lands it as the unstreamed loop does."""
    mk = lambda: fo.chain(fo.clip_by_global_norm(0.05), fo.adamw(1e-2, delayed=STALE))  # noqa: E731
    a, b = make_model(), make_model()
    pa, sa, _ = train(a, mk(), streamed=False)
    pb, sb, _ = train(b, mk(), streamed=True)
    fo.flush(sa), fo.flush(sb)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.mark.parametrize("max_norm", [1e9, 1e-3])
def test_streamed_chain_around_a_delayed_optimizer_reports_nothing_ran_ahead(max_norm):
    """Its delayed step starts at finish, whether the clip scales or not: ``committed`` is
    None (nothing was kept or redone), as the step protocol says."""
    model = make_model()
    opt = fo.chain(fo.clip_by_global_norm(max_norm), fo.adamw(1e-2, delayed=True))
    params = dict(model.named_parameters())
    state = opt.init(params)
    x = torch.randn(8, 16)
    for _ in range(2):
        with fo.stream(opt, state) as s:
            model(x).square().mean().backward()
        params, state = s.finish()
        assert s.committed is None
        model.zero_grad(set_to_none=True)
    fo.flush(state)


@pytest.mark.parametrize("order", ["first-first", "second-first"])
def test_two_streams_on_one_executor_finish_in_any_order(order):
    """Two optimizers streaming one backward through one executor (the default one, say): each
    run lets go of the ring when backward ends, so finishing them in either order completes."""
    import threading
    torch.manual_seed(0)
    a, b = make_model(), make_model()
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    oa, ob = fo.adamw(1e-2, executor=ex), fo.adamw(1e-2, executor=ex)
    sa, sb = oa.init(dict(a.named_parameters())), ob.init(dict(b.named_parameters()))
    x = torch.randn(8, 16)
    done = []

    def step():
        with fo.stream(oa, sa) as s1, fo.stream(ob, sb) as s2:
            (a(x).square().mean() + b(x).square().mean()).backward()
        for s in ((s1, s2) if order == "first-first" else (s2, s1)):
            s.finish()
        done.append(True)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(60)
    assert done == [True]


@pytest.mark.parametrize("kernel", KERNELS)
def test_leaves_not_begun_when_the_step_commits_run_in_place_bit_for_bit(kernel):
    """With the host kernel slowed down, most leaves fed during backward have not begun when
    the clip factor turns out 1: they run in place, not into spare buffers (leaves over the
    packing size; the small ones are packed at finish). The result is the chain's update bit
    for bit, EMA included, over several steps."""
    def mk():
        ex = HostExecutor(chunk_bytes=1 << 16, slots=2, threads=2, worker_elements=1)
        return fo.chain(fo.clip_by_global_norm(1e6),
                        fo.adamw(1e-2, weight_decay=0.1, ema_decay=0.9, cpu_kernel=kernel, executor=ex))

    def big():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                   torch.nn.GELU(), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    a, b = big(), big()
    pa, sa, _ = train(a, mk(), streamed=False, steps=3, dtype=torch.bfloat16)
    with slow_host_kernel(0.02):
        pb, sb, counts, committed = train(b, mk(), streamed=True, steps=3, dtype=torch.bfloat16,
                                          committed=True)
    assert counts == [6] * 3 and committed == [True] * 3
    assert_same(pa, sa, pb, sb)
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(fo.ema_params(sa)),
                                                  optree.tree_leaves(fo.ema_params(sb))))


class _Pause(torch.autograd.Function):
    """Identity whose backward sleeps: the grads arriving before it begin their host work
    before ``finish``, the others after it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.1)
        return g


@pytest.mark.parametrize("layout", ["contiguous", "transposed param"])
def test_committed_step_with_leaves_ahead_and_in_place_bit_for_bit(layout):
    """One leaf begins during backward (spare buffers), the other after ``finish`` (in place):
    both get their update, also when a param is a transposed (non-contiguous) view."""
    def make():
        torch.manual_seed(0)
        a = torch.nn.Parameter((torch.randn(512, 512) * 0.02).to(torch.bfloat16))
        b = (torch.randn(512, 512) * 0.02).to(torch.bfloat16)
        return {"late": torch.nn.Parameter(b.t() if layout == "transposed param" else b),
                "first": a}

    def loss_of(p, x):
        first, late = p["first"], p["late"]
        return (_Pause.apply((x @ late).float().tanh()) @ first.float()).square().mean()

    def mk():
        return fo.chain(fo.clip_by_global_norm(1e6), fo.adamw(1e-2, executor=HostExecutor(
            chunk_bytes=1 << 16, slots=2, threads=2, worker_elements=1)))
    x = torch.randn(16, 512).to(torch.bfloat16)
    pa, oa = make(), mk()
    sa = oa.init(pa)
    loss_of(pa, x).backward()
    pa, sa = oa.update(optree.tree_map(lambda p: p.grad, pa), sa)
    pb, ob = make(), mk()
    sb = ob.init(pb)
    with slow_host_kernel(0.02):
        with fo.stream(ob, sb) as s:
            loss_of(pb, x).backward()
        pb, sb = s.finish()
    assert s.committed is True
    for field in ("mu", "nu", "master"):
        want, got = (pa, getattr(sa[-1], field)), (pb, getattr(sb[-1], field))
        for x_, y_ in zip(optree.tree_leaves(want), optree.tree_leaves(got), strict=True):
            assert torch.equal(x_, y_), field


def _towers(dtype=torch.bfloat16):
    """Two MLPs of leaves big enough to go unpacked (each has views of its own state)."""
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Sequential(
        torch.nn.Linear(16, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 16)).to(dtype)
        for _ in range(2)])


@pytest.mark.parametrize("front", ["noclip", "clip"])
def test_grads_fed_from_two_threads_at_once_give_the_plain_steps_bits(front, monkeypatch):
    """Autograd runs each device's backward in a thread of its own, so a model on two devices
    feeds a streamed step from two threads at once: here two towers' backwards, each in its own
    thread, started together. Over steps whose state the speculative step swaps (its leaves'
    views remade, slowly here, at the first feed), every leaf gets the plain update's bits, and
    no run is left open (which would hang the step)."""
    from functional_offload.optimizers.forms import base
    remake = base.with_flat_views
    monkeypatch.setattr(base, "with_flat_views", lambda leaf: (time.sleep(0.01), remake(leaf))[1])
    out = [_two_towers(front, streamed=False)]
    worker = threading.Thread(target=lambda: out.append(_two_towers(front, streamed=True)),
                              daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the streamed steps hung"
    assert_same(*out[0], *out[1])


def _two_towers(front: str, streamed: bool) -> tuple:
    """Twelve steps of :func:`_towers` with the chain ``FRONTS[front]``, streamed with each
    tower's backward in a thread of its own (the two started together), or plain."""
    model = _towers()
    params = dict(model.named_parameters())
    opt = FRONTS[front](fo.adamw(1e-2, weight_decay=0.1,
                                 executor=HostExecutor(chunk_bytes=4096, threads=2)))
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        losses = [tower(torch.randn(32, 16, generator=g).bfloat16()).float().square().mean()
                  for tower in model]
        if streamed:
            start, errors = threading.Barrier(2), []

            def backward(loss):
                try:
                    start.wait()
                    loss.backward()
                except BaseException as e:  # noqa: BLE001 - raised below
                    errors.append(e)
            with fo.stream(opt, state) as s:
                threads = [threading.Thread(target=backward, args=(x,)) for x in losses]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            assert not errors, errors
            params, state = s.finish()
        else:
            sum(losses).backward()
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
    return params, state
