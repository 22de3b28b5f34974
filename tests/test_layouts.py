"""Params laid out anew between updates, and grads whose memory holds other values than they
show: each is stepped as a fresh run (or torch.optim) steps it, or refused naming the leaf and
the fix with the state left as it was; never stepped with the layout the state had before.

Every loop runs on the CPU, where the host kernel reads and writes the params' memory: a plain
update, host placement, the delayed update and streamed grads (with clipping in front, the
streamed step runs ahead speculatively)."""

import pytest
import torch

import functional_offload as fo
from conftest import STALE, KERNELS

LR = 1e-2
MODES = ["update", "host", "delayed", "stream", "clipped stream"]
UNSTREAMED = ["update", "host", "delayed"]  # (backward itself refuses a leaf whose shape changed)
IN_PLACE_STREAM = "stream"  # runs host leaves ahead in place: a refusal at finish fails the state


def make_opt(mode: str, kernel: str) -> fo.Optimizer:
    kw = {"cpu_kernel": kernel}
    if mode == "update":
        kw["placement"] = fo.placement.on_device()
    elif mode == "host":
        kw["placement"] = fo.placement.offload_fraction(1.0)
    elif mode == "delayed":
        kw["delayed"] = STALE
    opt = fo.adamw(LR, weight_decay=0.1, **kw)
    return fo.chain(fo.clip_by_global_norm(1e6), opt) if mode == "clipped stream" else opt


def params_of(values: dict, mode: str) -> dict:
    return {k: v.clone().requires_grad_("stream" in mode) for k, v in values.items()}


def step(opt, state, params: dict, grads: dict, mode: str, negate: bool = False):
    """One update of ``params`` with ``grads``; streamed: the grads come out of backward.
    ``negate``: each grad arrives as a negated view of its negatives (same values)."""
    if "stream" not in mode:
        if negate:
            grads = {k: torch._neg_view(-g) for k, g in grads.items()}
        return opt.update(grads, state)
    hooks = [p.register_hook(lambda g: torch._neg_view(-g)) for p in params.values()] if negate else []
    try:
        with fo.stream(opt, state) as s:
            sum((p * grads[k]).sum() for k, p in params.items()).backward()
        return s.finish()
    finally:
        for h in hooks:
            h.remove()
        for p in params.values():
            p.grad = None


def fresh(values: dict, grads: list, mode: str, kernel: str) -> dict:
    """The params after an uninterrupted run of ``grads`` from ``values``."""
    opt = make_opt(mode, kernel)
    p = params_of(values, mode)
    state = opt.init(p)
    for g in grads:
        p, state = step(opt, state, p, g, mode)
    fo.flush(state)
    return p


def count(state) -> int:
    """The step count of a terminal state, or of the one a chain ends in."""
    return int((state[-1] if type(state) is tuple else state).count)


def draw(shapes: dict, steps: int, seed: int = 0) -> tuple[dict, list[dict]]:
    g = torch.Generator().manual_seed(seed)
    values = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    return values, [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(steps)]


def assert_equal(a: dict, b: dict) -> None:
    for k in b:
        assert torch.equal(a[k].detach(), b[k].detach()), k


def refused_then_restored(mode: str, kernel: str, shapes: dict, change, grads_now, match: str):
    """Step once, ``change`` the params (it returns how to undo it), check the next update is
    refused with ``match`` and leaves the state as it was, undo, then step on: the result is an
    uninterrupted run's."""
    values, grads = draw(shapes, 3)
    opt = make_opt(mode, kernel)
    p = params_of(values, mode)
    state = opt.init(p)
    p, state = step(opt, state, p, grads[0], mode)
    before = count(state)
    undo = change(p)
    with pytest.raises((ValueError, TypeError), match=match):
        step(opt, state, p, grads_now(grads[1], p), mode)
    if mode == IN_PLACE_STREAM:
        return  # its host leaves were handed to in-place work during backward
    assert count(state) == before  # left as it was, still usable
    undo()
    for g in grads[1:]:
        p, state = step(opt, state, p, g, mode)
    fo.flush(state)
    assert_equal(p, fresh(values, grads, mode, kernel))


# ---- a param given new strides in its own memory -------------------------------------------

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape,mode", [((6, 6), m) for m in MODES] + [((4, 6), m) for m in UNSTREAMED],
                         ids=lambda x: {(6, 6): "square", (4, 6): "non-square"}.get(x, x))
def test_param_transposed_in_its_own_memory_is_refused(shape, mode, kernel):
    """``param.data = param.data.t()`` between updates (the same memory, new strides; a square
    param keeps its shape): refused naming the leaf, the state as it was; with the layout
    restored the run goes on as if nothing happened."""
    def change(p):
        saved = p["w"].data
        p["w"].data = saved.t()
        return lambda: setattr(p["w"], "data", saved)

    refused_then_restored(mode, kernel, {"w": shape, "b": (5,)}, change,
                          lambda g, p: {"w": g["w"].reshape(p["w"].shape), "b": g["b"]},
                          r"param 'w' is no longer contiguous.*param\.data\.contiguous\(\)")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", UNSTREAMED)
def test_param_transposed_in_place_is_refused(mode, kernel):
    """``param.t_()`` (a non-square param transposed in place, under no_grad): refused."""
    def change(p):
        with torch.no_grad():
            p["w"].t_()

        def undo():
            with torch.no_grad():
                p["w"].t_()
        return undo

    refused_then_restored(mode, kernel, {"w": (4, 6), "b": (5,)}, change,
                          lambda g, p: {"w": g["w"].reshape(6, 4), "b": g["b"]},
                          r"param 'w' is no longer contiguous")


# ---- other layouts the kernels would misread ------------------------------------------------

def _other_memory(make):
    def change(p):
        saved = p["w"].data
        p["w"].data = make(saved)
        return lambda: setattr(p["w"], "data", saved)
    return change


LAYOUTS = {
    "expanded": (_other_memory(lambda w: w[:1].expand(w.shape)), "'w' has elements that share memory"),
    "overlapping": (_other_memory(lambda w: w.reshape(-1).as_strided(w.shape, (1, 1))),
                    "'w' has elements that share memory"),
    "strided slice": (_other_memory(lambda w: torch.zeros(w.shape[0], 2 * w.shape[1])[:, ::2].copy_(w)),
                      "'w' is no longer contiguous"),
    "transposed copy": (_other_memory(lambda w: w.t().contiguous().t()), "'w' is no longer contiguous"),
    "negated view": (_other_memory(torch._neg_view), r"'w' is a negated view.*resolve_neg\(\)"),
    "fewer elements": (_other_memory(lambda w: w.reshape(-1)[1:]), "'w' now has 35 elements.*made for 36"),
    "more elements": (_other_memory(lambda w: torch.cat([w.reshape(-1), w.reshape(-1)])),
                      "'w' now has 72 elements.*made for 36"),
    "another param's memory": (lambda p: _other_memory(lambda w: p["v"].data)(p), "'v' and 'w' share memory"),
}


RESIZED = ("fewer elements", "more elements")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout,mode", [
    (x, m) for x in LAYOUTS for m in MODES
    if m in UNSTREAMED or (x not in RESIZED and (x, m) != ("transposed copy", "stream"))])
def test_param_laid_out_as_the_state_cannot_step_is_refused(layout, mode, kernel):
    """``param.data = x`` between updates where ``x`` is a layout no state laid out for a
    contiguous param can step in place: refused naming the leaf and the fix, the state as it
    was; with the param given back the run goes on as if nothing happened."""
    change, match = LAYOUTS[layout]
    shapes = {"w": (6, 6), "v": (6, 6), "b": (5,)}
    refused_then_restored(mode, kernel, shapes, change,
                          lambda g, p: {k: (g[k].reshape(-1).repeat(2)[:p[k].numel()].reshape(p[k].shape)
                                            if k == "w" else g[k]) for k in g},
                          match)


@pytest.mark.parametrize("mode", ["update", "host", "delayed"])
def test_param_made_a_complex_conjugate_is_refused(mode):
    """``param.data = param.data.to(torch.complex64).conj()`` (the conjugate bit exists only on
    complex tensors): refused by its dtype, naming the leaf, the state as it was."""
    def change(p):
        saved = p["w"].data
        p["w"].data = saved.to(torch.complex64).conj()
        assert p["w"].is_conj()
        return lambda: setattr(p["w"], "data", saved)

    refused_then_restored(mode, "torch", {"w": (6, 6), "b": (5,)}, change,
                          lambda g, p: {"w": g["w"].to(torch.complex64), "b": g["b"]},
                          r"param 'w' is now torch.complex64; only floating params")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["update", "host", "delayed"])
def test_param_negated_before_its_first_update_is_refused(mode, kernel):
    """A param that is a negated view when the state first steps it: refused, nothing changed."""
    values, grads = draw({"w": (6, 6), "b": (5,)}, 1)
    opt = make_opt(mode, kernel)
    p = params_of(values, mode)
    state = opt.init(p)
    p["w"].data = torch._neg_view(p["w"].data)
    with pytest.raises(ValueError, match="'w' is a negated view"):
        opt.update(grads[0], state)
    assert count(state) == 0


# ---- layouts that are followed ---------------------------------------------------------------

FOLLOWED = {
    "contiguous copy of the transpose": lambda w: w.t().contiguous(),
    "same values in other memory": lambda w: w.clone(),
    "a view at an offset of a bigger buffer":
        lambda w: torch.cat([torch.zeros(3), w.reshape(-1)])[3:].view(w.shape),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["update", "host", "stream"])
@pytest.mark.parametrize("layout", list(FOLLOWED))
def test_param_given_contiguous_memory_is_stepped_as_torch_optim_steps_it(layout, mode, kernel):
    """``param.data = x`` with ``x`` contiguous (the fix the refusals name), other memory or a
    storage offset: the state steps the new memory, its moments where torch.optim keeps them
    (fp32 CPU params: the value stepped is the param itself)."""
    make = FOLLOWED[layout]
    values, grads = draw({"w": (6, 6), "b": (5,)}, 3)
    ref = {k: v.clone().requires_grad_() for k, v in values.items()}
    torch_opt = torch.optim.AdamW(list(ref.values()), lr=LR, weight_decay=0.1)
    opt = make_opt(mode, kernel)
    p = params_of(values, mode)
    state = opt.init(p)
    for i, g in enumerate(grads):
        if i == 1:
            p["w"].data = make(p["w"].data)
            ref["w"].data = make(ref["w"].data)
        p, state = step(opt, state, p, g, mode)
        for k, t in ref.items():
            t.grad = g[k].clone()
        torch_opt.step()
    tol = dict(rtol=0, atol=0) if kernel == "torch" else dict(rtol=1e-6, atol=1e-7)
    for k in ref:
        torch.testing.assert_close(p[k].detach(), ref[k].detach(), **tol)


# ---- grads whose memory holds other values than they show -----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_negated_view_grads_are_stepped_as_their_values(mode, kernel, dtype):
    """Grads made with ``torch._neg_view`` (their memory holds the negatives of their values):
    stepped bit for bit as plain grads of the same values."""
    values, grads = draw({"w": (6, 6), "b": (70,)}, 3)
    values = {k: v.to(dtype) for k, v in values.items()}
    grads = [{k: g.to(dtype) for k, g in gs.items()} for gs in grads]
    results = []
    for negate in (False, True):
        opt = make_opt(mode, kernel)
        p = params_of(values, mode)
        state = opt.init(p)
        for g in grads:
            p, state = step(opt, state, p, g, mode, negate=negate)
        fo.flush(state)
        results.append(p)
    assert_equal(results[1], results[0])


def test_conjugated_grads_of_real_params_are_refused():
    """The conjugate bit exists only on complex tensors: such a grad of a real param is refused
    by its dtype, naming the leaf; the state as it was."""
    values, grads = draw({"w": (6, 6), "b": (5,)}, 1)
    opt = fo.adamw(LR)
    state = opt.init(values)
    g = {"w": grads[0]["w"].to(torch.complex64).conj(), "b": grads[0]["b"]}
    assert g["w"].is_conj()
    with pytest.raises(TypeError, match="grad 'w' has dtype torch.complex64"):
        opt.update(g, state)
    assert count(state) == 0
