"""Activation offload: gradients identical to no offload, hygiene, and the errors that name fixes.

On the CPU the hooks are a pass-through by default; objects made under ``testing.copy_on_cpu()``
run the copies through the pinned-pool bookkeeping with deferred copies (a copy runs when it is
waited for, so sources stay in flight as on a GPU): dedup, the in-flight bound, prefetch and
release are exercised here.
"""

import contextlib
import gc
import weakref

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.activations import ActivationOffload
from functional_offload.activations.testing import copy_on_cpu, manual_clock

D, GROUPS = 32, 4


def make(*args, copy=False, **kwargs):
    """An ActivationOffload; ``copy``: one that copies CPU tensors (made under copy_on_cpu)."""
    with copy_on_cpu() if copy else contextlib.nullcontext():
        return fo.ActivationOffload(*args, **kwargs)


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"b{i}": {"w1": torch.randn(4 * D, D, generator=g) / D ** 0.5,
                      "w2": torch.randn(D, 4 * D, generator=g) / (4 * D) ** 0.5} for i in range(GROUPS)}


def forward(params, x, off=None):
    for i in range(GROUPS):
        with off.group(i) if off else torch.enable_grad():
            p = params[f"b{i}"]
            h = torch.nn.functional.gelu(x @ p["w1"].t())
            x = x + h @ p["w2"].t()
    return x.square().mean()


def reference_grads(params, x):
    leaves, spec = optree.tree_flatten(params)
    inputs = [p.detach().requires_grad_() for p in leaves]
    loss = forward(optree.tree_unflatten(spec, inputs), x)
    return loss.detach(), optree.tree_unflatten(spec, list(torch.autograd.grad(loss, inputs)))


def assert_same(got, want):
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("offload", [GROUPS - 1, 0.5, 0])
def test_value_and_grad_bit_identical(copy, offload):
    params, x = make_params(), torch.randn(64, D)
    off = make(GROUPS, offload, min_bytes=0, copy=copy)
    loss, grads = off.value_and_grad(lambda p, x: forward(p, x, off))(params, x)
    want_loss, want = reference_grads(params, x)
    assert torch.equal(loss, want_loss)
    assert_same(grads, want)
    assert (off.stats["offloaded_bytes"] > 0) == (copy and off.offloaded_groups > 0)
    assert off.held_bytes == 0  # released at the end of backward


def blocks_and_input(seed=0):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                                     torch.nn.Linear(4 * D, D)) for _ in range(GROUPS))
    blocks.register_buffer("scale", torch.full((D,), 0.5))
    return blocks, torch.randn(16, D)


def test_module_loop_with_backward_and_no_leak():
    blocks, x = blocks_and_input()
    off = make(GROUPS, GROUPS - 1, min_bytes=0, copy=True)

    def run(offload):
        blocks.zero_grad(set_to_none=True)
        with off.record(exclude=blocks) if offload else torch.enable_grad():
            h = x
            for i, b in enumerate(blocks):
                with off.group(i) if offload else torch.enable_grad():
                    h = h + b(h) * blocks.scale
            loss = h.square().mean()
        loss.backward()
        return [p.grad.clone() for p in blocks.parameters()]

    want = run(False)
    for step in range(100):
        got = run(True)
        assert off.held_bytes == 0
        if step == 0:
            pooled = off.pinned_bytes
            assert_same(got, want)
    assert off.pinned_bytes == pooled  # no growth over 100 steps


def test_params_buffers_and_small_tensors_stay():
    w = torch.randn(64, 64, requires_grad=True)
    buf = torch.randn(64, 64)
    off = make(2, 1, min_bytes=1024, copy=True)
    with off.record(exclude={"buf": buf}), off.group(0):
        y = (w * 2).sum() + (w.t() * 3).sum()  # a param and a view of it
        y = y + (torch.randn(8, requires_grad=True) * buf[0, :8]).sum()  # 32 bytes < min_bytes
        y = y + (buf * torch.ones(64, 64, requires_grad=True)).sum()  # an excluded buffer
    assert off.stats["offloaded_bytes"] == 0
    y.backward()
    with off.record(), off.group(0):
        h = w * 2  # an activation of 16 KiB
        (h * h).sum().backward()
    assert off.stats["offloaded_bytes"] == 64 * 64 * 4
    with off.record(), off.group(1):
        h = w * 2
        (h * h).sum().backward()  # the last group is never offloaded
    assert off.stats["offloaded_bytes"] == 64 * 64 * 4


def test_views_of_one_storage_are_copied_once():
    off = make(2, 1, min_bytes=0, copy=True)
    a = torch.randn(32, 32, requires_grad=True)
    with off.record(exclude=[a]), off.group(0):
        h = a * 2
        y = h.sin().sum() + h.view(-1).cos().sum() + h.t().pow(3).sum()  # three views of h saved
    assert off.stats["tensors"] == 1 and off.stats["offloaded_bytes"] == 32 * 32 * 4
    y.backward()
    ref = a.detach().requires_grad_()
    h = ref * 2
    (h.sin().sum() + h.view(-1).cos().sum() + h.t().pow(3).sum()).backward()
    assert torch.equal(a.grad, ref.grad)


@pytest.mark.parametrize("lands", ["waited", "issued"])
def test_a_storage_saved_again_after_an_inplace_change_is_copied_again(lands):
    """A storage saved, changed in place, and saved again in one group (the first save's node
    never reached in backward, e.g. a norm only logged): the second save gets a copy of its
    own, of the changed bytes, not the first one's, which may have landed before the change."""
    def loss(w, x, off=None):
        with off.group(0) if off else contextlib.nullcontext():
            t = x @ w
            stat = t.norm()  # saves t, never backpropagated
            t.mul_(0.5)
            y = t.sin()  # saves t again, changed
        with off.group(1) if off else contextlib.nullcontext():
            return y.sum() + 0 * stat.detach()

    w0, x = torch.randn(16, 16), torch.randn(16, 16)
    w = w0.clone().requires_grad_()
    want = torch.autograd.grad(loss(w, x), w)[0]
    with copy_on_cpu(lands):
        off = fo.ActivationOffload(2, offload=1, min_bytes=0)
    _, got = off.value_and_grad(lambda w, x: loss(w, x, off))(w0, x)
    assert torch.equal(got, want) and off.stats["tensors"] >= 2


@pytest.mark.parametrize("how", ["keyword", "in a list"])
def test_a_recomputed_group_s_keyword_or_nested_input_changed_in_place_raises(how):
    """A recomputed group's tensor inputs given as keywords or inside a container are kept and
    checked as positional ones are: changed in place after the group, backward raises instead
    of recomputing from the changed values."""
    w = torch.randn(8, 8, requires_grad=True)
    off = ActivationOffload(2, offload=0, recompute_groups=[0])
    block = lambda x, w: ((x + 1) @ w).sin()  # noqa: E731 (x itself is saved by no op)
    with off.record():
        h = torch.randn(4, 8)
        y = (off.run(0, block, x=h, w=w) if how == "keyword"
             else off.run(0, lambda xs, w: block(xs[0], w), [h], w))
        y = off.run(1, torch.tanh, y)
        h.add_(5.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("view", ["conj", "neg", "fft"])
def test_conjugate_and_negative_views_keep_their_flag(view):
    """A saved conjugate (or negative) view's flag is part of its value: such tensors stay
    where they are (a raw copy would bring back the values without it, and backward would use
    the unconjugated ones); the grads equal those without offload, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, dtype=torch.complex64, generator=g)
    k = torch.randn(256, generator=g)
    w0 = torch.randn(256, dtype=torch.complex64 if view == "conj" else torch.float32, generator=g)

    def loss(w: torch.Tensor) -> torch.Tensor:
        if view == "conj":
            return (x.conj() * w).real.square().sum()  # mul saves the conjugate view
        if view == "neg":
            return (torch.complex(w.detach() * 0, k).conj().imag * w).square().sum()  # neg view
        return torch.fft.irfft(torch.fft.rfft(w) * torch.fft.rfft(k).conj()).square().sum()

    if view == "fft":
        w0 = torch.randn(256, generator=g)
    ref = w0.clone().requires_grad_()
    loss(ref).backward()
    off = make(2, 1, min_bytes=0, copy=True)
    w = w0.clone().requires_grad_()
    with off.record():
        with off.group(0):
            y = loss(w)
        with off.group(1):
            y = y * 1.0
    y.backward()
    assert torch.equal(w.grad, ref.grad)


@pytest.mark.parametrize("copy", [False, True])
def test_inplace_change_of_a_saved_activation_raises(copy):
    """Plain autograd raises when a saved tensor changes in place; so must offload (it used to
    return a stale or changed tensor silently: a wrong gradient)."""
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(8, D)
    h = x @ w
    y = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()  # the oracle
    off = make(2, 1, min_bytes=0, copy=copy)
    for change in (lambda h, base: h.add_(1), lambda h, base: base[0].zero_()):
        with off.record(exclude=[w]):
            with off.group(0):
                base = x @ w
                h = base[:4]  # a view: a change through its base counts too
                y = h.sin()
            with off.group(1):
                loss = y.sum()
        change(h, base)
        with pytest.raises(RuntimeError, match="modified by an inplace operation.*group 0"):
            loss.backward()


INPLACE = {  # what backward saved (the tensor or a view of it), and a change in place of it
    "itself": (lambda a: a, lambda a: a.mul_(2.0)),
    "through a view": (lambda a: a, lambda a: a[:4].zero_()),
    "through a detached alias": (lambda a: a, lambda a: a.detach().add_(1.0)),
    "a view, through its base": (lambda a: a[:4], lambda a: a.add_(1.0)),
}
PATHS = {"keep": dict(offload=0), "offload": dict(offload=2, copy=True),
         "recompute": dict(offload=0, recompute_groups=[0])}


def changed_in_place(off, case, when):
    """``loss_fn(w, x)``: group 0 saves an activation ``a`` (or a view), which is changed in
    place ``when`` ("before" it is saved, "inside" the group after, or "after" the group);
    ``a`` is a local of the forward, freed by the time backward runs."""
    view, change = INPLACE[case]

    def group0(w, x):
        a = x * w
        if when == "before":
            change(a)
        b = view(a).sin()  # saves view(a)
        if when == "inside":
            change(a)
        return b, a

    def loss_fn(w, x):
        if off is None:
            b, a = group0(w, x)
        elif "recompute_groups" in PATHS[off[1]]:
            b, a = off[0].run(0, group0, w, x)
        else:
            with off[0].group(0):
                b, a = group0(w, x)
        with off[0].group(1) if off else torch.enable_grad():
            if when == "after":
                change(a)
            c = b * 3.0
        with off[0].group(2) if off else torch.enable_grad():
            return c.sum()
    return loss_fn


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("when", ["before", "inside", "after"])
@pytest.mark.parametrize("case", list(INPLACE))
def test_inplace_change_of_a_freed_saved_activation_raises(case, when, path):
    """A change in place of what a group saved raises as in plain autograd, whether the group
    keeps, offloads or recomputes it, also once the tensor itself is gone (the check used to
    hold weak references, dead by backward: no error and a wrong gradient); a change before the
    save is no change."""
    if path == "recompute" and not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        pytest.skip("this torch does not tell checkpoint's hooks: recomputes are not checked")
    w, x = torch.randn(8, D), torch.randn(8, D)
    wr = w.clone().requires_grad_()
    if when == "before":
        want = torch.autograd.grad(changed_in_place(None, case, when)(wr, x), wr)[0]
    else:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(changed_in_place(None, case, when)(wr, x), wr)  # the oracle
    off = make(3, min_bytes=0, **PATHS[path])
    vg = off.value_and_grad(changed_in_place((off, path), case, when))
    if when == "before":
        assert torch.equal(vg(w, x)[1], want)
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*in group 0"):
        vg(w, x)
    assert off.held_bytes == 0


def test_inplace_change_in_the_reported_case_raises():
    """An offloaded activation changed in place inside its group, then used again."""
    for copy in (False, True):
        off = make(3, 2, min_bytes=0, copy=copy)

        def loss_fn(w, x):
            with off.group(0):
                a = x * w
                b = a.sin()
                a.mul_(2.0)
                c = b * a
            with off.group(2):
                return c.sum()

        with pytest.raises(RuntimeError, match="modified by an inplace operation.*group 0"):
            off.value_and_grad(loss_fn)(torch.randn(64, 64), torch.randn(64, 64))


@pytest.mark.parametrize("copy", [False, True])
def test_forward_without_backward_frees_everything(copy):
    """An eval forward or a skipped step must not keep its activations (a reference cycle through
    the pack hook used to), nor grow host memory across repeated forwards."""
    blocks, _ = blocks_and_input()
    off = make(GROUPS, GROUPS - 1, min_bytes=0, copy=copy)
    refs, pooled = [], None
    gc.collect()
    gc.disable()  # freed by reference counting: no cycle for the collector to find
    try:
        for step in range(20):
            with off.record(exclude=blocks):
                h = torch.randn(32, D)
                for i, b in enumerate(blocks):
                    with off.group(i):
                        h = torch.tanh(b(h))
                        refs.append(weakref.ref(h))
                loss = h.sum()
            assert off.held_bytes > 0 or not copy
            del loss, h
            assert sum(r() is not None for r in refs) == 0
            assert off.held_bytes == 0
            pooled = off.pinned_bytes if step == 0 else pooled
            assert off.pinned_bytes == pooled
    finally:
        gc.enable()


def test_two_forwards_then_two_backwards():
    """Gradient accumulation over recorded forwards: each keeps its own host buffers."""
    torch.manual_seed(0)
    w = torch.randn(D, D, requires_grad=True)
    xs = [torch.randn(8, D) for _ in range(3)]

    def fwd(x, off=None):
        h = x
        for i in range(3):
            with off.group(i) if off else torch.enable_grad():
                h = torch.tanh(h @ w)
        return h.square().sum()

    for x in xs:
        fwd(x).backward()
    want, w.grad = w.grad.clone(), None
    off = make(3, 2, min_bytes=0, copy=True, max_inflight_bytes=0)
    losses = []
    for x in xs:
        with off.record(exclude=[w]):
            losses.append(fwd(x, off))
    for loss in losses:
        loss.backward()
    assert torch.equal(w.grad, want) and off.held_bytes == 0


def test_eval_forward_is_harmless():
    params, x = make_params(), torch.randn(8, D)
    off = make(GROUPS, 2, min_bytes=0, copy=True)
    with torch.no_grad(), off.record():
        forward(params, x, off)
    assert off.stats["tensors"] == 0 and off.held_bytes == 0
    with torch.no_grad():  # marks outside a recording, without autograd: plain calls
        forward(params, x, off)
    loss, _ = off.value_and_grad(lambda p, x: forward(p, x, off))(make_params(), x)
    assert torch.isfinite(loss) and off.held_bytes == 0


def test_inflight_bound_waits_and_holds():
    """Sources stay alive until their copy lands; past the bound the forward waits for copies."""
    params, x = make_params(), torch.randn(64, D)
    want_loss, want = reference_grads(params, x)
    per_group = (64 * 4 * D * 2) * 4  # pre-gelu and gelu output, fp32 (x is below min_bytes)
    for bound, waits in ((None, False), ("auto", True), (per_group, True), (1, True)):
        off = make(GROUPS, GROUPS - 1, min_bytes=16 << 10, copy=True,
                                max_inflight_bytes=bound)
        loss, grads = off.value_and_grad(lambda p, x: forward(p, x, off))(params, x)
        assert torch.equal(loss, want_loss)
        assert_same(grads, want)
        assert (off.stats["waits"] > 0) == waits
        peak = off.stats["inflight_peak_bytes"]
        if bound is None:
            assert peak == (GROUPS - 1) * per_group  # nothing landed: every source still held
        else:
            limit = 2 * per_group if bound == "auto" else max(bound, per_group // 2)
            assert peak <= limit, (bound, peak)


def test_host_cap_and_prefetch_keep_grads_identical():
    params, x = make_params(), torch.randn(64, D)
    want_loss, want = reference_grads(params, x)
    for kw in (dict(host_cap_bytes=64 * 4 * D * 4), dict(prefetch=3), dict(prefetch=1)):
        off = make(GROUPS, GROUPS - 1, min_bytes=0, copy=True,
                                max_inflight_bytes=0, **kw)
        loss, grads = off.value_and_grad(lambda p, x: forward(p, x, off))(params, x)
        assert torch.equal(loss, want_loss)
        assert_same(grads, want)
        # what is still on its way down when backward needs it is used in place, not reloaded
        assert 0 < off.stats["reloaded_bytes"] <= off.stats["offloaded_bytes"]
        if "host_cap_bytes" in kw:
            assert off.pinned_bytes <= kw["host_cap_bytes"]


def test_retain_graph_backward_twice():
    params, x = make_params(), torch.randn(16, D)
    off = make(GROUPS, GROUPS - 1, min_bytes=0, copy=True, max_inflight_bytes=0)
    leaves = [p.requires_grad_() for p in optree.tree_leaves(params)]
    with off.record(exclude=leaves):
        loss = forward(params, x, off)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    assert_same(first, second)


@pytest.mark.parametrize("recompute", [False, True])
def test_run_gives_fn_its_keywords_even_those_named_like_checkpoints(recompute):
    """``off.run(i, fn, x, debug=True, ...)`` calls ``fn(x, debug=True, ...)`` whether the group
    is kept or recomputed (torch.utils.checkpoint has options of those names)."""
    w = torch.randn(4, 4, requires_grad=True)
    got = []

    def fn(x, w, debug=False, preserve_rng_state=None, context_fn=None):
        got.append((debug, preserve_rng_state, context_fn))
        return (x @ w) * (2.0 if debug else 1.0)

    off = ActivationOffload(2, offload=0, recompute_groups=[0] if recompute else ())
    loss = lambda p, x: off.run(1, torch.tanh, off.run(  # noqa: E731
        0, fn, x, p, debug=True, preserve_rng_state=False, context_fn="mine")).sum()
    value, grad = off.value_and_grad(loss)(w, torch.ones(2, 4))
    want = w.detach().clone().requires_grad_()
    ref = torch.tanh((torch.ones(2, 4) @ want) * 2.0).sum()
    ref.backward()
    assert got and all(g == (True, False, "mine") for g in got)
    assert torch.equal(value, ref.detach()) and torch.equal(grad, want.grad)


NAN = float("nan")
BAD_OPTIONS = {  # option: values refused (with offload=1 unless the option is budget_bytes)
    "num_groups": [True, 0, -1, 2.0, "4", None],
    "offload": [True, False, -1, 4, 1.5, -0.1, NAN, "1"],
    "budget_bytes": [True, False, 0, -1, 1.5, NAN, "8GiB"],
    "min_bytes": [True, -1, 1.5, NAN, "1", None],
    "prefetch": [True, False, 0, -1, 1.5, NAN, "2", None],
    "max_inflight_bytes": [True, False, -1, 1.5, NAN, "none", "Auto"],
    "host_cap_bytes": [True, False, -1, 1.5, NAN, "1"],
    "recompute_groups": [[True], [1.0], [NAN], ["1"], "12", 2, [9], [-1]],
}


@pytest.mark.parametrize("option,value", [(k, v) for k, vs in BAD_OPTIONS.items() for v in vs],
                         ids=lambda v: repr(v))
def test_constructor_options_are_checked(option, value):
    """Bools are not counts, and negative, fractional, NaN or mistyped values are refused with
    the option named, when the object is made (budget_bytes=True used to mean one byte)."""
    kw = {"num_groups": 4, "offload": 1, option: value}
    if option == "budget_bytes":
        del kw["offload"]
    with pytest.raises(ValueError, match=option):
        ActivationOffload(**kw)


def test_constructor_accepts_the_documented_values():
    for kw in (dict(budget_bytes=1), dict(offload=0, min_bytes=0, max_inflight_bytes=0,
                                          host_cap_bytes=0, prefetch=8),
               dict(offload=0.5, max_inflight_bytes=None, recompute_groups=range(2, 4)),
               dict(offload=1, recompute_groups=(3,), max_inflight_bytes="auto")):
        ActivationOffload(4, **kw)


def test_testing_hooks():
    """copy_on_cpu holds for the objects made inside it, for their life; the manual clock moves
    only when told, inside its block."""
    params, x = make_params(), torch.randn(64, D)
    with copy_on_cpu():
        copies = ActivationOffload(GROUPS, 1, min_bytes=0)
    passes = ActivationOffload(GROUPS, 1, min_bytes=0)
    for off in (copies, passes):
        off.value_and_grad(lambda p, x: forward(p, x, off))(params, x)
    assert copies.stats["offloaded_bytes"] > 0 and passes.stats["offloaded_bytes"] == 0
    with pytest.raises(TypeError, match="copy_on_cpu"):  # a test's knob, not the constructor's
        ActivationOffload(GROUPS, 1, copy_on_cpu=True)
    for bad in ("now", True, None):
        with pytest.raises(ValueError, match="lands must be 'waited' or 'issued'"):
            with copy_on_cpu(bad):
                pass
    with manual_clock() as clock:
        clock.advance(0.25)
        assert clock() == 0.25
        for bad in (-1.0, float("nan"), True, "1"):
            with pytest.raises(ValueError, match="advance"):
                clock.advance(bad)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="never the last"):
        ActivationOffload(4, 4)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        ActivationOffload(4, 1.5)
    with pytest.raises(ValueError, match="both offloaded and recomputed"):
        ActivationOffload(4, 2, recompute_groups=[1, 3])
    with pytest.raises(ValueError, match="one of offload= .* or budget_bytes="):
        ActivationOffload(4)
    off = make(4, 2, copy=True, recompute_groups=[3])
    with pytest.raises(ValueError, match="out of range"):
        with off.group(4):
            pass
    with pytest.raises(RuntimeError, match="outside off.record"):  # a mode doing nothing
        with off.group(0):
            pass
    with pytest.raises(ValueError, match=r"off.run\(3, fn"):
        with off.record(), off.group(3):
            pass
    with pytest.raises(ValueError, match="already wrapped"):
        off.wrap(off.wrap([torch.nn.Linear(2, 2)]))

    def loss_fn(p, x):
        with off.record():
            return forward(p, x, off)

    with pytest.raises(RuntimeError, match="value_and_grad"):
        torch.func.grad(loss_fn)(make_params(), torch.randn(4, D))
    assert fo.ActivationOffload is ActivationOffload


def test_budget_mode_warns_when_a_group_never_runs():
    """budget_bytes plans from a step where every group ran: one that never runs leaves the
    budget unapplied, and says so once, naming the group."""
    blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    off = ActivationOffload(4, budget_bytes=1, min_bytes=0)
    with pytest.warns(RuntimeWarning, match=r"groups \[3\] of 0 … 3 did not run"):
        for _ in range(2):
            with off.record(exclude=blocks):
                h = torch.randn(32, 64)
                for i in range(3):
                    h = off.run(i, lambda b, x: torch.tanh(b(x)), blocks[i], h)
            h.sum().backward()
    assert off.plan is None
