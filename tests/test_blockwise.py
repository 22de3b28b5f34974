"""Block-wise 8-bit moments (``mu_dtype=torch.uint8`` ...): the format against a by-hand
implementation of the published algorithm (Dettmers et al., arXiv 2110.02861), every registry
optimizer with element-wise moments in every host form and on the device path, checkpoints, and
the errors for what the format does not support."""

from __future__ import annotations

import importlib.util
import math
import os

import optree
import pytest
import torch

import functional_offload as fo
from conftest import KERNELS, delay_of, step_by
from functional_offload.kernels import blockwise, blockwise_cuda
from quantize_cases import values as quantize_values
from registry import OPTIMIZERS

ENTRIES = [e for e in OPTIMIZERS if e.name not in ("sgd", "adafactor")]  # those with moments
N = 70_001  # above the size that keeps fp32 moments; a last block of 113 elements


# ---- the published algorithm, by hand ------------------------------------------------------
def paper_map(signed: bool) -> torch.Tensor:
    """The dynamic tree map as the paper builds it: per decade 10^-6..10^0 (signed: one bit for
    the sign) a linear fraction whose resolution doubles per decade, the midpoints of its bins in
    [0.1, 1]; with 0 and 1. Sorted, fp32."""
    values = [0.0, 1.0]
    for i in range(7):
        bins = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, bins + 1, dtype=torch.float64)
        means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
        values += means.tolist() + ((-means).tolist() if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float32)


def by_hand_quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of 256: absmax, each element's nearest map value (the midpoint rule: the number
    of midpoints below x / absmax; x / absmax as x times the absmax's reciprocal). Returns
    (sorted-map indices, absmax per block)."""
    q = paper_map(signed)
    mids = (q[:-1] + q[1:]) * 0.5
    blocks = torch.nn.functional.pad(x.float(), (0, -x.numel() % 256)).view(-1, 256)
    idx = torch.empty(blocks.shape, dtype=torch.int64)
    absmax = torch.empty(blocks.shape[0])
    for k, b in enumerate(blocks):
        a = b.abs().max() if not b.isnan().any() else torch.tensor(float("nan"))
        inv = 1 / a if a != 0 else torch.tensor(0.0)
        y = b * inv
        idx[k] = (mids[None, :] < y[:, None]).sum(1)
        absmax[k] = a
    return idx.view(-1)[:x.numel()], absmax


def by_hand_dequantize(idx: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    return paper_map(signed)[idx] * absmax.repeat_interleave(256)[:idx.numel()]


def codes_of(q: torch.Tensor, n: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted-map indices and absmax held in the block-wise tensor ``q``."""
    rows = q.view(-1, 260)
    zero = int((paper_map(signed) == 0).nonzero()[0])
    idx = (rows[:, :256].long() + zero) % 256
    return idx.reshape(-1)[:n], rows[:, 256:].contiguous().view(torch.float32).view(-1)


def test_the_dynamic_maps_are_the_papers():
    for signed in (True, False):
        q = torch.tensor(blockwise.dynamic_map(signed), dtype=torch.float32)
        assert torch.equal(q, paper_map(signed))
        assert q.numel() == 256 and (q[1:] > q[:-1]).all() and 0 in q and q[-1] == 1
        assert (q >= 0).all() != signed
    assert (paper_map(True)[:127] == -paper_map(True)[128:255].flip(0)).all()  # sign-symmetric
    assert blockwise.quantize(torch.zeros(300), True).eq(0).all()  # zeros are zero bytes


def _awkward(n: int = 3000) -> torch.Tensor:
    """Values over many decades, a zero block, a NaN block, an inf, a short last block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.logspace(-8, 2, n)[torch.randperm(n, generator=g)]
    x[256:512] = 0
    x[700] = float("nan")
    x[1100] = float("inf")
    x[1300:1556] = x[1300:1556].abs()
    return x


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_is_the_published_algorithm(signed):
    x = _awkward()
    if not signed:
        x = x.abs()
    q = blockwise.quantize(x, signed)
    assert q.numel() == blockwise.nbytes(x.numel()) == 12 * 260
    idx, absmax = by_hand_quantize(x, signed)
    got_idx, got_absmax = codes_of(q, x.numel(), signed)
    assert torch.equal(got_absmax.isnan(), absmax.isnan())
    fin = ~absmax.isnan()
    assert torch.equal(got_absmax[fin], absmax[fin])
    rows = fin.repeat_interleave(256)[:x.numel()]
    assert torch.equal(got_idx[rows], idx[rows])
    back = blockwise.dequantize(q, x.numel(), signed)
    torch.testing.assert_close(back[rows], by_hand_dequantize(idx, absmax, signed)[rows],
                               rtol=0, atol=0, equal_nan=True)  # (the inf's block is non-finite)
    assert back[~rows].isnan().all()  # a NaN poisons its block, as it would an fp32 moment
    ok = rows & x.isfinite() & (absmax.repeat_interleave(256)[:x.numel()].isfinite())
    gap = paper_map(signed).diff().max()  # the coarsest step of the map, times absmax
    err = (back - x).abs()[ok] / absmax.repeat_interleave(256)[:x.numel()][ok].clamp_min(1e-30)
    assert err.max() <= gap / 2 + 1e-6
    assert torch.equal(back[256:512], torch.zeros(256))  # an all-zero block is exact


def test_cutting_a_moment_on_blocks_is_a_byte_range():
    x = _awkward()
    q = blockwise.quantize(x.nan_to_num(0, 0, 0), True)
    a, b = 512, 2900
    part = blockwise.part(q, a, b)
    assert part.data_ptr() == q.data_ptr() + 2 * 260 and part.numel() == blockwise.nbytes(b - a)
    with pytest.raises(ValueError, match="cut on blocks of 256"):
        blockwise.part(q, 100, 600)


def adamw_8bit_by_hand(params: dict, grads: list, lr: float, betas: tuple, eps: float,
                       weight_decay: float) -> tuple[dict, dict, dict]:
    """8-bit AdamW as the paper writes it, on one leaf after another: dequantize the state,
    torch.optim.AdamW's single-tensor step in fp32, quantize the new moments (signed map for
    the first, unsigned for the second). Leaves of at most 65,536 elements keep fp32 moments."""
    b1, b2 = betas
    ps = {k: v.clone() for k, v in params.items()}
    st = {k: (torch.zeros(v.numel()), torch.zeros(v.numel())) for k, v in ps.items()}
    codes = {}
    for t, g in enumerate(grads, 1):
        for k, p in ps.items():
            m, v = st[k]
            gk = g[k].reshape(-1)
            flat = p.view(-1)
            flat.mul_(1 - lr * weight_decay)
            m.lerp_(gk, 1 - b1)
            v.mul_(b2).addcmul_(gk, gk, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
            flat.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
            if p.numel() > 65_536:
                (im, am), (iv, av) = by_hand_quantize(m, True), by_hand_quantize(v, False)
                m.copy_(by_hand_dequantize(im, am, True))
                v.copy_(by_hand_dequantize(iv, av, False))
                codes[k] = (im, am, iv, av)
    return ps, st, codes


def test_8bit_adamw_is_the_published_algorithm_bit_for_bit():
    torch.manual_seed(0)
    params = {"w": torch.randn(N), "b": torch.randn(300)}
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(6)]
    want, _, codes = adamw_8bit_by_hand(params, grads, **hyper)
    opt = fo.adamw(**hyper, mu_dtype=torch.uint8, nu_dtype=torch.uint8, cpu_kernel="torch",
                   executor=fo.executor.HostExecutor(chunk_bytes=1 << 16))  # cut inside the leaf
    ps, state = dict(params), opt.init(params)
    for gr in grads:
        ps, state = opt.update(gr, state)
    assert state.mu["w"].dtype == torch.uint8 and state.mu["b"].dtype == torch.float32
    for k in params:
        assert torch.equal(ps[k], want[k]), k
    im, am, iv, av = codes["w"]
    assert torch.equal(codes_of(state.mu["w"], N, True)[0], im)
    assert torch.equal(codes_of(state.mu["w"], N, True)[1], am)
    assert torch.equal(codes_of(state.nu["w"], N, False)[0], iv)
    assert torch.equal(codes_of(state.nu["w"], N, False)[1], av)


def _train(entry, kernel: str, mode: str, max_norm: float, dtype=torch.float32, steps: int = 5,
           eight: bool = True, **options):
    """``steps`` updates of a leaf with 8-bit moments (and a small one with fp32 moments) by
    fixed grads in ``mode``: "plain", "stream" (fo.stream around a backward), "delayed", "ahead"; chunks
    of 64 KiB cut the big leaf."""
    torch.manual_seed(0)
    params = {"w": torch.randn(N).to(dtype).requires_grad_(),
              "b": torch.randn(5, 7).to(dtype).requires_grad_()}
    dt = torch.uint8 if eight else None
    dtypes = {f"{m}_dtype": dt for m in {"adamw": ("mu", "nu"), "adam": ("mu", "nu"),
                                          "lion": ("mu",)}.get(entry.name.split("-")[0], ("momentum",))}
    opt = fo.chain(fo.clip_by_global_norm(max_norm), entry.make(
        **entry.hypers, **dtypes, cpu_kernel=kernel, delayed=delay_of(mode),
        executor=fo.executor.HostExecutor(chunk_bytes=1 << 16), **options))
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g).to(dtype) for k, v in params.items()}
        state = step_by(opt, state, params, grads, mode)
    fo.flush(state)
    return {k: v.detach() for k, v in params.items()}, state[-1]


def _moments(state) -> dict:
    return {f: getattr(state, f, ()) for f in ("mu", "nu", "momentum")
            if getattr(state, f, ()) != ()}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["stream", "delayed", "ahead"])
@pytest.mark.parametrize("max_norm", [1e9, 1e-2], ids=["clip-never", "clip-scales"])
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_form_steps_8bit_moments_as_the_plain_update(entry, kernel, mode, max_norm):
    if mode in ("delayed", "ahead") and not entry.delayed:
        pytest.skip("no delayed mode")
    p0, s0 = _train(entry, kernel, "plain", max_norm)
    p1, s1 = _train(entry, kernel, mode, max_norm)
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    for field, tree in _moments(s0).items():
        assert tree["w"].dtype == torch.uint8 and tree["b"].dtype == torch.float32
        for k in tree:
            assert torch.equal(tree[k], _moments(s1)[field][k]), (field, k)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_the_native_kernel_quantizes_as_the_torch_kernel(entry):
    if "native" not in KERNELS:
        pytest.skip("no native kernel here")
    pt, st = _train(entry, "torch", "plain", 1e9)
    pn, sn = _train(entry, "native", "plain", 1e9)
    for k in pt:  # the fp32 math differs by rounding (torch's vector kernels), as with fp32 state
        torch.testing.assert_close(pn[k], pt[k], rtol=0, atol=1e-4)
    for field, tree in _moments(st).items():
        a = tree["w"].view(-1, 260)
        b = _moments(sn)[field]["w"].view(-1, 260)
        differ = (a[:, :256] != b[:, :256])
        assert differ.float().mean() < 1e-3, field  # a code flips only at a near-tie
        assert ((a[:, :256].int() - b[:, :256].int()).abs()[differ] == 1).all()
        torch.testing.assert_close(a[:, 256:].contiguous().view(torch.float32),
                                   b[:, 256:].contiguous().view(torch.float32), rtol=1e-5, atol=0)


def test_the_native_search_finds_the_midpoint_count_at_every_midpoint():
    """The native quantizer's search (arithmetic, a midpoint search near midpoints) gives the
    torch kernel's codes exactly: one AdamW step with betas 0 makes mu the grad and nu its square;
    the grads hold every midpoint of both maps, their fp32 neighbours, map values, zeros and
    log-uniform values, with a 1 per block (absmax 1: the quantized value is the grad itself)."""
    if "native" not in KERNELS:
        pytest.skip("no native kernel here")
    (sv, smids), (uv, umids) = _values_and_mids(True), _values_and_mids(False)
    mids = torch.cat([smids, umids.sqrt(), uv.sqrt()])
    near = torch.cat([mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1), -mids, sv,
                      torch.tensor([0.0, -0.0, 1.0, -1.0])])
    g = torch.Generator().manual_seed(0)
    wide = torch.rand(N, generator=g) * 18 - 17  # log10 |x| in [-17, 1]
    wide = (10 ** wide * torch.randn(N, generator=g).sign()).clamp(-1, 1)
    x = torch.cat([near, wide])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 255)).view(-1, 255)
    x = torch.cat([torch.ones(x.shape[0], 1), x], 1).view(-1)
    opt = fo.adamw(lr=1e-3, betas=(0.0, 0.0), mu_dtype=torch.uint8, nu_dtype=torch.uint8,
                   cpu_kernel="native")
    state = opt.init({"w": torch.zeros(x.numel())})
    _, state = opt.update({"w": x}, state)
    assert torch.equal(state.mu["w"], blockwise.quantize(x, signed=True))
    assert torch.equal(state.nu["w"], blockwise.quantize(x * x, signed=False))


@pytest.mark.cuda
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_gpu_kernels_quantize_and_dequantize_as_the_torch_ops(signed):
    """On a CUDA device (Triton's one-pass kernels where Triton imports) the bytes of the torch
    ops on the CPU, for the cases of ``quantize_cases.py``; and the values back."""
    if importlib.util.find_spec("triton") is not None:  # else the torch ops run on the device
        assert blockwise_cuda.available(torch.zeros(1, device="cuda"))
    x = quantize_values(signed)
    want = blockwise.quantize(x, signed)
    got = blockwise.quantize(x.cuda(), signed)
    assert torch.equal(got.cpu(), want)
    back = blockwise.dequantize(want.cuda(), x.numel(), signed).cpu()
    torch.testing.assert_close(back, blockwise.dequantize(want, x.numel(), signed), rtol=0,
                               atol=0, equal_nan=True)


def _values_and_mids(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    v = paper_map(signed)
    return v, (v[:-1] + v[1:]) * 0.5


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_8bit_moments_track_fp32_moments(entry):
    p8, _ = _train(entry, KERNELS[-1], "plain", 1e9, steps=20)
    p32, _ = _train(entry, KERNELS[-1], "plain", 1e9, steps=20, eight=False)
    start = {k: v.float() for k, v in _train(entry, "torch", "plain", 1e9, steps=0)[0].items()}
    moved = (p32["w"].float() - start["w"]).abs().mean()
    off = (p8["w"].float() - p32["w"].float()).abs().mean()
    assert off < 0.05 * moved, (float(off), float(moved))  # within 5% of the distance travelled
    assert torch.equal(p8["b"], p32["b"])  # small leaves keep fp32 moments


def test_8bit_moments_on_the_device_path_follow_the_host():
    entry = ENTRIES[0]
    ph, sh = _train(entry, "torch", "plain", 1e-2)
    pd, sd = _train(entry, "torch", "plain", 1e-2, placement=fo.placement.on_device())
    assert sd.mu["w"].dtype == torch.uint8 and sd.mu["w"].device.type == "cpu"
    for k in ph:  # the device math is torch's multi-tensor one: rounding apart
        torch.testing.assert_close(pd[k], ph[k], rtol=0, atol=1e-4)
    differ = sd.mu["w"].view(-1, 260)[:, :256] != sh.mu["w"].view(-1, 260)[:, :256]
    assert differ.float().mean() < 1e-3


def test_bf16_params_split_masters_and_ema_combine_with_8bit_moments():
    entry = ENTRIES[0]
    for kernel in KERNELS:
        a, sa = _train(entry, kernel, "plain", 1e-2, dtype=torch.bfloat16,
                       store_param_remainders=True, ema_decay=0.9)
        b, sb = _train(entry, kernel, "delayed", 1e-2, dtype=torch.bfloat16,
                       store_param_remainders=True, ema_decay=0.9)
        for k in a:
            assert torch.equal(a[k], b[k]), (kernel, k)
        assert torch.equal(sa.mu["w"], sb.mu["w"]) and torch.equal(sa.ema["w"], sb.ema["w"])


def test_a_checkpoint_holds_the_bytes_and_scales_exactly(tmp_path):
    entry = ENTRIES[0]
    params, state = _train(entry, KERNELS[-1], "plain", 1e9)
    path = os.fspath(tmp_path / "opt.safetensors")
    fo.save(state, path)
    like = fo.adamw(**entry.hypers, mu_dtype=torch.uint8, nu_dtype=torch.uint8).init(params)
    loaded = fo.load(path, like)
    for field in ("mu", "nu"):
        for k in params:
            assert torch.equal(getattr(loaded, field)[k], getattr(state, field)[k])
    again = fo.load_state_dict(fo.state_dict(loaded), like)
    assert torch.equal(again.nu["w"], state.nu["w"])
    fp32 = fo.adamw(**entry.hypers).init(params)
    with pytest.raises(fo.CheckpointError, match="mu.w"):
        fo.load(path, fp32)


@pytest.mark.parametrize("make", [lambda **kw: fo.adamw(1e-2, mu_dtype=torch.uint8, nu_dtype=torch.uint8, **kw),
                                  lambda **kw: fo.lion(1e-3, mu_dtype=torch.uint8, **kw)],
                         ids=["adamw", "lion"])
def test_a_checkpoint_of_8bit_moments_refuses_a_param_of_another_shape(make, tmp_path):
    """8-bit moments are flat bytes of whole blocks, which carry neither the param's shape nor
    its element count (300 x 256 and 76,700 elements both take 300 blocks): the checkpoint
    holds the param's shape beside them, and a load into another shape is refused naming the
    leaf, the state untouched. A state_dict without it (written before) still loads."""
    torch.manual_seed(0)
    params = {"w": torch.randn(300, 256), "b": torch.randn(7)}
    opt = make()
    state = opt.init(params)
    params, state = opt.update({k: torch.randn(p.shape) for k, p in params.items()}, state)
    path = os.fspath(tmp_path / "opt.safetensors")
    fo.save(state, path)
    assert fo.state_dict(state)["param_shape.w"].tolist() == [300, 256]
    for shape in [(256, 300), (76700,)]:
        like = make().init({"w": torch.zeros(shape), "b": torch.zeros(7)})
        with pytest.raises(fo.CheckpointError, match=r"'param_shape.w'.*saved for a param of "
                                                     r"shape \(300, 256\)"):
            fo.load(path, like)
        assert int(like.count) == 0 and not like.mu["w"].any()
    older = {k: v for k, v in fo.state_dict(state).items() if not k.startswith("param_shape.")}
    loaded = fo.load_state_dict(older, make().init({k: torch.zeros_like(p) for k, p in params.items()}))
    assert torch.equal(loaded.mu["w"], state.mu["w"])


def test_what_8bit_moments_do_not_support_is_refused_naming_it():
    with pytest.raises(TypeError, match="torch.uint8: block-wise 8-bit"):
        fo.adamw(mu_dtype=torch.int8)
    with pytest.raises(TypeError, match="param 'w' would have a torch.float64 value"):
        fo.adamw(mu_dtype=torch.uint8).init({"w": torch.zeros(100_000, dtype=torch.float64)})
    with pytest.raises(ValueError, match="mu_dtype"):
        fo.TorchOptimizer([torch.zeros(10, requires_grad=True)], fo.adamw, mu_dtype=torch.uint8).step()
    mixed = fo.adamw(mu_dtype=torch.uint8, nu_dtype=torch.bfloat16, cpu_kernel="native",
                     placement=fo.placement.on_host())
    with pytest.raises(ValueError, match=r"param 'b' would have .* moments \(8-bit moments are "
                                         r"for leaves of more than 65536 elements; its 300 keep "
                                         r"fp32 ones\); .*one moment dtype"):
        mixed.init({"b": torch.zeros(300), "w": torch.zeros(100_000)})
    with pytest.raises(ValueError, match=r"param 'w' would have .*'torch.uint8'\] moments; "):
        mixed.init({"w": torch.zeros(100_000)})


def test_the_plan_counts_8bit_bytes():
    params = {"w": torch.zeros(1 << 20), "b": torch.zeros(100)}
    plan32 = fo.plan(fo.adamw(), params)
    plan8 = fo.plan(fo.adamw(mu_dtype=torch.uint8, nu_dtype=torch.uint8), params)
    ratio = (plan8.host_bytes - 100 * 8) / (plan32.host_bytes - 100 * 8)
    assert ratio == pytest.approx(2 * 260 / 256 / 8)


def test_state_trees_stay_trees_of_tensors():
    params = {"w": torch.zeros(N)}
    state = fo.adamw(mu_dtype=torch.uint8).init(params)
    assert optree.tree_structure(state.mu) == optree.tree_structure(params)
    assert state.mu["w"].shape == (blockwise.nbytes(N),)


PARTIAL = {"w": (300, 700), "u": (200, 400), "v": (90_001,), "b": (37,)}


def _train_gpu(placement, mode: str, split: bool, engine: str = "cpu"):
    """GPU bf16 params (:data:`PARTIAL`) with 8-bit moments, clipped (scaling), 6 steps."""
    torch.manual_seed(0)
    params = {k: torch.randn(s, device="cuda").bfloat16().requires_grad_()
              for k, s in PARTIAL.items()}
    chunks = {} if engine == "cpu" else {"engine_chunk_bytes": 1 << 20}
    opt = fo.chain(fo.clip_by_global_norm(1e-2), fo.adamw(
        1e-2, weight_decay=0.1, mu_dtype=torch.uint8, nu_dtype=torch.uint8, placement=placement,
        store_param_remainders=split, delayed=delay_of(mode),
        executor=fo.executor.HostExecutor(chunk_bytes=1 << 17, slots=3, engine=engine, **chunks)))
    plan = fo.plan(opt, params)
    state = opt.init(params)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(6):
        grads = {k: torch.randn(v.shape, generator=g, device="cuda").bfloat16()
                 for k, v in params.items()}
        state = step_by(opt, state, params, grads, mode)
    fo.flush(state)
    sd = fo.state_dict(state)  # the masters' fp32 values, the moments' codes and scales
    values = {k.removeprefix("1."): v.cpu() for k, v in sd.items()
              if k.startswith(("1.mu.", "1.nu.", "1.master."))}
    values.update({f"param.{k}": v.detach().cpu() for k, v in params.items()})
    return values, dict(zip(plan.paths, plan.on_host))


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["cpu", "gpu"])
@pytest.mark.parametrize("mode", ["plain", "stream", "delayed", "ahead"])
@pytest.mark.parametrize("split", [False, True], ids=["fp32-master", "split-master"])
def test_partial_placement_steps_each_leaf_as_where_it_is_placed(split, mode, engine):
    """``offload_fraction(0.5)`` with 8-bit moments on GPU params: the leaves kept on the device
    step as under ``on_device()``; the offloaded ones as under ``on_host()`` with the CPU kernel,
    and as on the device with the GPU engine (but for the small leaf, packed for the CPU kernel,
    and with the look-ahead, which keeps the CPU form); bit for bit: params, fp32 masters, codes
    and scales."""
    half, where = _train_gpu(fo.placement.offload_fraction(0.5), mode, split, engine)
    assert any(where.values()) and not all(where.values()), where
    host, _ = _train_gpu(fo.placement.on_host(), mode, split)
    device, _ = _train_gpu(fo.placement.on_device(), mode, split)
    assert half.keys() == host.keys() == device.keys()
    for key, got in half.items():
        leaf = key.split(".", 1)[1]
        # the GPU engine steps host leaves but the small one (packed) and look-ahead steps
        engine_steps = engine == "gpu" and mode != "ahead" and PARTIAL[leaf] != (37,)
        want = (host if where[leaf] and not engine_steps else device)[key]
        assert got.dtype == want.dtype and torch.equal(got, want), (key, where[leaf])
    assert half["mu.w"].dtype == torch.uint8
