"""Activation offload: gradients identical to no offload, hygiene, and the errors that name fixes.

On the CPU the hooks are a pass-through by default; ``copy_on_cpu=True`` runs the copies through
the pinned-pool bookkeeping (dedup, prefetch, release) so those are exercised here too.
"""

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.activations import ActivationOffload

D, GROUPS = 32, 4


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"b{i}": {"w1": torch.randn(4 * D, D, generator=g) / D ** 0.5,
                      "w2": torch.randn(D, 4 * D, generator=g) / (4 * D) ** 0.5} for i in range(GROUPS)}


def forward(params, x, off=None):
    for i in range(GROUPS):
        ctx = off.group(i) if off else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            p = params[f"b{i}"]
            h = torch.nn.functional.gelu(x @ p["w1"].t())
            x = x + h @ p["w2"].t()
    return x.square().mean()


def reference_grads(params, x):
    leaves, spec = optree.tree_flatten(params)
    inputs = [p.detach().requires_grad_() for p in leaves]
    loss = forward(optree.tree_unflatten(spec, inputs), x)
    return loss.detach(), optree.tree_unflatten(spec, list(torch.autograd.grad(loss, inputs)))


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("offload", [GROUPS - 1, 0.5, 0])
def test_value_and_grad_bit_identical(copy, offload):
    params, x = make_params(), torch.randn(64, D)
    off = ActivationOffload(GROUPS, offload, min_bytes=0, copy_on_cpu=copy)
    loss, grads = off.value_and_grad(lambda p, x: forward(p, x, off))(params, x)
    want_loss, want = reference_grads(params, x)
    assert torch.equal(loss, want_loss)
    for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(want)):
        assert torch.equal(a, b)
    expect = copy and off.offloaded_groups > 0
    assert (off.stats["offloaded_bytes"] > 0) == expect
    assert off._records == []  # released at the end of backward


def test_module_loop_with_backward_and_no_leak():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                                     torch.nn.Linear(4 * D, D)) for _ in range(GROUPS))
    blocks.register_buffer("scale", torch.full((D,), 0.5))
    off = ActivationOffload(GROUPS, GROUPS - 1, min_bytes=0, copy_on_cpu=True)
    x = torch.randn(16, D)

    def run(offload):
        blocks.zero_grad(set_to_none=True)
        with (off.record(exclude=blocks) if offload else torch.enable_grad()):
            h = x
            for i, b in enumerate(blocks):
                with (off.group(i) if offload else torch.enable_grad()):
                    h = h + b(h) * blocks.scale
            loss = h.square().mean()
        loss.backward()
        return [p.grad.clone() for p in blocks.parameters()]

    want = run(False)
    for step in range(100):
        got = run(True)
        if step == 0:
            pooled = off.pinned_bytes
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    assert off.pinned_bytes == pooled and off._records == []  # no growth over 100 steps


def test_params_buffers_and_small_tensors_stay():
    off = ActivationOffload(2, 1, min_bytes=1024, copy_on_cpu=True)
    w = torch.randn(64, 64, requires_grad=True)
    with off.record(exclude={"w": w}), off.group(0):
        assert not off._offloads(w)  # a param
        assert not off._offloads(torch.randn(8))  # 32 bytes < min_bytes
        assert off._offloads(torch.randn(64, 64))
    with off.record(), off.group(1):
        assert not off._offloads(torch.randn(64, 64))  # the last group is never offloaded


def test_views_of_one_storage_are_copied_once():
    off = ActivationOffload(2, 1, min_bytes=0, copy_on_cpu=True)
    a = torch.randn(32, 32, requires_grad=True)
    with off.record(exclude=[a]), off.group(0):
        h = a * 2
        y = h.sin().sum() + h.view(-1).cos().sum() + h.t().pow(3).sum()  # three views of h saved
    assert len(off._records) == 1 and off._records[0].nbytes == 32 * 32 * 4
    y.backward()
    ref = a.detach().requires_grad_()
    h = ref * 2
    (h.sin().sum() + h.view(-1).cos().sum() + h.t().pow(3).sum()).backward()
    assert torch.equal(a.grad, ref.grad)


def test_eval_forward_is_harmless():
    params, x = make_params(), torch.randn(8, D)
    off = ActivationOffload(GROUPS, 2, min_bytes=0, copy_on_cpu=True)
    with torch.no_grad(), off.record():
        forward(params, x, off)
    assert off._records == []
    with off.record():  # a forward whose backward never runs...
        forward({k: {n: t.requires_grad_() for n, t in v.items()} for k, v in make_params().items()}, x, off)
    assert off._records
    loss, _ = off.value_and_grad(lambda p, x: forward(p, x, off))(make_params(), x)  # ...is dropped
    assert off._records == [] and torch.isfinite(loss)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="never the last"):
        ActivationOffload(4, 4)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        ActivationOffload(4, 1.5)
    with pytest.raises(ValueError, match="both offloaded and recomputed"):
        ActivationOffload(4, 2, recompute_groups=[1, 3])
    off = ActivationOffload(4, 2, copy_on_cpu=True)
    with pytest.raises(ValueError, match="out of range"):
        with off.group(4):
            pass

    def loss_fn(p, x):
        with off.record():
            return forward(p, x, off)

    with pytest.raises(RuntimeError, match="value_and_grad"):
        torch.func.grad(loss_fn)(make_params(), torch.randn(4, D))
    assert fo.ActivationOffload is ActivationOffload


def test_bounded_inflight_and_host_cap_keep_grads_identical():
    params, x = make_params(), torch.randn(64, D)
    want_loss, want = reference_grads(params, x)
    for kw in (dict(max_inflight_bytes=1), dict(host_cap_bytes=64 * 4 * D * 4), dict(prefetch=3)):
        off = ActivationOffload(GROUPS, GROUPS - 1, min_bytes=0, copy_on_cpu=True, **kw)
        loss, grads = off.value_and_grad(lambda p, x: forward(p, x, off))(params, x)
        assert torch.equal(loss, want_loss)
        for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(want)):
            assert torch.equal(a, b)
        if "host_cap_bytes" in kw:
            assert off.pinned_bytes <= kw["host_cap_bytes"]
