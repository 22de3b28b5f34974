"""Clipping sums the leaves' norms in the order the params were built, as
``torch.nn.utils.clip_grad_norm_(model.parameters())`` does, and groups devices and dtypes as it
does: the norm, the clipped grads and the training trajectory are torch's bit for bit, on trees
whose insertion order differs from optree's sorted keys (``layers.10`` before ``layers.2``)."""

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.transforms.clipping import leaf_norms


def draw(seed: int, n: int, dtypes=(torch.float32,)) -> list[torch.Tensor]:
    """``n`` small grads of magnitudes 10^-2..10^2, their dtypes cycling through ``dtypes``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, generator=g) * 10.0 ** float(torch.randint(-2, 3, (1,), generator=g)))
            .to(dtypes[i % len(dtypes)]) for i in range(n)]


def sensitive(n: int, differs, dtypes=(torch.float32,)) -> list[torch.Tensor]:
    """Grads whose total norm, summed as torch does, changes when ``differs(grads)`` says the
    reduction order changes it: fp32 rounding makes the order visible."""
    for seed in range(500):
        grads = draw(seed, n, dtypes)
        if differs(grads):
            return grads
    raise AssertionError("no grads found whose norm depends on the order")


def total(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(grads, 2.0)


def sorted_order_matters(names: list[str]):
    """Whether the norm of grads listed as ``names`` differs from theirs in sorted-name order."""
    order = sorted(range(len(names)), key=names.__getitem__)
    return lambda gs: not torch.equal(total(gs), total([gs[i] for i in order]))


def torch_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``clip_grad_norm_`` of params with these grads, in this order: its norm and the grads."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, [p.grad for p in params]


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("max_norm", [1.0, 1e6], ids=["clips", "unclipped"])
def test_a_dict_built_out_of_sorted_order_clips_as_clip_grad_norm(max_norm):
    names = [f"layers.{i}.weight" for i in range(12)]  # sorted: layers.0, layers.1, layers.10, ...
    assert sorted(names) != names
    grads = sensitive(12, sorted_order_matters(names))
    tree = dict(zip(names, grads))
    want_norm, want = torch_clip(grads, max_norm)
    assert_same(fo.global_norm(tree), want_norm)
    clip = fo.clip_by_global_norm(max_norm)
    out, _ = clip.update(tree, clip.init(None))
    assert list(out) == names  # the tree comes back as it was built
    for name, w in zip(names, want):
        assert_same(out[name], w)
    assert_same(clip.global_scale(tree, None), torch.clamp(max_norm / (want_norm + 1e-6), max=1.0))


def test_nested_trees_and_missing_grads_sum_in_build_order():
    grads = sensitive(6, lambda gs: not torch.equal(total(gs), total(gs[::-1])))
    # built: z.b, z.a, y[0], y[1], x, w (sorted: w, x, y[0], y[1], z.a, z.b)
    tree = {"z": {"b": grads[0], "a": grads[1]}, "y": [grads[2], grads[3], None],
            "x": grads[4], "w": grads[5]}
    want_norm, want = torch_clip(grads, 1.0)
    assert_same(fo.global_norm(tree), want_norm)
    out, _ = fo.clip_by_global_norm(1.0).update(tree, ())
    got = [out["z"]["b"], out["z"]["a"], out["y"][0], out["y"][1], out["x"], out["w"]]
    assert out["y"][2] is None and list(out) == ["z", "y", "x", "w"]
    for g, w in zip(got, want):
        assert_same(g, w)


def first_seen_order(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm with the dtype groups taken in order of first appearance (not torch's)."""
    groups: dict = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    norms = torch.cat([torch.stack(torch._foreach_norm(m, 2.0)) for m in groups.values()])
    return torch.linalg.vector_norm(norms, 2.0)


def test_mixed_dtypes_are_grouped_and_summed_as_clip_grad_norm():
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    grads = sensitive(6, lambda gs: not torch.equal(total(gs), first_seen_order(gs)), dtypes)
    tree = {f"p{i}": g for i, g in enumerate(grads)}  # insertion order = sorted order here
    want_norm, want = torch_clip(grads, 1.0)
    assert_same(fo.global_norm(tree), want_norm)
    out, _ = fo.clip_by_global_norm(1.0).update(tree, ())
    for i, w in enumerate(want):
        assert_same(out[f"p{i}"], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_and_small_leaves_clip_as_clip_grad_norm_without_touching_the_input(dtype):
    g = torch.Generator().manual_seed(0)
    big = 1 << 16  # a leaf this large is multiplied into a tensor of its own, smaller share one
    grads = [torch.randn(big, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype),
             torch.randn(64, big // 32, generator=g).to(dtype).t(),  # large, not contiguous
             torch.randn(5, generator=g).to(dtype), torch.randn(big - 1, generator=g).to(dtype)]
    kept = [x.clone() for x in grads]
    tree = {f"p{i}": x for i, x in enumerate(grads)}
    want_norm, want = torch_clip(grads, 1.0)
    out, _ = fo.clip_by_global_norm(1.0).update(tree, ())
    for i, w in enumerate(want):
        assert_same(out[f"p{i}"], w)
        assert out[f"p{i}"].shape == grads[i].shape and out[f"p{i}"].is_contiguous()
        assert_same(grads[i], kept[i])
    alone = [x.untyped_storage().nbytes() == x.numel() * x.element_size() for x in out.values()]
    assert alone == [True, False, False, False, False]  # memory of its own: the large contiguous one


def test_leaf_norms_come_in_leaf_order_with_mixed_dtypes():
    grads = draw(0, 5, (torch.float32, torch.bfloat16))
    for n, g in zip(leaf_norms(grads, 2.0), grads):
        assert_same(n, torch.linalg.vector_norm(g, 2.0))


class Layers(torch.nn.Module):
    """Twelve layers: ``named_parameters()`` lists ``layers.2`` before ``layers.10``; their
    gains spread the grads' norms over orders of magnitude (so that fp32 rounding of their sum
    depends on the order)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(12))
        self.gains = [10.0 ** (i % 5 - 2) for i in range(12)]

    def forward(self, x):
        for layer, gain in zip(self.layers, self.gains):
            x = torch.tanh(layer(x) * gain) / gain
        return x


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)) for _ in range(steps)]


def torch_training(steps: int) -> dict[str, torch.Tensor]:
    """torch's run, after checking that the order of the norms' sum mattered in one of its
    steps (else the test would not tell the orders apart)."""
    model = Layers()
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mattered = False
    for x, y in batches(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        mattered |= sorted_order_matters(names)([p.grad for p in model.parameters()])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert mattered
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("loop", ["update", "stream", "TorchOptimizer"])
def test_training_with_clipping_is_torch_bit_for_bit(loop):
    """A clipped SGD run of 12 steps (fp32, CPU, the torch kernel; SGD's step is proportional
    to the clipped grad, so a norm off by one ulp shows) is torch's, bit for bit, in the
    functional loop, streamed, and as a torch.optim.Optimizer."""
    steps = 12
    model = Layers()
    params = dict(model.named_parameters())
    if loop == "TorchOptimizer":
        opt = fo.TorchOptimizer(model.named_parameters(), fo.sgd, lr=0.1, momentum=0.9,
                                cpu_kernel="torch", max_grad_norm=0.05)
    else:
        opt = fo.chain(fo.clip_by_global_norm(0.05), fo.sgd(0.1, momentum=0.9, cpu_kernel="torch"))
        state = opt.init(params)
    for x, y in batches(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if loop == "stream":
            with fo.stream(opt, state) as s:
                loss.backward()
            _, state = s.finish()
        else:
            loss.backward()
            if loop == "update":
                _, state = opt.update({n: p.grad for n, p in params.items()}, state)
            else:
                opt.step()
        model.zero_grad(set_to_none=True)
    want = torch_training(steps)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name


def test_the_clip_factor_is_the_same_from_any_thread():
    """optree's insertion-order mode is global: flattening under it from several threads at
    once still sums every tree in its own build order."""
    import concurrent.futures

    names = [f"layers.{i}" for i in range(12)]
    grads = sensitive(12, sorted_order_matters(names))
    tree = dict(zip(names, grads))
    want = total(grads)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: fo.global_norm(tree), range(200)))
    for g in got:
        assert_same(g, want)
    assert optree.tree_leaves(tree) == [tree[n] for n in sorted(names)]  # optree's own order


def test_norm_dtype_computes_the_norm_and_factor_in_it():
    """bf16 grads: by default the norm and factor are torch's (bf16); with ``norm_dtype`` both
    are fp32 (as Megatron-LM clips) and the grads keep their dtype; fp64 leaves keep theirs."""
    g = torch.Generator().manual_seed(3)
    grads = {f"l{i}": torch.randn(257 + i, generator=g).bfloat16() for i in range(6)}
    leaves = list(grads.values())
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x, dtype=torch.float32)
                                                 for x in leaves]))
    coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    assert coef.dtype == torch.float32
    clip = fo.clip_by_global_norm(1.0, norm_dtype=torch.float32)
    assert_same(clip.global_scale(grads), coef)
    out, _ = clip.update(grads, clip.init(None))
    for k, x in grads.items():
        assert_same(out[k], (x.float() * coef).bfloat16())
    torch_norm, torch_grads = torch_clip(leaves, 1.0)  # the default: torch's bf16 norm
    plain, _ = fo.clip_by_global_norm(1.0).update(grads, None)
    assert torch_norm.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(plain.values(), torch_grads))
    assert any(not torch.equal(plain[k], out[k]) for k in grads)  # rounding the norm shows
    wide = {"a": torch.randn(5, dtype=torch.float64), "b": torch.randn(7).bfloat16()}
    got, _ = fo.clip_by_global_norm(0.5, norm_dtype=torch.float32).update(wide, None)
    b = torch.linalg.vector_norm(wide["b"], dtype=torch.float32).double()
    n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(wide["a"]), b]))
    assert_same(got["a"], wide["a"] * torch.clamp(0.5 / (n + 1e-6), max=1.0))


@pytest.mark.parametrize("bad", [torch.bfloat16, torch.int32, "float32"])
def test_norm_dtype_other_than_fp32_or_fp64_is_refused(bad):
    with pytest.raises(ValueError, match="norm_dtype"):
        fo.clip_by_global_norm(1.0, norm_dtype=bad)
