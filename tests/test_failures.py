"""The failure contract: every step completes, leaves the state as it was, or marks it failed —
and nothing uses, streams or checkpoints a failed state. Faults go through fo.testing."""

import _thread
import contextlib
import os
import pickle
import signal
import threading
import time

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor
from functional_offload.testing import fail_host_kernel, slow_host_kernel
from conftest import STALE, KERNELS, clone, grad_seq, make_params, small_executor


def small_chunks(**kw):
    return HostExecutor(chunk_bytes=4096, slots=2, threads=2, worker_elements=1, **kw)


def snapshot(state):
    return {k: v.clone() for k, v in fo.state_dict(state).items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flat(tree):
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return {p: x.detach().clone() for p, x in zip(paths, leaves)}


def run_reference(opt_fn, params, grads):
    p = clone(params)
    opt = opt_fn()
    s = opt.init(p)
    for g in grads:
        p, s = opt.update(g, s)
    fo.flush(s)
    return p, s


@contextlib.contextmanager
def interrupt_after(seconds):
    """Send the main thread a KeyboardInterrupt (as Ctrl-C does) after ``seconds``, unless the
    block has ended by then (so a late interrupt cannot land in another test)."""
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# ---- a failed host kernel ----------------------------------------------------------------

@pytest.mark.parametrize("kernel", KERNELS)
def test_partial_failure_marks_the_state_failed_until_a_checkpoint_is_loaded(kernel, tmp_path):
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 4)
    mk = lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, cpu_kernel=kernel,  # noqa: E731
                                                                 executor=small_chunks()))
    opt = mk()
    state = opt.init(params)
    params, state = opt.update(grads[0], state)
    fo.save(state, tmp_path / "good")
    before = (tmp_path / "good").read_bytes()
    with fail_host_kernel(after=1):
        with pytest.raises(fo.HostStepError, match="injected") as e:
            opt.update(grads[1], state)
    assert isinstance(e.value.__cause__, RuntimeError)
    for action in (lambda: opt.update(grads[1], state), lambda: fo.save(state, tmp_path / "good"),
                   lambda: fo.state_dict(state), lambda: fo.stream(opt, state)):
        with pytest.raises(fo.StateError, match="failed.*checkpoint"):
            action()
    assert (tmp_path / "good").read_bytes() == before  # nothing overwrote the good checkpoint
    state = fo.load(tmp_path / "good", like=state)  # a failed state recovers by loading
    for g in grads[1:]:
        params, state = opt.update(g, state)
    ref_p, ref_s = run_reference(mk, make_params(dtype=torch.bfloat16, big=True), grads)
    assert same(fo.state_dict(state), fo.state_dict(ref_s))


def test_failure_before_any_chunk_ran_leaves_the_state_usable():
    params = make_params(big=True)
    opt = fo.adamw(1e-2, executor=small_chunks())
    state = opt.init(params)
    snap = snapshot(state)
    with fail_host_kernel(after=0):
        with pytest.raises(fo.HostStepError):
            opt.update(grad_seq(params, 1)[0], state)
    # the first chunk never ran: either nothing changed and the state is usable, or it is failed
    try:
        now = snapshot(state)
    except fo.StateError:
        pytest.fail("a step that changed nothing must leave the state usable")
    assert same(now, snap)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupts_in_the_host_step_reach_the_caller_as_themselves(exc):
    params = make_params(big=True)
    opt = fo.adamw(1e-2, executor=small_chunks())
    state = opt.init(params)
    with fail_host_kernel(after=2, exc=exc):
        with pytest.raises(exc):
            opt.update(grad_seq(params, 1)[0], state)
    with pytest.raises(fo.StateError, match="failed"):  # two chunks were applied: torn
        fo.save(state, "/nonexistent/never-written")


def test_ctrl_c_during_update_completes_the_step_then_raises():
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 3)
    mk = lambda: fo.adamw(1e-2, executor=small_chunks())  # noqa: E731
    opt = mk()
    state = opt.init(params)
    params, state = opt.update(grads[0], state)
    with slow_host_kernel(0.05):
        with pytest.raises(KeyboardInterrupt), interrupt_after(0.1):
            params, state = opt.update(grads[1], state)  # the assignment never happens
    assert int(state.count) == 2  # the state passed in holds the completed step
    params, state = opt.update(grads[2], state)
    _, ref = run_reference(mk, make_params(dtype=torch.bfloat16, big=True), grads)
    assert same(fo.state_dict(state), fo.state_dict(ref))


class Stop(Exception):
    """What a signal handler of the user's raises (torchrun's raises SignalException)."""


@contextlib.contextmanager
def stop_signal_after(seconds, calls):
    """SIGUSR1 sent to this process after ``seconds``; its handler (yielded) appends the signal
    to ``calls`` and raises :class:`Stop`. The old handler is back after the block."""
    def handler(signum, frame):
        calls.append(signum)
        raise Stop(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        yield handler
        timer.join()
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)


def test_a_handler_that_raises_during_a_step_runs_once_the_step_is_done():
    """A signal whose Python handler raises arrives during the host step: the handler runs
    once the step's work is done, its exception reaches the caller with the state passed in
    holding the step, and the handler is in place again."""
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 2)
    mk = lambda: fo.adamw(1e-2, executor=small_chunks())  # noqa: E731
    opt = mk()
    state = opt.init(params)
    calls = []
    with slow_host_kernel(0.1), stop_signal_after(0.05, calls) as handler:
        with pytest.raises(Stop):
            opt.update(grads[0], state)
        assert signal.getsignal(signal.SIGUSR1) is handler
    assert calls == [signal.SIGUSR1] and int(state.count) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    params, state = opt.update(grads[1], state)  # the state passed in held the step
    _, ref = run_reference(mk, make_params(dtype=torch.bfloat16, big=True), grads)
    assert same(fo.state_dict(state), fo.state_dict(ref))


def test_torch_optimizer_step_with_a_raising_signal_handler_completes_every_group():
    """``TorchOptimizer.step`` when a signal's handler raises during a group's update: that
    group's step completed, the other groups step too, then the exception is raised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = fo.TorchOptimizer([{"params": model[0].parameters()}, {"params": model[1].parameters()}],
                            fo.adamw, lr=1e-2, executor=small_chunks())
    model(torch.randn(4, 64)).sum().backward()
    calls = []
    with slow_host_kernel(0.1), stop_signal_after(0.05, calls):
        with pytest.raises(Stop):
            opt.step()
    assert calls == [signal.SIGUSR1]
    assert [int(s["step"]) for s in opt.state_dict()["state"].values()] == [1, 1, 1, 1]


def test_steps_from_another_thread_leave_the_handlers_alone():
    params = make_params(big=True)
    opt = fo.adamw(1e-2, executor=small_chunks())
    state = opt.init(params)
    out = []
    worker = threading.Thread(target=lambda: out.append(opt.update(grad_seq(params, 1)[0], state)))
    worker.start()
    worker.join()
    assert int(out[0][1].count) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def one_chunk():
    """An executor whose runs of ``make_params(big=True)`` take one chunk and one worker: a
    plain update's run then runs in the step's own thread, with no thread of its own."""
    return HostExecutor(chunk_bytes=1 << 20)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_faults_of_a_run_in_the_steps_own_thread(exc):
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 2)
    opt = fo.adamw(1e-2, executor=one_chunk())
    state = opt.init(params)
    snap = snapshot(state)
    with fail_host_kernel(after=0, exc=exc):
        with pytest.raises(fo.HostStepError if exc is RuntimeError else exc, match="injected"):
            opt.update(grads[0], state)
    assert same(snapshot(state), snap)  # its one chunk never ran: usable, unchanged
    with slow_host_kernel(0.2):
        with pytest.raises(KeyboardInterrupt), interrupt_after(0.05):
            opt.update(grads[1], state)
    assert int(state.count) == 1  # the step completed, then the interrupt was raised
    _, ref = run_reference(lambda: fo.adamw(1e-2, executor=small_chunks()),
                           make_params(dtype=torch.bfloat16, big=True), grads[1:])
    assert same(fo.state_dict(state), fo.state_dict(ref))


# ---- the delayed update ------------------------------------------------------------------

def test_ctrl_c_during_flush_lands_the_step_and_a_second_flush_is_done(tmp_path):
    params = make_params(dtype=torch.bfloat16, big=True)
    grads = grad_seq(params, 3)
    mk = lambda: fo.adamw(1e-2, delayed=STALE, executor=small_chunks())  # noqa: E731
    opt = mk()
    state = opt.init(params)
    with slow_host_kernel(0.03):
        for g in grads:
            params, state = opt.update(g, state)
        with pytest.raises(KeyboardInterrupt), interrupt_after(0.05):
            fo.flush(state)
    fo.flush(state)  # nothing left in flight
    for p, m in zip(optree.tree_leaves(params), optree.tree_leaves(state.master)):
        assert torch.equal(p, m.to(p.dtype))  # every param landed
    fo.save(state, tmp_path / "ck")  # consistent: count and masters agree
    ref_p, ref_s = run_reference(mk, make_params(dtype=torch.bfloat16, big=True), grads)
    assert same(fo.state_dict(state), fo.state_dict(ref_s))
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(ref_p)))


def test_background_failure_is_raised_once_and_then_refused(tmp_path):
    params = make_params(big=True)
    opt = fo.sgd(0.1, momentum=0.9, delayed=STALE, executor=small_chunks())
    state = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], state)
    fo.save(state, tmp_path / "good")
    good = (tmp_path / "good").read_bytes()
    with fail_host_kernel(after=1):
        params, state = opt.update(grad_seq(params, 1, seed=2)[0], state)  # returns at once
        with pytest.raises(fo.HostStepError, match="injected"):
            fo.save(state, tmp_path / "good")
    with pytest.raises(fo.StateError, match="failed"):  # a retried save refuses too
        fo.save(state, tmp_path / "good")
    with pytest.raises(fo.StateError, match="failed"):
        opt.update(grad_seq(params, 1)[0], state)
    assert (tmp_path / "good").read_bytes() == good


def test_load_waits_for_the_step_in_flight(tmp_path):
    params = make_params(big=True)
    opt = fo.adamw(1e-2, delayed=STALE, executor=small_chunks())
    state = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], state)
    fo.save(state, tmp_path / "ck")
    saved = snapshot(state)
    with slow_host_kernel(0.02):
        params, state = opt.update(grad_seq(params, 1, seed=3)[0], state)  # still running
        state = fo.load(tmp_path / "ck", like=state)
    fo.flush(state)
    assert same(snapshot(state), saved)


# ---- streaming ---------------------------------------------------------------------------

def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 4)).to(dtype)


class Boom(Exception):
    pass


@pytest.mark.parametrize("front", ["none", "clip", "guard"])
def test_exception_in_backward_aborts_the_streamed_step(front):
    model = make_model(torch.bfloat16)
    params = dict(model.named_parameters())
    inner = fo.adamw(1e-2, executor=small_chunks())
    opt = {"none": inner, "clip": fo.chain(fo.clip_by_global_norm(1e6), inner),
           "guard": fo.apply_if_finite(inner)}[front]
    state = opt.init(params)
    snap = snapshot(state)
    p_before = clone(params)
    # the first layer's backward runs last: by then the later layers' grads were handed over
    model[0].register_full_backward_hook(lambda *a: (_ for _ in ()).throw(Boom()))
    x = torch.randn(8, 16).to(torch.bfloat16)
    with pytest.raises(Boom):
        with fo.stream(opt, state) as s:
            model(x.requires_grad_()).float().square().mean().backward()
    assert s.arrived  # some leaves did start
    if front == "none":  # in place: the state is failed unless nothing had run yet
        try:
            ok = same(snapshot(state), snap)
        except fo.StateError:
            ok = None
        assert ok in (None, True)
        if ok is None:
            with pytest.raises(fo.StateError, match="failed"):
                opt.update({k: torch.zeros_like(v) for k, v in params.items()}, state)
    else:  # speculative: exactly as it was, params too, and usable
        assert same(snapshot(state), snap)
        assert all(torch.equal(params[k], p_before[k]) for k in params)


@pytest.mark.parametrize("after", [0, 5])
def test_a_fault_after_a_speculative_step_committed_fails_the_state_it_wrote(after):
    """A streamed step with clipping runs ahead into spare buffers; once ``finish`` knows the
    factor is 1 the leaves not begun run in place. Chunks of 32,768 grads: the last layer's
    weight is chunks 0-3 and begins during backward (ahead); the middle one begins at chunk 4,
    after ``finish`` (the kernel is slowed). A fault at chunk 5 has written the state in place:
    failed, not usable. A fault at chunk 0 wrote only spare buffers: the state is as it was."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    params = dict(model.named_parameters())
    ex = HostExecutor(chunk_bytes=1 << 16, slots=2, threads=2, worker_elements=1)
    opt = fo.chain(fo.clip_by_global_norm(1e6), fo.adamw(1e-2, executor=ex))
    state = opt.init(params)
    snap, p_before = snapshot(state), clone(params)
    x = torch.randn(8, 256).to(torch.bfloat16)
    with slow_host_kernel(0.05), fail_host_kernel(after=after):
        with fo.stream(opt, state) as s:
            model(x).float().square().mean().backward()
        with pytest.raises(fo.HostStepError, match="injected failure of the host kernel on 2.weight"
                           if after else "injected failure of the host kernel on 4.weight"):
            s.finish()
    g = {k: torch.zeros_like(v) for k, v in params.items()}
    if after == 0:
        assert same(snapshot(state), snap)
        assert all(torch.equal(params[k], p_before[k]) for k in params)
        opt.update(g, state)  # usable
    else:
        with pytest.raises(fo.StateError, match="failed"):
            opt.update(g, state)


def test_a_state_in_a_streamed_step_refuses_other_updates():
    model = make_model()
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    with fo.stream(opt, state) as s:
        model(torch.randn(4, 16)).sum().backward()
    g = {k: torch.zeros_like(v) for k, v in params.items()}
    with pytest.raises(fo.StateError, match="in a step"):
        opt.update(g, state)
    params, new = s.finish()
    assert int(new.count) == 1
    with pytest.raises(fo.StateError, match="consumed"):
        opt.update(g, state)
    with pytest.raises(RuntimeError, match="already finished"):
        s.finish()


def test_stream_of_a_detached_state_refuses_and_works_with_params():
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}  # the README's way
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    with pytest.raises(ValueError, match="params=model"):
        fo.stream(opt, state)
    before = clone(params)
    with fo.stream(opt, state, params=model) as s:
        model(torch.randn(4, 16)).square().mean().backward()
    params, state = s.finish()
    assert len(s.arrived) == 6 and int(state.count) == 1
    assert all(not torch.equal(params[k], before[k]) for k in params)
    other = make_model()
    with pytest.raises(ValueError, match="share its memory"):
        fo.stream(opt, state, params=other)


def test_consumed_guard_state_is_refused_after_a_skipped_step():
    params = make_params(big=True)
    opt = fo.apply_if_finite(fo.adamw(1e-2))
    s0 = opt.init(params)
    bad = grad_seq(params, 1)[0]
    bad["scale"][0, 0, 0] = float("nan")
    params, s1 = opt.update(bad, s0)
    assert int(s1.total_notfinite) == 1
    with pytest.raises(fo.StateError, match="consumed"):
        opt.update(grad_seq(params, 1)[0], s0)
    params, s2 = opt.update(grad_seq(params, 1)[0], s1)
    assert int(s2.inner_state.count) == 1


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("wrap", ["clip", "guard", "guard+clip"])
@pytest.mark.parametrize("bad,msg", [
    (lambda g: g.to(torch.int64), r"'scale' has dtype torch.int64"),
    (lambda g: g > 0, r"'scale' has dtype torch.bool"),
    (lambda g: torch.empty(g.shape, device="meta"), r"'scale' is on meta"),
    (lambda g: 1.5, r"'scale' is a float"),
    (lambda g: g.numpy(), r"'scale' is a ndarray"),
])
def test_bad_grads_through_transforms_name_the_leaf(wrap, bad, msg):
    params = make_params(big=True)
    inner = fo.adamw(1e-2)
    opt = {"clip": fo.chain(fo.clip_by_global_norm(1.0), inner), "guard": fo.apply_if_finite(inner),
           "guard+clip": fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), inner))}[wrap]
    state = opt.init(params)
    snap = snapshot(state)
    g = grad_seq(params, 1)[0]
    g["scale"] = bad(g["scale"])
    with pytest.raises((TypeError, ValueError), match=msg):
        opt.update(g, state)
    assert same(snapshot(state), snap)  # nothing changed, still usable


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_params_are_stepped_as_torch_steps_them(kernel):
    """A transposed (non-contiguous) param gets a contiguous master and a strided write-back;
    the delayed update, which lands params through contiguous staging, refuses it at init."""
    w = torch.randn(8, 4)
    grads = [{"t": torch.randn(4, 8), "b": torch.randn(3)} for _ in range(4)]
    ref = {"t": w.t().clone().requires_grad_(), "b": torch.zeros(3, requires_grad=True)}
    torch_opt = torch.optim.AdamW(list(ref.values()), lr=1e-2)
    for g in grads:
        for k, t in ref.items():
            t.grad = g[k].clone()
        torch_opt.step()
    params = {"t": w.clone().t(), "b": torch.zeros(3)}
    opt = fo.adamw(1e-2, cpu_kernel=kernel)
    state = opt.init(params)
    for g in grads:
        params, state = opt.update(g, state)
    assert not params["t"].is_contiguous()
    tol = dict(rtol=0, atol=0) if kernel == "torch" else dict(rtol=1e-6, atol=1e-7)
    for k in ref:
        torch.testing.assert_close(params[k], ref[k].detach(), **tol)
    with pytest.raises(ValueError, match="'t' is not contiguous.*delayed"):
        fo.adamw(1e-2, delayed=STALE).init({"w": torch.randn(4), "t": w.t()})


def test_tied_params_are_refused_at_init():
    w = torch.randn(8, 4)
    with pytest.raises(ValueError, match="'a' and 'b' share memory"):
        fo.adamw(1e-2).init({"a": w, "b": w})
    with pytest.raises(ValueError, match="share memory"):
        fo.adamw(1e-2).init({"a": w[:5], "b": w[4:]})
    fo.adamw(1e-2).init({"a": w[:4], "b": w[4:]})  # adjacent views are fine


def test_grad_tree_mismatch_names_paths_not_tensors():
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    g = {k: torch.zeros_like(v) for k, v in params.items() if k != "3.bias"}
    g["extra"] = torch.zeros(3)
    with pytest.raises(ValueError) as e:
        opt.update(g, state)
    msg = str(e.value)
    assert "missing ['3.bias']" in msg and "unexpected ['extra']" in msg and len(msg) < 600


@pytest.mark.parametrize("lr", [1e38, float("inf")])
def test_unrepresentable_hyperparameters_are_refused_before_any_change(lr):
    with pytest.raises(ValueError, match="lr|float32"):
        fo.adamw(lr)
    params = make_params(big=True)
    opt = fo.adamw(lambda n: 1e-3 if n == 0 else 1e38)
    state = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], state)
    snap = snapshot(state)
    with pytest.raises(ValueError, match="float32"):
        opt.update(grad_seq(params, 1)[0], state)
    assert same(snapshot(state), snap)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_failed_state_recovers_through_dcp(tmp_path, dtype):
    """bf16 params: dcp.load into the failed state recovers it and its params (set from the
    masters loaded); fp32 params (no master) that the failed step changed: refused, naming
    them, and the documented recovery (params restored, a fresh state loaded) is exact."""
    import torch.distributed.checkpoint as dcp
    params = make_params(dtype=dtype, big=True)
    grads = grad_seq(params, 3)
    opt = fo.adamw(1e-2, executor=small_chunks())
    state = opt.init(params)
    params, state = opt.update(grads[0], state)
    dcp.save({"optim": fo.dcp.state_dict(state)}, checkpoint_id=tmp_path / "ck")
    saved, kept = snapshot(state), clone(params)
    with fail_host_kernel(after=1):
        with pytest.raises(fo.HostStepError):
            opt.update(grads[1], state)
    with pytest.raises(fo.StateError, match="failed"):
        fo.dcp.state_dict(state)
    if dtype == torch.float32:
        assert not same(flat(params), flat(kept))  # half stepped
        with pytest.raises(fo.StateError, match="no master copy.*opt.init"):
            fo.dcp.state_dict(state, loading=True)
        optree.tree_map(lambda p, k: p.detach().copy_(k), params, kept)  # the model's checkpoint
        state = opt.init(params)
    dcp.load({"optim": fo.dcp.state_dict(state, loading=True)}, checkpoint_id=tmp_path / "ck",
             planner=fo.dcp.StrictLoadPlanner())
    fo.flush(state)
    assert same(snapshot(state), saved) and same(flat(params), flat(kept))
    for g in grads[1:]:
        params, state = opt.update(g, state)
    ref_p, ref_s = run_reference(lambda: fo.adamw(1e-2, executor=small_chunks()),
                                 make_params(dtype=dtype, big=True), grads)
    assert same(flat(params), flat(ref_p)) and same(snapshot(state), snapshot(ref_s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_documented_recovery_restores_params_too(tmp_path, dtype):
    """A failed in-place step changed part of the params. With masters (bf16 params) fo.load
    alone puts them back (from the masters loaded); without (fp32 params, updated in place)
    fo.load into the failed state is refused before anything changes, naming the params, and
    the recovery it names (params from the model's checkpoint, a fresh state) is exact: either
    way the next updates equal a run that never failed."""
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(40000, generator=g).to(dtype)}
    grads = [{k: torch.randn(v.shape, generator=g).to(dtype) for k, v in base.items()} for _ in range(3)]
    opt = fo.adamw(1e-2, executor=small_chunks())
    params = clone(base)
    state = opt.init(params)
    params, state = opt.update(grads[0], state)
    fo.save(state, tmp_path / "opt")
    kept = clone(params)
    with fail_host_kernel(after=3):
        with pytest.raises(fo.HostStepError):
            opt.update(grads[1], state)
    assert not torch.equal(params["w"], kept["w"])  # half stepped
    if dtype == torch.float32:
        with pytest.raises(fo.StateError, match=r"'w'.*no master copy.*opt\.init\(params\)"):
            fo.load(tmp_path / "opt", like=state)
        assert not torch.equal(params["w"], kept["w"])  # the refusal changed nothing
        for k in params:
            params[k].copy_(kept[k])
        state = fo.load(tmp_path / "opt", like=opt.init(params))
    else:
        state = fo.load(tmp_path / "opt", like=state)
    assert same(params, kept)
    for gs in grads[1:]:
        params, state = opt.update(gs, state)
    ref_p, ref_s = run_reference(lambda: fo.adamw(1e-2, executor=small_chunks()), base, grads)
    assert same(params, ref_p) and same(snapshot(state), snapshot(ref_s))


# ---- found by trying to break it ---------------------------------------------------------

def test_two_threads_cannot_step_one_state_at_once():
    params = make_params(big=True)
    opt = fo.sgd(0.1, executor=small_chunks())
    state = opt.init(params)
    g = grad_seq(params, 1)[0]
    errors, results = [], []

    def step():
        try:
            results.append(opt.update(g, state))
        except fo.StateError as e:
            errors.append(e)

    with slow_host_kernel(0.02):
        threads = [threading.Thread(target=step) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(results) == 1 and len(errors) == 1  # applied once, refused once


def test_a_save_racing_an_update_is_refused_or_whole(tmp_path):
    params = make_params(big=True)
    opt = fo.adamw(1e-2, executor=small_chunks())
    state = opt.init(params)
    holder, stop = [state], threading.Event()

    def train():
        while not stop.is_set():
            try:
                _, holder[0] = opt.update(grad_seq(params, 1)[0], holder[0])
            except fo.StateError:  # the state is being saved: try again
                pass

    t = threading.Thread(target=train)
    with slow_host_kernel(0.001):
        t.start()
        saved = 0
        for _ in range(30):
            try:
                fo.save(holder[0], tmp_path / "ck")
                saved += 1
            except fo.StateError:
                pass
        stop.set()
        t.join(30)
    if saved:
        fo.load(tmp_path / "ck", like=opt.init(clone(params)))  # a whole step: CRCs hold


def test_ctrl_c_during_load_loads_all_of_it_or_nothing(tmp_path):
    """Ctrl-C at any moment of a load: ``like`` holds all of the checkpoint or none of it."""
    params = make_params(big=True)
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], state)
    fo.save(state, tmp_path / "ck")
    saved, fresh = snapshot(state), snapshot(opt.init(clone(params)))
    start = time.perf_counter()
    fo.load(tmp_path / "ck", like=opt.init(clone(params)))
    took = time.perf_counter() - start
    for k in range(12):  # interrupts spread over the load's duration
        like = opt.init(clone(params))
        try:
            with interrupt_after(took * k / 10):
                fo.load(tmp_path / "ck", like=like)
                time.sleep(took)  # an interrupt after the load lands here
        except KeyboardInterrupt:
            pass
        got = snapshot(like)
        assert same(got, saved) or same(got, fresh), f"torn by an interrupt at {k / 10:.1f} of the load"


def test_counts_below_zero_are_refused_on_load():
    opt = fo.adamw(1e-2)
    s = opt.init({"w": torch.zeros(4)})
    for bad in (-1, -2, -3, -7):
        sd = dict(fo.state_dict(s), count=torch.tensor(bad))
        with pytest.raises(fo.CheckpointError, match="count"):
            fo.load_state_dict(sd, s)


def test_none_in_the_params_tree_is_no_leaf():
    params = {"a": torch.zeros(4), "b": None, "c": torch.zeros(3)}
    opt = fo.chain(fo.clip_by_global_norm(1e9), fo.sgd(lr=1.0))
    state = opt.init(params)
    params, state = opt.update({"a": torch.ones(4), "b": None, "c": torch.ones(3)}, state)
    assert params["c"].eq(-1).all() and params["a"].eq(-1).all()
    with pytest.raises(ValueError, match="'c' has shape"):
        opt.update({"a": torch.ones(4), "b": None, "c": torch.ones(7)}, state)


def test_flush_refuses_failed_and_consumed_states_and_a_load_clears_a_failed_step(tmp_path):
    params = make_params(big=True)
    opt = fo.sgd(0.1, momentum=0.9, delayed=STALE, executor=small_chunks())
    s0 = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], s0)
    with pytest.raises(fo.StateError, match="consumed"):
        fo.flush(s0)
    fo.save(state, tmp_path / "ck")
    with fail_host_kernel(after=1):
        params, state = opt.update(grad_seq(params, 1, seed=2)[0], state)
        with pytest.raises(fo.HostStepError):
            fo.flush(state)
    with pytest.raises(fo.StateError, match="failed"):
        fo.flush(state)
    state = fo.load(tmp_path / "ck", like=state)
    params, state = opt.update(grad_seq(params, 1, seed=3)[0], state)  # the old error is gone
    fo.flush(state)


def test_grads_that_are_their_params_and_fp8_params_are_refused():
    w = torch.linspace(-1, 1, 8)
    opt = fo.adamw(0.1)
    state = opt.init({"w": w})
    with pytest.raises(ValueError, match="shares memory with its param"):
        opt.update({"w": w}, state)
    m = torch.linspace(-1, 1, 16).view(4, 4)
    for opt in (fo.adamw(0.1), fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(0.1))):
        state = opt.init({"m": m})
        for alias in (m[1].expand(4, 4), m.as_strided((4, 4), (0, 1), 1)):  # other addresses
            with pytest.raises(ValueError, match="grad 'm' shares memory with its param"):
                opt.update({"m": alias}, state)
    with pytest.raises(TypeError, match="fp32, bf16, fp16 or fp64"):
        fo.adamw(0.1).init({"w": torch.zeros(4).to(torch.float8_e5m2)})


@pytest.mark.parametrize("n", [37, 80_000], ids=["packed", "alone"])
@pytest.mark.parametrize("delay", [False, fo.Delay(), fo.Delay(lookahead=False)],
                         ids=["plain", "ahead", "stale"])
def test_a_grad_in_another_params_memory_is_refused_before_the_step(delay, n):
    """``grads["b"] = params["a"]`` (or a view of it): the step would change ``a`` while it
    reads ``b``'s grad. Refused naming both, the state unchanged and usable."""
    params = {k: torch.randn(n, generator=torch.Generator().manual_seed(i))
              for i, k in enumerate("ab")}
    before = clone(params)
    opt = fo.sgd(0.1, delayed=delay)
    state = opt.init(params)
    for alias in (params["a"], params["a"].view(1, n)[0]):
        with pytest.raises(ValueError, match="grad 'b' lies in the memory of param 'a'"):
            opt.update({"a": torch.ones(n), "b": alias}, state)
        for k in params:
            assert torch.equal(params[k], before[k]), k
    params, state = opt.update({"a": torch.ones(n), "b": params["a"].clone()}, state)
    fo.flush(state)
    assert torch.equal(params["b"], before["b"] - 0.1 * before["a"])


def test_ctrl_c_while_a_streamed_step_is_dropped_is_raised():
    """apply_if_finite drops a streamed step whose grads are not finite; Ctrl-C meanwhile still
    arrives as itself, the state as it was."""
    w = {f"l{i}": torch.randn(70000, dtype=torch.bfloat16, requires_grad=True) for i in range(3)}
    opt = fo.apply_if_finite(fo.adamw(1e-2, executor=small_chunks()))
    state = opt.init(w)
    snap = snapshot(state)
    finite = sum(w[k].float().square().sum() for k in ("l1", "l2"))
    nan = (w["l0"].float() * float("nan")).sum()
    with slow_host_kernel(1.0):
        with fo.stream(opt, state) as s:
            finite.backward()  # host work on l1, l2 starts (and takes a second)
            nan.backward()  # the last grad is not finite: finish drops the step
        time.sleep(0.2)  # the first host chunk has started (it takes a second)
        with pytest.raises(KeyboardInterrupt), interrupt_after(0.05):
            s.finish()
    assert same(snapshot(state), snap)


def test_torch_optimizer_groups_fail_together():
    """A failure in a later param group after an earlier one stepped: the optimizer is torn, so
    every group is marked failed and a state_dict is refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    opt = fo.TorchOptimizer([{"params": model[0].parameters()}, {"params": model[1].parameters()}],
                            fo.adamw, lr=1e-2, executor=small_chunks())
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    with fail_host_kernel(after=3):
        with pytest.raises(fo.HostStepError):
            opt.step()
    with pytest.raises(fo.StateError):
        opt.state_dict()


def test_torch_optimizer_delayed_recovers_by_load_state_dict():
    """A delayed step that failed in the background: the next ``step`` names
    ``load_state_dict`` as the way back, and loading a checkpoint there recovers (it drops the
    failed step instead of trying to land it); training then goes on as from the checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = fo.TorchOptimizer(model.parameters(), fo.adamw, lr=1e-2, delayed=STALE,
                            executor=small_chunks())
    x = torch.randn(8, 64)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    good = opt.state_dict()
    with fail_host_kernel(after=1):
        step()  # fails in the background
        with pytest.raises(fo.HostStepError):
            step()
    with pytest.raises(fo.StateError, match="load_state_dict"):
        step()
    opt.load_state_dict(good)
    step()
    opt.flush()
    assert int(opt.state_dict()["state"][0]["step"]) == 2


def test_ctrl_c_while_a_stream_is_set_up_leaves_no_busy_state_and_no_hooks():
    """Ctrl-C at any moment of ``with fo.stream(...)``'s set-up: the state stays usable and no
    hook outlives the block (a later backward changes nothing)."""
    w = {f"p{i:04d}": torch.randn(4, requires_grad=True) for i in range(3000)}
    opt = fo.adamw(1e-3)
    state = opt.init(w)
    start = time.perf_counter()
    with pytest.raises(ZeroDivisionError):
        with fo.stream(opt, state):
            1 / 0  # an error in the block aborts the step
    took = time.perf_counter() - start
    steps = 0
    for k in range(12):
        try:
            with interrupt_after(took * k / 10):
                with fo.stream(opt, state) as s:
                    time.sleep(2 * took + 0.5)  # an interrupt after the set-up lands here
            # Python drops an interrupt that lands in a finalizer (a weakref callback run by the
            # garbage collector): the block then ended normally, and its step is finished
            _, state = s.finish()
            steps += 1
        except KeyboardInterrupt:
            pass
        before = {n: v.detach().clone() for n, v in w.items()}
        sum(v.sum() for v in w.values()).backward()  # no hook may feed these grads anywhere
        assert all(torch.equal(before[n], v) for n, v in w.items())
        for v in w.values():
            v.grad = None
    params, state = opt.update({n: torch.ones(4) for n in w}, state)  # usable
    assert int(state.count) == steps + 1


@pytest.mark.parametrize("clip", [False, True])
def test_a_grad_changed_after_it_was_streamed_aborts_the_step(clip):
    """Grads unscaled by hand between backward and finish: the steps that ran ahead used the
    old values, so finish aborts (nothing applied: the state as it was) and names the leaf."""
    w = {f"l{i}": torch.randn(70000, requires_grad=True) for i in range(3)}
    terminal = fo.adamw(1e-2, executor=small_chunks())
    opt = fo.chain(fo.clip_by_global_norm(1e9), terminal) if clip else fo.apply_if_finite(terminal)
    state = opt.init(w)
    snap = snapshot(state)
    with fo.stream(opt, state) as s:
        sum(v.square().sum() for v in w.values()).backward()
    w["l1"].grad.div_(1024.0)
    with pytest.raises(ValueError, match="'l1' was changed after"):
        s.finish()
    assert same(snapshot(state), snap)
    opt.update({k: v.grad for k, v in w.items()}, state)  # usable


def test_a_streamed_step_refuses_a_master_that_no_longer_fits_before_any_leaf_starts():
    """One param made fp64 (its fp32 master no longer fits it) and another fed first: the
    step refuses naming it before the other starts in place, the state usable."""
    w = {k: torch.randn(70_000, generator=torch.Generator().manual_seed(i)).bfloat16().requires_grad_()
         for i, k in enumerate(("w1", "w2"))}
    opt = fo.adamw(1e-2)
    state = opt.init(w)
    w["w1"].data = w["w1"].data.double()
    with pytest.raises(TypeError, match="param 'w1' is torch.float64 now"):
        with fo.stream(opt, state) as s:  # w2's grad arrives first
            ((w["w1"] * 2).sum() + (w["w2"] * 3).sum()).backward()
        s.finish()
    assert int(state.count) == 0
    w["w1"].data = w["w1"].data.bfloat16()
    opt.update({k: torch.ones_like(p) for k, p in w.items()}, state)


@pytest.mark.parametrize("stepped", [False, True], ids=["before-first", "between"])
@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("change", ["resized", "widened"])
def test_a_param_changed_after_init_is_refused_at_the_first_update_too(change, kernel, stepped):
    """A param resized (``param.data = smaller``) or widened past its master (bf16 -> fp64)
    after ``init`` is refused naming it before anything changes, at the first update as at
    later ones (the first update used to take the params as they were then: a resized bf16
    param was overwritten from the old master's first elements, silently)."""
    torch.manual_seed(0)
    params = {"b": torch.randn(64).bfloat16(), "w": torch.randn(64, 64).bfloat16()}
    opt = fo.adamw(1e-2, cpu_kernel=kernel)
    state = opt.init(params)
    grads = lambda: {k: torch.randn(p.shape).to(p.dtype) for k, p in params.items()}  # noqa: E731
    if stepped:
        params, state = opt.update(grads(), state)
    before = {k: p.clone() for k, p in params.items()}
    if change == "resized":
        params["w"].data = torch.randn(32, 32).bfloat16()
        err, match = ValueError, r"param 'w' now has 1024 elements but its optimizer state was made for 4096"
    else:
        params["w"].data = params["w"].data.double()
        err, match = TypeError, r"param 'w' is torch.float64 now, but its state keeps a torch.float32 master"
    with pytest.raises(err, match=match):
        opt.update(grads(), state)
    assert torch.equal(params["b"], before["b"]) and int(state.count) == int(stepped)
    fo.state_dict(state)  # usable: not marked failed


@pytest.mark.parametrize("stepped", [False, True], ids=["before-first", "between"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 4), (36,), (2, 2, 9)])
def test_adafactor_refuses_a_param_reshaped_before_the_step(shape, dtype, stepped):
    """Adafactor's factored moments follow the param's shape: a param reshaped (same elements)
    after init or between updates is refused naming it, before the step changes any other
    param, the state usable once it is reshaped back."""
    params = {"a": torch.randn(5), "w": torch.randn(4, 9).to(dtype)}
    opt = fo.adafactor(1e-2)
    state = opt.init(params)
    if stepped:
        params, state = opt.update({k: torch.randn(v.shape).to(v.dtype) for k, v in params.items()}, state)
    a = params["a"].clone()
    params["w"].data = params["w"].data.reshape(shape)
    with pytest.raises(ValueError, match=r"param 'w' is .* now, but its state was laid out for "
                                         r"another shape"):
        opt.update({k: torch.randn(v.shape).to(v.dtype) for k, v in params.items()}, state)
    assert torch.equal(params["a"], a) and int(state.count) == int(stepped)
    params["w"].data = params["w"].data.reshape(4, 9)
    opt.update({k: torch.randn(v.shape).to(v.dtype) for k, v in params.items()}, state)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("delay", [False, fo.Delay()], ids=["plain", "delayed"])
def test_a_param_replaced_in_the_tree_the_state_holds_is_refused_naming_it(nested, delay):
    """``params["b"] = tensor`` on the dict the state holds: the state would go on stepping the
    old tensor. Refused naming it, the state usable once the param is put back."""
    inner = {"a": torch.randn(37).bfloat16(), "b": torch.randn(37).bfloat16()}
    params = {"m": inner} if nested else inner
    opt = fo.sgd(0.1, delayed=delay)
    state = opt.init(params)
    grads = lambda: optree.tree_map(torch.ones_like, params)  # noqa: E731
    params, state = opt.update(grads(), state)
    old = inner["b"]
    inner["b"] = old.clone()
    path = "m.b" if nested else "b"
    with pytest.raises(ValueError, match=f"param '{path}' was replaced in the params tree"):
        opt.update(grads(), state)
    inner["b"] = old
    params, state = opt.update(grads(), state)
    fo.flush(state)


@pytest.mark.parametrize("which, named", [("b", ("a", "b", "c")), ("big", ("big",))])
def test_a_fault_aimed_at_a_small_leaf_hits_its_packed_run(which, named):
    """``fail_host_kernel(leaves=...)`` counts the chunks holding a leaf, whether it runs alone
    or packed with other small leaves (not only as a run's first leaf); the error names each
    member of the run (``HostStepError.leaves``, kept through pickling)."""
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(n, generator=g).bfloat16() for k, n in  # (masters: packed)
              (("big", 100_000), ("a", 300), ("b", 200), ("c", 100))}
    opt = fo.adamw(1e-2, executor=small_executor())
    state = opt.init(params)
    with fail_host_kernel(leaves=[which]):
        with pytest.raises(fo.HostStepError, match=", ".join(map(repr, named))) as e:
            opt.update({k: torch.ones_like(p) for k, p in params.items()}, state)
    assert set(named) <= set(e.value.leaves)  # (and the other leaves of the failed chunk)
    copy = pickle.loads(pickle.dumps(e.value))
    assert (type(copy), str(copy), copy.leaves) == (fo.HostStepError, str(e.value), e.value.leaves)
    assert "injected failure" in str(e.value.__cause__)
    if which == "b":
        assert "on a, b, c" in str(e.value.__cause__)  # (each member of the packed run)


def test_fail_host_kernel_refuses_a_string_and_warns_where_no_chunk_held_its_leaves():
    """``leaves="l1"`` would match paths by substring: refused; paths no chunk held: the block
    warns that nothing was injected (a recovery test would otherwise test nothing)."""
    with pytest.raises(TypeError, match=r"use leaves=\['big'\]"):
        with fail_host_kernel(leaves="big"):
            pass
    params = {"big": torch.randn(100_000).bfloat16(), "a": torch.randn(300).bfloat16()}
    opt = fo.adamw(1e-2, executor=small_executor())
    state = opt.init(params)
    with pytest.warns(UserWarning, match=r"leaves=\['bigg'\].*none holding"):
        with fail_host_kernel(leaves=["bigg"]):
            params, state = opt.update({k: torch.ones_like(p) for k, p in params.items()}, state)
