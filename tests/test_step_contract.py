"""The failure contract where a step meets its wrappers and its callers: a step that changed
nothing leaves every state of a chain usable; a Ctrl-C at any point of an update leaves the
state usable or holding the step, never busy; an exception in a streamed backward has one
outcome whatever the timing; a param whose dtype no longer fits its master is refused first."""

import gc
import os
import signal
import sys

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.state import CONSUMED, terminal_counts
from functional_offload.executor import HostExecutor
from functional_offload.testing import fail_host_kernel, slow_host_kernel
from conftest import STALE, clone, delay_of, grad_seq, make_params
from registry import OPTIMIZERS


def small_chunks():
    return HostExecutor(chunk_bytes=4096, slots=2, threads=2, worker_elements=1)


def snapshot(state):
    return {k: v.clone() for k, v in fo.state_dict(state).items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def chains(entry):
    """``entry``'s optimizer on the host, alone and behind wrappers whose state has marks."""
    host = lambda: entry.make(**entry.hypers, placement=fo.placement.on_host(),  # noqa: E731
                              executor=small_chunks())
    return {
        "alone": host,
        "clip": lambda: fo.chain(fo.clip_by_global_norm(1.0), host()),
        "injected clip": lambda: fo.chain(fo.inject_hyperparams(fo.clip_by_global_norm)(max_norm=1.0),
                                          host()),
        "finite guard": lambda: fo.chain(fo.apply_if_finite(fo.scale(1.0)), host()),
    }


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=lambda e: e.name)
@pytest.mark.parametrize("form", ["alone", "clip", "injected clip", "finite guard"])
def test_a_step_whose_first_host_work_fails_leaves_every_state_usable(entry, form):
    """The host work fails before any of it ran: every state of the chain is as it was and
    usable (element-wise and leaf-by-leaf optimizers alike; a transform in front that already
    ran is not consumed by a step that did not happen); the next update equals a clean one."""
    params = make_params(big=True)
    grads = grad_seq(params, 1)
    opt = chains(entry)[form]()
    state = opt.init(clone(params))
    before = snapshot(state)
    with fail_host_kernel(after=0):
        with pytest.raises(fo.HostStepError):
            opt.update(grads[0], state)
    assert same(snapshot(state), before)
    p, _ = opt.update(grads[0], state)
    ref = chains(entry)[form]()
    q, _ = ref.update(grads[0], ref.init(clone(params)))
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(p), optree.tree_leaves(q)))


def _lines_in_update(run):
    """How many line events of functional_offload's code ``run()`` goes through, and how many
    had passed when the outermost shielded call returned (the step's work and marks done)."""
    count, ended = [0], [None]

    def trace(frame, event, arg):
        if "functional_offload" in frame.f_code.co_filename:
            if event == "line":
                count[0] += 1
            elif (event == "return" and frame.f_code.co_name == "shielded"
                  and frame.f_back.f_code.co_name != "shielded" and ended[0] is None
                  and frame.f_back.f_code.co_filename.endswith("terminal.py")):
                ended[0] = count[0]
            return trace
        return None

    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(None)
    return count[0], ended[0]


def _sigint_at_line(k):
    """A trace function that sends SIGINT to this process at the ``k``-th line event of
    functional_offload's code: its handler runs at the next point Python checks for signals,
    as for a real Ctrl-C arriving there."""
    seen = [0]

    def trace(frame, event, arg):
        if "functional_offload" in frame.f_code.co_filename:
            if event == "line":
                seen[0] += 1
                if seen[0] == k:
                    os.kill(os.getpid(), signal.SIGINT)
            return trace
        return None

    return trace


@pytest.mark.parametrize("form", ["plain", "chain", "delayed", "ahead"])
def test_ctrl_c_anywhere_in_an_update_leaves_the_state_usable_or_holding_the_step(form):
    """A Ctrl-C at every line an update runs through, one per run: the update either returns,
    or raises KeyboardInterrupt with the state passed in usable — as it was, or holding the
    step exactly (its count says which) — never left in a step or failed. Consumed with the
    step in the new state only once the update's work has ended and it is returning (as a
    Ctrl-C just after it returned would leave it)."""
    if threading_is_not_main():
        pytest.skip("signals reach the main thread only")
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(3000, generator=g), "b": torch.randn(30, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in base.items()}

    def make():
        opt = fo.adamw(1e-2, placement=fo.placement.on_host(), executor=small_chunks(),
                       delayed=delay_of(form))
        return fo.chain(fo.clip_by_global_norm(1.0), opt) if form == "chain" else opt

    ref = make()
    _, ref_state = ref.update(grads, ref.init(clone(base)))
    stepped = snapshot(ref_state)  # (lands a delayed step)
    opt = make()
    opt.update(grads, opt.init(clone(base)))  # (what the first update of an executor sets up)
    fresh = opt.init(clone(base))
    total, ended = _lines_in_update(lambda: opt.update(grads, fresh))
    assert total > 50 and ended is not None
    outcomes = set()
    for k in range(1, total + 1):
        state = opt.init(clone(base))
        before = snapshot(state)
        sys.settrace(_sigint_at_line(k))
        try:
            _, new = opt.update(grads, state)
            sys.settrace(None)
            assert same(snapshot(new), stepped), k  # (the signal came after its last line)
        except KeyboardInterrupt:
            sys.settrace(None)
            if terminal_counts(state) == [CONSUMED] and k >= ended:
                outcomes.add("consumed while returning")
                continue
            now = snapshot(state)  # raises StateError if busy, consumed or failed
            if same(now, before):
                outcomes.add("as it was")
            else:
                assert same(now, stepped), k
                outcomes.add("holds the step")
        finally:
            sys.settrace(None)
    assert outcomes >= {"as it was", "holds the step"}


def threading_is_not_main():
    import threading
    return threading.current_thread() is not threading.main_thread()


@pytest.mark.parametrize("slow", [0.0, 0.05])
def test_an_exception_in_a_streamed_backward_has_one_outcome_whatever_the_timing(slow):
    """An exception inside ``fo.stream`` after host leaves were handed to in-place work: the
    state is failed whether that work had begun (fast kernel) or not (a slow one), so the
    outcome does not depend on timing; run ahead speculatively (clipping in front), it is
    usable and as it was either way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    x = torch.randn(8, 64)
    for clipped in (False, True):
        opt = fo.adamw(1e-2, placement=fo.placement.on_host(), executor=small_chunks())
        if clipped:
            opt = fo.chain(fo.clip_by_global_norm(1.0), opt)
        state = opt.init(dict(model.named_parameters()))
        before = snapshot(state)

        def fail_after_the_last_layer(grad):
            raise RuntimeError("a failure in backward")

        handle = model[0].weight.register_hook(fail_after_the_last_layer)
        try:
            with slow_host_kernel(slow):
                with pytest.raises(RuntimeError, match="a failure in backward"):
                    with fo.stream(opt, state):
                        model(x).sum().backward()
        finally:
            handle.remove()
            model.zero_grad(set_to_none=True)
        if clipped:
            assert same(snapshot(state), before)
        else:
            with pytest.raises(fo.StateError, match="failed"):
                fo.state_dict(state)


def test_a_param_whose_dtype_no_longer_fits_its_master_is_refused_before_the_step():
    """``module.double()`` after ``init`` of a delayed state (its host leaves keep fp32
    masters): the next update raises a TypeError naming the param before anything changed
    (it used to fail in the host kernel, mid-step), and the state stays usable."""
    model = torch.nn.Linear(16, 16)
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=STALE)
    state = opt.init(params)
    model(torch.randn(4, 16)).sum().backward()
    _, state = opt.update({k: v.grad for k, v in params.items()}, state)
    fo.flush(state)
    before = snapshot(state)
    model.zero_grad(set_to_none=True)
    model.double()
    model(torch.randn(4, 16, dtype=torch.float64)).sum().backward()
    with pytest.raises(TypeError, match="param '(bias|weight)' is torch.float64 now.*float32 master"):
        opt.update({k: v.grad for k, v in params.items()}, state)
    assert same(snapshot(state), before)


@pytest.mark.parametrize("delayed", [False, True])
def test_an_update_leaves_no_reference_cycle(delayed):
    """A step's objects go with their last reference: a cycle would keep its buffers (a delayed
    step's copies of the grads on the GPU) until a full garbage collection."""
    params = {f"blocks.{i}.w": torch.randn(300, 300) for i in range(3)}
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=1e-3, delayed=delayed))
    state = opt.init(params)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    params, state = opt.update(grads, state)  # warm: first-use caches
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            params, state = opt.update(grads, state)
        fo.flush(state)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [], sorted(set(left))


def test_a_signal_handler_replaced_between_updates_is_the_one_kept():
    """An update holds the process's Python signal handlers while it runs and puts them back:
    the ones set now, also when a new handler compares equal to the one before."""
    import dataclasses

    @dataclasses.dataclass
    class Handler:
        def __call__(self, signum, frame):
            pass

    first, second = Handler(), Handler()
    assert first == second and first is not second
    old = signal.getsignal(signal.SIGUSR1)
    params = {"w": torch.zeros(4)}
    opt = fo.adamw(1e-2, placement=fo.placement.on_host())
    state = opt.init(params)
    try:
        for handler in (first, second):
            signal.signal(signal.SIGUSR1, handler)
            params, state = opt.update({"w": torch.ones(4)}, state)
            assert signal.getsignal(signal.SIGUSR1) is handler
    finally:
        signal.signal(signal.SIGUSR1, old)
