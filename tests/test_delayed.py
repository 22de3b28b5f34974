"""Delayed parameter update: p_{t+1} = p_t - lr * grad L(p_{t-1}), flushed on demand; with the
look-ahead (the default), the params each forward reads are the next step's own values."""

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor
from conftest import DELAYS, STALE, KERNELS, clone, grad_seq, make_params, small_executor

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])

A = torch.randn(12, 6, generator=torch.Generator().manual_seed(0))
B = torch.randn(12, generator=torch.Generator().manual_seed(1))


def grad_at(p):
    return A.t() @ (A @ p - B)  # gradient of 0.5 * |A p - b|^2


@pytest.mark.parametrize("kernel", KERNELS)
def test_delayed_sgd_follows_the_recursion_exactly(kernel):
    lr, steps = 0.01, 15
    p0 = torch.randn(6, generator=torch.Generator().manual_seed(2))
    # hand-written: p_1 = p_0; p_{t+1} = p_t - lr * grad(p_{t-1}); the flush applies the last one
    hand = [p0.clone(), p0.clone()]
    for t in range(1, steps):
        hand.append(hand[t].add(grad_at(hand[t - 1]), alpha=-lr))
    final = hand[steps].add(grad_at(hand[steps - 1]), alpha=-lr)

    params = {"p": p0.clone()}
    opt = fo.sgd(lr, delayed=STALE, cpu_kernel=kernel, executor=HostExecutor(chunk_bytes=4096, threads=2))
    state = opt.init(params)
    seen = []
    for t in range(steps):
        seen.append(params["p"].clone())  # the params this step's gradient is computed at
        params, state = opt.update({"p": grad_at(params["p"])}, state)
    tol = dict(rtol=0, atol=0) if kernel == "torch" else dict(rtol=1e-6, atol=1e-7)
    for t in range(steps):
        torch.testing.assert_close(seen[t], hand[t], **tol)
    fo.flush(state)
    torch.testing.assert_close(params["p"], final, **tol)
    assert int(state.count) == steps


@pytest.mark.parametrize("delay", DELAYS)
def test_first_step_leaves_params_and_flush_is_idempotent(delay):
    params = make_params(dtype=torch.bfloat16)
    before = clone(params)
    opt = fo.adamw(1e-2, delayed=DELAYS[delay])
    state = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], state)
    for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(before)):
        assert torch.equal(a, b)
    fo.flush(state)
    fo.flush(state)
    for p, m in zip(optree.tree_leaves(params), optree.tree_leaves(state.master)):
        assert torch.equal(p, m.to(p.dtype))
    assert not torch.equal(params["scale"], before["scale"])


def test_delayed_applies_the_same_updates_as_immediate_in_the_end():
    """With grads that do not depend on the params, delay changes nothing but timing."""
    params = make_params()
    grads = grad_seq(params, 6)
    outs = []
    for delayed in (False, True):
        p = clone(params)
        opt = fo.adamw(1e-2, weight_decay=0.1, delayed=delayed, cpu_kernel="torch")
        s = opt.init(p)
        for g in grads:
            p, s = opt.update(g, s)
        fo.flush(s)
        outs.append(p)
    for a, b in zip(optree.tree_leaves(outs[0]), optree.tree_leaves(outs[1])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("delay", DELAYS)
def test_grads_are_free_once_update_returns(device, delay):
    """The caller may zero, overwrite or free its grads as soon as ``update`` returns, while the
    step runs in the background (a slowed kernel makes the background step read them late)."""
    from functional_offload.testing import slow_host_kernel

    params = make_params(big=True, device=device)
    grads = grad_seq(params, 3)
    outs = []
    for reuse in (False, True):
        p = clone(params)
        opt = fo.adamw(1e-2, delayed=DELAYS[delay], executor=small_executor())
        s = opt.init(p)
        with slow_host_kernel(0.002):
            for g in clone(grads):
                p, s = opt.update(g, s)
                if reuse:
                    for x in optree.tree_leaves(g):
                        x.fill_(float("nan"))  # as zero_grad(set_to_none=False) or accumulation
        fo.flush(s)
        outs.append(p)
    for a, b in zip(optree.tree_leaves(outs[0]), optree.tree_leaves(outs[1])):
        assert torch.equal(a, b)


def _copying(t: fo.GradientTransformation) -> fo.GradientTransformation:
    """``t``'s math without ``fresh_updates``: the step after it copies its grads."""
    return fo.GradientTransformation(t.init, t.update, t.global_scale)


def _unpacked_params(device) -> dict:
    """Leaves too large to pack (bf16 and fp32) and a small packed one."""
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(300, 256, generator=g).to(device, torch.bfloat16),
            "w": torch.randn(260, 256, generator=g).to(device),
            "t": torch.randn(290, 256, generator=g).to(device, torch.bfloat16),
            "b": torch.randn(16, generator=g).to(device, torch.bfloat16)}


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("delay", DELAYS)
def test_a_clip_s_new_grads_are_kept_by_the_landing_with_the_bits_of_a_copy(device, delay):
    """A delayed step behind ``clip_by_global_norm`` (``fresh_updates``) writes its new params
    into the clip's new grads instead of copying them first: the same params as where its
    grads are copied, with a clip that scales and one that does not, and the caller's grads
    are neither read late nor written (they are NaN-filled as soon as each update returns,
    while a slowed kernel reads in the background)."""
    from functional_offload.testing import slow_host_kernel

    for max_norm in (1e-3, 1e6):
        grads = grad_seq(_unpacked_params(device), 3)
        for g in grads:  # one grad not contiguous (the clip's new one is)
            g["t"] = g["t"].t().contiguous().t()
        outs = []
        for clip in (fo.clip_by_global_norm(max_norm), _copying(fo.clip_by_global_norm(max_norm))):
            p = _unpacked_params(device)
            opt = fo.chain(clip, fo.adamw(1e-2, placement=fo.placement.on_host(),
                                          delayed=DELAYS[delay], executor=small_executor()))
            s = opt.init(p)
            with slow_host_kernel(0.0005):
                for g in clone(grads):
                    kept = clone(g)
                    p, s = opt.update(g, s)
                    for x, y in zip(optree.tree_leaves(g), optree.tree_leaves(kept)):
                        assert torch.equal(x, y)  # not written
                        x.fill_(float("nan"))
            fo.flush(s)
            outs.append(clone(p))
        for k in outs[1]:
            assert torch.equal(outs[0][k], outs[1][k]), (max_norm, k)


def test_torch_optimizer_s_clip_hands_its_new_grads_to_a_delayed_step():
    """``TorchOptimizer(max_grad_norm=...)`` with a delayed step: the clip's new grads go to
    the landing as a chain's do, with the params of a chain whose clip's grads are copied, and
    the caller's grads untouched."""
    grads = grad_seq(_unpacked_params("cpu"), 3)
    live = {k: p.requires_grad_() for k, p in _unpacked_params("cpu").items()}
    opt = fo.TorchOptimizer(list(live.values()), lr=1e-2, max_grad_norm=1e-3,
                            placement=fo.placement.on_host(), delayed=STALE,
                            executor=small_executor())
    for want in grads:
        for k, p in live.items():
            p.grad = want[k].clone()
        opt.step()
        for k, p in live.items():
            assert torch.equal(p.grad, want[k]), k  # not written
            p.grad.fill_(float("nan"))  # nor read late
    opt.flush()
    params = _unpacked_params("cpu")
    chain = fo.chain(_copying(fo.clip_by_global_norm(1e-3)),
                     fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=STALE,
                              executor=small_executor()))
    state = chain.init(params)
    for g in clone(grads):
        params, state = chain.update(g, state)
    fo.flush(state)
    for k, p in live.items():
        assert torch.equal(p.detach(), params[k]), k


def _tie(u: dict) -> dict:
    """Leaves ``a`` and ``b`` given one new tensor, the sum of their grads (tied weights)."""
    s = u["a"] + u["b"]
    return {**u, "a": s, "b": s}


def _tie_views(u: dict) -> dict:
    """:func:`_tie` with ``b`` given a view of ``a``'s tensor, another object."""
    s = u["a"] + u["b"]
    return {**u, "a": s, "b": s.view_as(s)}


FRONTS = {"tied": _tie, "tied views": _tie_views, "identity": lambda u: u,
          "detached": lambda u: {k: g.detach() for k, g in u.items()}}


@pytest.mark.parametrize("front", FRONTS)
def test_a_fresh_front_s_shared_or_given_tensors_are_copied(front):
    """A ``fresh_updates`` front's tensor given to two leaves (one object, or views of one), or
    a grad passed through as it came (itself, or a new view of it), is copied by the landing,
    not kept (its bytes are another leaf's grad, or the caller's): the params of the same front
    without ``fresh_updates``, and the caller's grads untouched."""
    fn = FRONTS[front]
    outs = []
    for fresh in (True, False):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(300, 256, generator=g).bfloat16()
        params = {"a": w.clone(), "b": w.clone()}
        t = fo.GradientTransformation(lambda p: fo.EmptyState(), lambda u, s: (fn(u), s),
                                      fresh_updates=fresh)
        opt = fo.chain(t, fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=STALE,
                                   executor=small_executor()))
        state = opt.init(params)
        for _ in range(3):
            grads = {k: torch.randn(300, 256, generator=g).bfloat16() for k in params}
            kept = clone(grads)
            params, state = opt.update(grads, state)
            assert all(torch.equal(grads[k], kept[k]) for k in grads)
        fo.flush(state)
        outs.append(clone(params))
    for k in outs[1]:
        assert torch.equal(outs[0][k], outs[1][k]), k


@pytest.mark.parametrize("bad", ["sparse", "number"])
def test_a_fresh_front_s_leaf_that_is_no_dense_tensor_gets_the_step_s_error(bad):
    """A ``fresh_updates`` front that returns a sparse tensor or a number for a leaf gets the
    error the step gives such a grad, naming the leaf."""
    out = torch.eye(4).to_sparse() if bad == "sparse" else 3.0
    t = fo.GradientTransformation(lambda p: fo.EmptyState(), lambda u, s: ({"w": out}, s),
                                  fresh_updates=True)
    opt = fo.chain(t, fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=STALE,
                               executor=small_executor()))
    state = opt.init({"w": torch.zeros(4, 4)})
    with pytest.raises(TypeError, match="grad 'w'"):
        opt.update({"w": torch.ones(4, 4)}, state)


@pytest.mark.cuda
def test_a_delayed_step_behind_a_clip_allocates_no_copy_of_its_grads():
    """The first delayed step behind a clip allocates the clip's new grads, where its landing
    writes its new params, and no buffer for a copy of them (as it does where they are
    copied)."""
    peaks = []
    for clip in (fo.clip_by_global_norm(1e-3), _copying(fo.clip_by_global_norm(1e-3))):
        g = torch.Generator(device="cuda").manual_seed(0)
        params = {f"w{i}": torch.randn(1024, 1024, device="cuda", generator=g).bfloat16()
                  for i in range(4)}
        grads = {k: torch.randn(p.shape, device="cuda", generator=g).bfloat16()
                 for k, p in params.items()}
        opt = fo.chain(clip, fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=STALE,
                                      executor=small_executor()))
        state = opt.init(params)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _, state = opt.update(grads, state)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        fo.flush(state)
    nbytes = 4 * 1024 * 1024 * 2  # the grads' (measured on an H100: nbytes + 512, 2 * nbytes)
    kept, copied = peaks
    assert abs(kept - nbytes) < 0.01 * nbytes and abs(copied - 2 * nbytes) < 0.01 * nbytes, peaks


@pytest.mark.parametrize("kernel", KERNELS)
def test_param_groups_sharing_an_executor(kernel):
    """``TorchOptimizer`` with two groups, delayed, one executor: group 0's host step still runs
    in the background when group 1's starts; both must come out as with an executor each."""
    outs = []
    for shared in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
        ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2) if shared else None
        groups = [{"params": list(model[0].named_parameters())},
                  {"params": list(model[1].named_parameters()), "weight_decay": 0.0}]
        opt = fo.TorchOptimizer(groups, fo.adamw, lr=1e-2, delayed=STALE, cpu_kernel=kernel,
                                **({"executor": ex} if shared else {}))
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        for _ in range(4):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        for st in opt.fo_states:
            fo.flush(st)
        outs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_checkpoint_flushes_in_flight_work(tmp_path):
    params = make_params(dtype=torch.bfloat16)
    grads = grad_seq(params, 4)
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, delayed=STALE))
    s = opt.init(params)
    for g in grads:
        params, s = opt.update(g, s)
    fo.save(s, tmp_path / "opt")  # flushes: the 4th step lands before the save
    for p, m in zip(optree.tree_leaves(params), optree.tree_leaves(s[1].master)):
        assert torch.equal(p, m.to(p.dtype))
    ref = clone(make_params(dtype=torch.bfloat16))
    r = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2)).init(ref)
    for g in grads:
        ref, r = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2)).update(g, r)
    for a, b in zip(optree.tree_leaves(s[1].master), optree.tree_leaves(r[1].master)):
        assert torch.equal(a, b)  # nothing lost: all four steps applied
    loaded = fo.load(tmp_path / "opt", like=opt.init(params))
    assert int(loaded[1].count) == 4


def test_background_error_surfaces_at_next_call():
    from functional_offload.testing import fail_host_kernel
    params = make_params()
    opt = fo.sgd(0.1, delayed=STALE, cpu_kernel="torch")
    state = opt.init(params)
    with fail_host_kernel(exc=FloatingPointError("kernel exploded")):
        params, state = opt.update(grad_seq(params, 1)[0], state)  # returns at once
        with pytest.raises(fo.HostStepError, match="kernel exploded"):
            fo.flush(state)


def test_delayed_steps_leave_a_core_for_the_training_loop():
    from functional_offload.optimizers.adam import ADAMW
    from functional_offload.optimizers.terminal import Terminal

    def threads(delayed):
        return Terminal(ADAMW, {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                "weight_decay": 0.0}, moment_dtypes={}, placement=None,
                        master_dtype=torch.float32, weight_decay_mask=None, ema_decay=None,
                        executor=HostExecutor(threads=4), cpu_kernel="auto", delayed=delayed).threads

    assert threads(True) == 3 and threads(False) == 4


def _seen(make, grads_fn, steps, delayed, executor=None, p0=None):
    """The params each forward of a loop reads (``grads_fn(t, params)`` its grads), and the
    params after the last update (flushed)."""
    params = {"p": (p0 if p0 is not None else torch.randn(6, generator=torch.Generator().manual_seed(2))).clone()}
    opt = make(delayed=delayed, **({"executor": executor} if executor is not None else {}))
    state = opt.init(params)
    seen = []
    for t in range(steps):
        seen.append(params["p"].clone())
        params, state = opt.update({"p": grads_fn(t, params["p"])}, state)
    fo.flush(state)
    return seen, params["p"].clone()


def _run_modes(delayed, grads_fn, steps, clip=None):
    def make(**kw):
        inner = fo.adamw(1e-2, weight_decay=0.1, cpu_kernel="torch", **kw)
        return inner if clip is None else fo.chain(fo.clip_by_global_norm(clip), inner)
    return _seen(make, grads_fn, steps, delayed)


def test_warmup_steps_are_exact_then_delayed():
    """``Delay(warmup=k)``: the first k updates land before ``update`` returns (the next
    gradient sees them, bit for bit the non-delayed run); later ones are one step stale."""
    f = lambda t, p: grad_at(p)  # noqa: E731
    exact, _ = _run_modes(False, f, 8)
    warm, _ = _run_modes(fo.Delay(warmup=3, lookahead=False), f, 8)
    stale, _ = _run_modes(STALE, f, 8)
    for t in range(4):
        assert torch.equal(warm[t], exact[t]), t
    assert not torch.equal(warm[5], exact[5])
    assert not torch.equal(stale[1], exact[1])


def test_a_clipped_step_is_exact_and_an_unclipped_one_delayed():
    """``exact_when_clipped``: a step whose clip scales lands at once; the next gradient is
    taken at its params. Grads of norm 10 (clipped) for 3 steps, then of norm 1e-3."""
    g = torch.randn(6, generator=torch.Generator().manual_seed(3))
    big, small = g * (10 / g.norm()), g * (1e-3 / g.norm())
    f = lambda t, p: big if t < 3 else small  # noqa: E731
    exact, end_exact = _run_modes(False, f, 6, clip=1.0)
    clip, end_clip = _run_modes(fo.Delay(exact_when_clipped=True, lookahead=False), f, 6, clip=1.0)
    for t in range(4):  # steps 0-2 clipped: exact; step 3's params are those after step 2
        assert torch.equal(clip[t], exact[t]), t
    assert not torch.equal(clip[4], exact[4])  # step 3 was not clipped: in flight
    assert torch.equal(end_clip, end_exact)  # the same updates in the end (grads fixed)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("clipped", [1, 4])
def test_the_landings_after_an_exact_step_start_from_its_params(kernel, clipped):
    """Delayed steps, one exact step (its clip scales), delayed again: the params the exact
    step left are a step behind the first landing after it, which sets them from the new
    values first, so every landing is the run without delay's params but for rounding."""
    torch.manual_seed(0)
    grads = [torch.randn(4096) * 1e-3 for _ in range(8)]
    grads[clipped] = grads[clipped] / grads[clipped].norm() * 10  # norm 10: clipped, exact

    def run(delayed):
        params = {"p": torch.randn(4096, generator=torch.Generator().manual_seed(1))}
        opt = fo.chain(fo.clip_by_global_norm(1.0),
                       fo.adamw(1e-2, betas=(0.9, 0.95), weight_decay=0.1, delayed=delayed,
                                cpu_kernel=kernel, executor=small_executor()))
        state, out = opt.init(params), [params["p"].clone()]
        for g in grads:
            params, state = opt.update({"p": g.clone()}, state)
            out.append(params["p"].clone())
        fo.flush(state)
        return out, params["p"]

    exact, end_exact = run(False)
    delayed, end_delayed = run(fo.Delay(exact_when_clipped=True))
    for t in range(2, len(grads) + 1):
        if t == clipped + 2:  # the update after the exact one lands nothing: a step behind
            continue
        step = float((exact[t] - exact[t - 1]).norm())
        assert float((delayed[t] - exact[t]).norm()) < 1e-3 * step, t  # measured 1e-5; 0.15 before
    assert torch.equal(end_delayed, end_exact)


@pytest.mark.parametrize("bad, match", [(fo.Delay(warmup=-1), "warmup"),
                                        (fo.Delay(warmup=1.5), "warmup"),
                                        (fo.Delay(exact_when_clipped=1), "exact_when_clipped"),
                                        (fo.Delay(lookahead=1), "lookahead"),
                                        ("yes", "delayed")])
def test_a_bad_delay_is_refused_naming_it(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        fo.adamw(1e-2, delayed=bad)


# ---- the look-ahead -------------------------------------------------------------------------

LINEAR = {  # optimizers whose look-ahead is exact but for rounding
    "sgd": lambda kernel, **kw: fo.sgd(0.01, weight_decay=0.01, cpu_kernel=kernel, **kw),
    "sgd_momentum": lambda kernel, **kw: fo.sgd(0.01, momentum=0.9, weight_decay=0.01, cpu_kernel=kernel, **kw),
    "nesterov": lambda kernel, **kw: fo.sgd(0.01, momentum=0.9, nesterov=True, weight_decay=0.01,
                                           cpu_kernel=kernel, **kw),
    "lion": lambda kernel, **kw: fo.lion(1e-3, weight_decay=0.1, cpu_kernel=kernel, **kw),
    "adamw_no_momentum": lambda kernel, **kw: fo.adamw(1e-2, betas=(0.0, 0.95), weight_decay=0.1,
                                                       cpu_kernel=kernel, **kw),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", LINEAR)
def test_the_lookahead_reads_the_params_of_the_run_without_delay(name, kernel):
    """With the look-ahead every forward but the second reads the params the same loop reads
    without ``delayed`` (the first update has no look-ahead to land: the second forward reads
    the initial params, one step stale). The oracle: the loop without ``delayed`` fed that one
    stale gradient at its second step, and its own params' gradients at the others."""
    make = lambda **kw: LINEAR[name](kernel, **kw)  # noqa: E731
    ahead, end = _seen(make, lambda t, p: grad_at(p), 12, fo.Delay())
    p0 = ahead[0]
    ref, ref_end = _seen(make, lambda t, p: grad_at(p0 if t == 1 else p), 12, False)
    assert torch.equal(ahead[1], p0)
    for t in range(2, 12):  # exact but for the rounding of base - rate * g against the step's own
        torch.testing.assert_close(ahead[t], ref[t], rtol=1e-6, atol=1e-7, msg=f"forward {t}")
    torch.testing.assert_close(end, ref_end, rtol=1e-6, atol=1e-7)
    stale, _ = _seen(make, lambda t, p: grad_at(p), 12, STALE)
    assert (stale[6] - ref[6]).abs().max() > 100 * (ahead[6] - ref[6]).abs().max()


def _adam_by_hand(x, m, v, g, p_before, k, lr, b1, b2, eps, wd, decoupled):
    """fp64: the params the look-ahead of AdamW (Adam) gives for step ``k + 1``'s grad ``g``,
    from the values ``x`` and moments ``m``, ``v`` after step ``k`` and the params ``p_before``
    the device holds: the base (the momentum term over the denominator of ``v``) corrected
    to the next denominator through the held params, the grad's term over the next
    denominator (Adam's grad plus the L2 term of ``p_before``)."""
    x, m, v, g, p_before = (t.double().cpu() for t in (x, m, v, g, p_before))  # (moments: host)
    if not decoupled:
        g = g + wd * p_before
    c = lr / (1 - b1 ** (k + 1))
    d_now = v.sqrt() / (1 - b2 ** k) ** 0.5 + eps
    v_next = b2 * v + (1 - b2) * g * g
    d_next = v_next.sqrt() / (1 - b2 ** (k + 1)) ** 0.5 + eps
    decay = 1 - lr * wd if decoupled else 1.0
    base = x * decay - c * b1 * m / d_now
    return base + (p_before * decay - base) * (1 - d_now / d_next) - c * (1 - b1) * g / d_next


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_the_adam_lookahead_is_the_next_step_by_hand(decoupled, kernel, device):
    """After each delayed update ``k`` the params are the next step's values by hand
    (:func:`_adam_by_hand`, from the state of the run without ``delayed`` fed the same grads),
    and much closer to that run's params than the last step's (the stale ones) are. On a GPU
    through a small executor's ring (bases and rates copied up in chunks on the copy streams),
    with no synchronisation between the updates: a landing that read a buffer before its copy up
    ended would be off by far more."""
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.95), 1e-8
    make = fo.adamw if decoupled else fo.adam
    params = make_params(device=device)
    grads = grad_seq(params, 8)
    p, q = clone(params), clone(params)
    options = dict(executor=small_executor()) if device == "cuda" else {}
    opt = make(lr, betas=(b1, b2), eps=eps, weight_decay=wd, cpu_kernel=kernel, delayed=True,
               **options)
    ref = make(lr, betas=(b1, b2), eps=eps, weight_decay=wd, cpu_kernel=kernel, **options)
    s, r = opt.init(p), ref.init(q)
    seen = []  # per update: the held params, the exact run's before and after, its moments
    for k, g in enumerate(grads):
        before, last = clone(p), clone(q)  # the device's params; the exact run's after step k
        m, v = clone(r.mu), clone(r.nu)  # (fp32 params: each its own master)
        p, s = opt.update(g, s)
        q, r = ref.update(g, r)
        seen.append((before, last, m, v, clone(p), clone(q)))
    closer = []
    for k, (before, last, m, v, pk, qk) in enumerate(seen):
        if k == 0:
            continue  # nothing in flight to land: the params stay
        for at in (lambda t: t["layer1"]["weight"], lambda t: t["scale"]):
            held = at(last) if k == 1 else at(before)  # the first landing: from the new values
            want = _adam_by_hand(at(last), at(m), at(v), at(grads[k]), held, k, lr, b1, b2, eps, wd,
                                 decoupled)
            torch.testing.assert_close(at(pk).double().cpu(), want, rtol=1e-5, atol=1e-6)
        err = sum(float((a - b).norm()) for a, b in zip(optree.tree_leaves(pk), optree.tree_leaves(qk)))
        step = sum(float((a - b).norm()) for a, b in zip(optree.tree_leaves(qk), optree.tree_leaves(last)))
        closer.append(err / step)
    # the stale params are a whole step away (1.0). The second update lands from the new
    # values (the first landed nothing: the params it holds are a step behind, measured 0.64
    # off when the landing read them), each later one from the look-ahead before
    assert max(closer) < 1e-4, closer  # measured 8e-6 to 1.4e-5 (fp32 rounding)
    fo.flush(s)
    for a, b in zip(optree.tree_leaves(p), optree.tree_leaves(q)):
        assert torch.equal(a, b)  # the same grads: the same updates, landed exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adams_landing_stays_finite_past_a_spike_and_a_non_finite_param(dtype):
    """The landing reads the params the device holds: a grad whose square overflows fp32, or a
    param written non-finite, must not leave the params the forwards read non-finite (the
    exact run's stay finite)."""
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.ones(64, dtype=dtype)}
    opt = fo.adamw(1e-2, betas=(0.9, 0.95), delayed=True)
    s = opt.init(p)
    for k in range(10):
        grad = torch.randn(64, generator=g)
        if k == 3:
            grad = grad / grad.abs().max() * 8e19
        if k == 6:
            p["w"][0] = float("nan")  # the update after lands every element anew
        p, s = opt.update({"w": grad.to(dtype)}, s)
        assert torch.isfinite(p["w"].float()).all(), k


ROUNDED = {**LINEAR, "adamw": lambda kernel, **kw: fo.adamw(1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                                           cpu_kernel=kernel, **kw)}


@pytest.mark.parametrize("kernel, master", [(k, torch.float32) for k in KERNELS]
                         + [("torch", torch.float64)], ids=[*KERNELS, "torch-fp64"])
@pytest.mark.parametrize("name", ROUNDED)
def test_the_lookahead_rounds_bf16_params_once(name, kernel, master):
    """bf16 params: each base travels with its rounding residual, so a landing rounds once, as
    the step rounds its master, and the forwards read the params of the run without delay fed
    the same grads but at a few elements (values within 2^-8 of a bf16 step of a tie; Adam's
    second moment and Lion's momentum term go up in bf16): 0.1-2.5 % here, where a base
    rounded to bf16 and the landing rounded again put 19-26 % one step away at every forward.
    AdamW's first landings differ at more elements (measured 11 % at the second forward, 4.8 %
    at the fourth, 3.9 % at the fifth). An fp64 master's base goes up as fp32 with its
    residual (the native kernel takes fp32 masters only)."""
    make = lambda **kw: ROUNDED[name](kernel, master_dtype=master, **kw)  # noqa: E731
    gen = torch.Generator().manual_seed(6)
    p0 = torch.randn(8192, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(8192, generator=gen).to(torch.bfloat16) for _ in range(12)]
    ahead, end = _seen(make, lambda t, p: grads[t], 12, fo.Delay(), p0=p0)
    ref, ref_end = _seen(make, lambda t, p: grads[t], 12, False, p0=p0)
    assert torch.equal(ahead[1], p0)  # the first update lands nothing
    for t in range(6 if name == "adamw" else 2, 12):
        off = float((ahead[t] != ref[t]).float().mean())
        moved = float((ref[t] != ref[t - 1]).float().mean())
        assert off < 0.05 and moved > 0.3, (t, off, moved)  # (the steps move many params)
    assert torch.equal(end, ref_end)  # flushed: the same updates, landed exactly


@pytest.mark.parametrize("name", ROUNDED)
def test_fp64_params_land_in_fp64(name):
    """fp64 params: the landing computes in their dtype, so the forwards read the run without
    delay's params to within fp64 rounding (in fp32 they were 1e-7 off)."""
    make = lambda **kw: ROUNDED[name]("torch", **kw)  # noqa: E731
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(1000, generator=gen, dtype=torch.float64)
    grads = [torch.randn(1000, generator=gen, dtype=torch.float64) for _ in range(6)]
    ahead, end = _seen(make, lambda t, p: grads[t], 6, fo.Delay(), p0=p0)
    ref, ref_end = _seen(make, lambda t, p: grads[t], 6, False, p0=p0)
    for t in range(2, 6):
        assert ahead[t].dtype == torch.float64
        torch.testing.assert_close(ahead[t], ref[t], rtol=1e-12, atol=1e-14)
    assert torch.equal(end, ref_end)


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum", "nesterov"])
def test_sgds_landing_takes_its_rate_exactly(name):
    """SGD's look-ahead rate is the step's learning rate (times 1 + momentum with Nesterov),
    the same for every element: the landing takes it from the hyperparameters, not rounded to
    bf16 as it goes up, so steps of many bf16 steps (params near 0.05, lr 0.03, which bf16
    cannot hold) land as the exact run's at all but 2^-8-close ties (measured 0.2-0.5 %; with
    the rounded rate, 6-15 %)."""
    nesterov, momentum = name == "nesterov", 0.0 if name == "sgd" else 0.9
    make = lambda **kw: fo.sgd(0.03, momentum=momentum, nesterov=nesterov, weight_decay=0.01,  # noqa: E731
                               **kw)
    gen = torch.Generator().manual_seed(7)
    p0 = (torch.randn(8192, generator=gen) * 0.05).to(torch.bfloat16)
    grads = [torch.randn(8192, generator=gen).to(torch.bfloat16) for _ in range(8)]
    ahead, _ = _seen(make, lambda t, p: grads[t], 8, fo.Delay(), p0=p0)
    ref, _ = _seen(make, lambda t, p: grads[t], 8, False, p0=p0)
    for t in range(2, 8):
        assert float((ahead[t] != ref[t]).float().mean()) < 0.01, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_lookahead_through_the_ring_is_the_lookahead_in_place(kernel, dtype):
    """Host params' bases, rates and (bf16) residuals copied up through the staging ring, in
    chunks cut across leaves (as a GPU's are), give the params written in place."""
    make = lambda **kw: fo.adamw(1e-2, weight_decay=0.1, cpu_kernel=kernel, **kw)  # noqa: E731
    p0 = torch.randn(3000, generator=torch.Generator().manual_seed(4)).to(dtype)
    f = lambda t, p: torch.sin(p * (t + 1))  # noqa: E731
    in_place, end = _seen(make, f, 6, fo.Delay(), p0=p0)
    ringed, ring_end = _seen(make, f, 6, fo.Delay(), p0=p0, executor=HostExecutor(
        chunk_bytes=4096, slots=2, threads=2, worker_elements=1, stage_host_grads=True))
    for a, b in zip(in_place + [end], ringed + [ring_end]):
        assert torch.equal(a, b)
    assert not torch.equal(in_place[3], in_place[2])


def test_a_param_without_a_grad_lands_exactly():
    """A leaf that gets no grad at the update landing the look-ahead has no next step to look
    ahead to: its params are set from its master (the step it had stays exact)."""
    params = make_params(dtype=torch.bfloat16)
    opt = fo.adamw(1e-2, delayed=True)
    state = opt.init(params)
    g1, g2 = grad_seq(params, 2)
    params, state = opt.update(g1, state)
    g2 = dict(g2, scale=None)
    params, state = opt.update(g2, state)
    assert torch.equal(params["scale"], state.master["scale"].to(torch.bfloat16))
    assert not torch.equal(params["layer1"]["weight"], state.master["layer1"]["weight"].to(torch.bfloat16))


def test_a_schedule_down_to_zero_lands_finite_params():
    """The look-ahead of a step whose successor has lr 0 (the end of a decay) is no change."""
    lr = lambda n: 1e-2 * max(0.0, 1 - n / 3)  # noqa: E731  (0 from the fourth update on)
    params = make_params(dtype=torch.bfloat16)
    grads = grad_seq(params, 6)
    runs = []
    for delayed in (True, False):
        p = clone(params)
        opt = fo.adamw(lr, delayed=delayed)
        s = opt.init(p)
        for g in grads:
            p, s = opt.update(g, s)
            assert all(torch.isfinite(x).all() for x in optree.tree_leaves(p))
        fo.flush(s)
        runs.append(p)
    for a, b in zip(*map(optree.tree_leaves, runs)):
        assert torch.equal(a, b)


def test_a_schedule_that_ends_leaves_its_last_step_no_lookahead():
    """A schedule defined for the loop's updates only (a table of values): the last update's
    look-ahead would need the value after it; it has none, lands exactly at the flush, and an
    update past the table raises the schedule's own error."""
    lrs = [1e-2, 2e-2, 1e-2, 5e-3]
    params = make_params(dtype=torch.bfloat16)
    grads = grad_seq(params, len(lrs))
    runs = []
    for delayed in (True, False):
        p = clone(params)
        opt = fo.adamw(lambda n: lrs[n], delayed=delayed)
        s = opt.init(p)
        for g in grads:
            p, s = opt.update(g, s)
        fo.flush(s)
        runs.append(p)
        if delayed:
            with pytest.raises(IndexError):
                opt.update(grads[0], s)
    for a, b in zip(*map(optree.tree_leaves, runs)):
        assert torch.equal(a, b)


def test_adams_lookahead_refuses_fp16_params_naming_the_fixes():
    """fp16 cannot hold Adam's look-ahead (eps 1e-8 rounds to 0, small second moments
    underflow): refused at init, naming the param; SGD's and the stale mode take fp16."""
    params = {"w": torch.ones(4, dtype=torch.float16)}
    with pytest.raises(ValueError, match=r"param 'w' is torch.float16.*bf16 params.*lookahead=False"):
        fo.adamw(1e-2, delayed=True).init(params)
    fo.adamw(1e-2, delayed=STALE).init(params)
    opt = fo.sgd(1e-2, momentum=0.9, delayed=True)
    p, s = opt.update({"w": torch.ones(4, dtype=torch.float16)}, opt.init(params))
    p, s = opt.update({"w": torch.ones(4, dtype=torch.float16)}, s)
    assert torch.isfinite(p["w"]).all()


@pytest.mark.parametrize("other", ["meta", CUDA])
@pytest.mark.parametrize("delayed", [True, STALE], ids=["lookahead", "stale"])
def test_host_leaves_on_two_devices_are_refused_naming_both(delayed, other):
    """A delayed update lands the host-resident leaves of one device: params on two are
    refused at init, naming a leaf of each and how to split them."""
    params = {"a": torch.ones(4, dtype=torch.bfloat16),
              "b": torch.ones(4, dtype=torch.bfloat16, device=other)}
    with pytest.raises(ValueError, match=r"params 'a' \(cpu\) and 'b' \((meta|cuda:0)\) are on "
                                         r"different devices.*fo.partition.*placement.select"):
        fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=delayed).init(params)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("delayed", [False, True, STALE], ids=["plain", "lookahead", "stale"])
def test_a_param_moved_to_another_device_after_init_is_refused_naming_it(delayed):
    """A host leaf's steps order against its device's streams (and a delayed update lands the
    leaves of one device): a param moved to another device after ``init`` is refused at the
    next update, naming it, before anything is changed."""
    params = {"w": torch.ones(70_000, device="cuda", dtype=torch.bfloat16),
              "b": torch.ones(4, device="cuda", dtype=torch.bfloat16)}
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=delayed)
    state = opt.init(params)
    params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state)
    params["w"].data = params["w"].data.cpu()
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(ValueError, match=r"param 'w' moved from cuda:0 to cpu.*move it back"):
        opt.update(grads, state)
    params["w"].data = params["w"].data.cuda()
    params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state)
    fo.flush(state)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kernel", KERNELS)
def test_small_leaves_take_their_lookahead_packed_as_they_would_alone(kernel, device):
    """Small bf16 leaves run packed (two packs, by weight decay), each a twin of more than
    ``PACK_MAX`` elements (not packed) whose first elements are the small one's and get its
    grads: every forward reads the twin's params in the small leaf, bit for bit — each member
    lands from its own base, rate and next grad, and one with no grad (some steps) from its
    master, then fresh. Checked packed: a failure names the packed run."""
    from functional_offload.optimizers.packing import PACK_MAX
    from functional_offload.testing import fail_host_kernel
    gen = torch.Generator().manual_seed(3)
    shapes = {"w0": (40, 100), "w1": (17,), "b0": (300,), "b1": (5, 7), "b2": (64,)}
    params, twins = {}, {}
    for k, shape in shapes.items():
        n = torch.Size(shape).numel()
        twin = (torch.randn(PACK_MAX + 100, generator=gen) * 0.1).to(torch.bfloat16)
        params[k] = twin[:n].view(shape).clone().to(device)
        twins[k] = twin.to(device)
    tree, start = {"small": params, "twin": twins}, clone(params)
    opt = fo.adamw(1e-2, betas=(0.9, 0.95), weight_decay=0.1, cpu_kernel=kernel, delayed=True,
                   weight_decay_mask=lambda t: optree.tree_map_with_path(
                       lambda path, _: path[-1].startswith("w"), t),
                   executor=HostExecutor(chunk_bytes=8192, slots=2, threads=2))
    state = opt.init(tree)
    for t in range(7):
        for k in shapes:
            n = params[k].numel()
            assert torch.equal(tree["small"][k].reshape(-1), tree["twin"][k][:n]), (t, k)
        g = optree.tree_map(lambda p: (torch.randn(p.shape, generator=gen)).to(p), tree)
        for k in shapes:
            g["small"][k] = g["twin"][k][:params[k].numel()].view(shapes[k]).clone()
        if t in (2, 3):  # no grad: lands from the master, the next landing from fresh values
            g["small"]["b0"] = g["twin"]["b0"] = g["small"]["w1"] = g["twin"]["w1"] = None
        tree, state = opt.update(g, state)
    assert not torch.equal(tree["small"]["b0"], start["b0"])
    fo.flush(state)
    for k in shapes:
        assert torch.equal(tree["small"][k].reshape(-1), tree["twin"][k][:params[k].numel()]), k
    with fail_host_kernel(exc=FloatingPointError("injected")):
        _, state = opt.update(optree.tree_map(torch.ones_like, tree), state)
        with pytest.raises(fo.HostStepError, match=r"leaf 'small\.\w+', 'small\.\w+'"):  # members
            fo.flush(state)


@pytest.mark.parametrize("delay", DELAYS)
def test_a_failed_packed_run_lands_each_param_old_or_new(delay):
    """A run of packed small leaves fails after its first chunks: the landing sets each
    member's elements either as they were or to the step's new values (those of the chunks
    that ran), never another member's, and the state is marked failed."""
    from functional_offload.testing import fail_host_kernel
    gen = torch.Generator().manual_seed(5)
    tree = {f"p{i}": (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
            for i, n in enumerate((700, 33, 1500, 260, 900))}
    grads = [optree.tree_map(lambda p: torch.randn(p.shape, generator=gen).to(p), tree)
             for _ in range(2)]
    make = lambda delayed: fo.adamw(1e-2, delayed=delayed, executor=HostExecutor(  # noqa: E731
        chunk_bytes=4096, slots=2, threads=1))
    ref = make(False)
    want = clone(tree)
    rs = ref.init(want)
    want, rs = ref.update(grads[0], rs)
    old = clone(want)
    new, _ = ref.update(grads[1], rs)
    opt = make(DELAYS[delay])
    got = clone(tree)
    state = opt.init(got)
    got, state = opt.update(grads[0], state)
    fo.flush(state)
    with fail_host_kernel(after=1, exc=FloatingPointError("injected")):
        got, state = opt.update(grads[1], state)
        with pytest.raises(fo.HostStepError, match="injected"):
            fo.flush(state)
    changed = 0
    for k in tree:
        assert ((got[k] == old[k]) | (got[k] == new[k])).all(), k
        changed += int((got[k] != old[k]).sum())
    assert 0 < changed < sum(p.numel() for p in tree.values())
    with pytest.raises(RuntimeError, match="failed"):
        opt.update(grads[1], state)


@pytest.mark.parametrize("change", ["cast", "copy", "reshape"])
@pytest.mark.parametrize("delay", DELAYS)
def test_a_param_given_other_memory_in_flight_lands_there(delay, change):
    """``param.data = ...`` (a cast to fp32, a copy, a reshape) while a delayed step is in
    flight: the step lands in the param's new memory, as if it had landed before the change —
    the flushed params are those of the run without ``delayed`` changed the same way, for a
    small (packed) param and one too large to pack."""
    from functional_offload.optimizers.packing import PACK_MAX
    gen = torch.Generator().manual_seed(7)
    sizes = {"a": 37, "b": 40, "big": PACK_MAX + 64}
    start = {k: torch.randn(n, generator=gen).bfloat16() for k, n in sizes.items()}
    grads = [{k: torch.randn(n, generator=gen).bfloat16() for k, n in sizes.items()} for _ in range(3)]
    edit = {"cast": lambda t: t.float(), "copy": lambda t: t.clone(),
            "reshape": lambda t: t.reshape(-1, 1)}[change]

    def run(delayed):
        params = clone(start)
        opt = fo.sgd(0.1, momentum=0.9, delayed=delayed)
        state = opt.init(params)
        for g in grads:
            params, state = opt.update(g, state)
        for k in ("b", "big"):  # (the last update in flight, delayed)
            params[k].data = edit(params[k].data)
        fo.flush(state)
        return params

    want, got = run(False), run(DELAYS[delay])
    for k in sizes:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgds_lookahead_keeps_an_infinite_param_without_weight_decay(kernel, momentum, nesterov):
    """With no weight decay the look-ahead has no decay term (0 * inf made the landed param
    NaN, though the master stayed infinite): the forwards read the infinite param, as without
    ``delayed``."""
    opt = fo.sgd(0.1, momentum=momentum, nesterov=nesterov, weight_decay=0.0, cpu_kernel=kernel,
                 delayed=True)
    params = {"w": torch.tensor([1.0, float("inf"), -2.0])}
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update({"w": torch.ones(3)}, state)
        assert not params["w"].isnan().any() and params["w"][1] == float("inf")
    fo.flush(state)
