"""The GPU engine (``HostExecutor(engine="gpu")``): host-resident leaves stepped on their params'
GPU give the bits of ``placement=on_device()``. The CUDA tests (marker ``cuda``) skip without a
GPU; the option's checks and the chunking run everywhere."""

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor
from functional_offload.executor.pinned import pin_all
from functional_offload.optimizers.forms.gpu_engine import chunks, state_of
from functional_offload.optimizers.layout import Leaf, with_flat_views
from functional_offload.placement import on_device, on_host
from functional_offload.testing import fail_host_kernel

from conftest import grad_seq, make_params
from registry import OPTIMIZERS

ELEMENTWISE = [e for e in OPTIMIZERS if e.delayed]  # delayed=True needs element-wise math


def matrices(params):
    """The weight-decay mask of the tests: decay on the leaves of more than one dimension."""
    return optree.tree_map(lambda p: p.ndim > 1, params)


def run(entry, placement, engine, dtype=torch.float32, ema=False, mask=False, chunk_bytes=4096,
        steps=3, delayed=False):
    """``steps`` updates of CUDA params (the second without a grad for one leaf); the params
    and the state's tensors by name (on the CPU)."""
    params = make_params(0, dtype, device="cuda", big=True)
    ex = HostExecutor(chunk_bytes=chunk_bytes, slots=2, engine=engine)
    kw = dict(entry.hypers, placement=placement, executor=ex)
    if ema:
        kw["ema_decay"] = 0.9
    if mask:
        kw["weight_decay_mask"] = matrices
    if delayed:
        kw["delayed"] = True
    opt = entry.make(**kw)
    state = opt.init(params)
    for n, g in enumerate(grad_seq(params, steps)):
        if n == 1:
            g["layer1"]["bias"] = None
        params, state = opt.update(g, state)
    fo.flush(state)
    return optree.tree_map(lambda p: p.detach().cpu(), params), {
        k: v.cpu() for k, v in fo.state_dict(state).items()}


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    for x, y in zip(optree.tree_leaves(pa), optree.tree_leaves(pb)):
        assert torch.equal(x, y)
    common = sa.keys() & sb.keys()
    assert {k for k in common if not k.startswith("master")} == {
        k for k in sb if not k.startswith("master")}
    for k in common:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.cuda
@pytest.mark.parametrize("entry", ELEMENTWISE, ids=lambda e: e.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ema", [False, True], ids=["", "ema"])
@pytest.mark.parametrize("mask", [False, True], ids=["", "mask"])
def test_bits_of_on_device(entry, dtype, ema, mask):
    assert_same(run(entry, on_host(), "gpu", dtype, ema, mask),
                run(entry, on_device(), "cpu", dtype, ema, mask))


@pytest.mark.cuda
@pytest.mark.parametrize("entry", ELEMENTWISE[:1], ids=lambda e: e.name)
def test_one_chunk_and_strided_params(entry):
    assert_same(run(entry, on_host(), "gpu", chunk_bytes=32 << 20), run(entry, on_device(), "cpu"))
    ex = HostExecutor(chunk_bytes=4096, slots=2, engine="gpu")
    outs = []
    for placement, executor, strided in ((on_host(), ex, True), (on_device(), None, False)):
        params = make_params(0, device="cuda", big=True)
        if strided:  # the same values in transposed memory
            params["layer1"]["weight"] = params["layer1"]["weight"].t().contiguous().t()
        opt = entry.make(**entry.hypers, placement=placement, executor=executor)
        state = opt.init(params)
        for g in grad_seq(params, 2):
            params, state = opt.update(g, state)
        outs.append([p.cpu() for p in optree.tree_leaves(params)])
    assert all(torch.equal(x, y) for x, y in zip(*outs))


@pytest.mark.cuda
def test_delayed_keeps_its_form():
    """A delayed step with engine="gpu" runs as delayed steps do: the bits of engine="cpu"."""
    entry = ELEMENTWISE[0]
    assert_same(run(entry, on_host(), "gpu", delayed=True),
                run(entry, on_host(), "cpu", delayed=True))


@pytest.mark.cuda
def test_failure_marks_the_state():
    entry = ELEMENTWISE[0]
    for after, fails in ((0, False), (1, True)):
        params = make_params(0, device="cuda", big=True)
        opt = entry.make(**entry.hypers, placement=on_host(),
                         executor=HostExecutor(chunk_bytes=4096, slots=2, engine="gpu"))
        state = opt.init(params)
        g = grad_seq(params, 1)[0]
        with fail_host_kernel(after=after):
            with pytest.raises(fo.HostStepError, match="injected failure"):
                opt.update(g, state)
        if fails:  # chunks were stepped: params and state partly new
            with pytest.raises(fo.StateError, match="failed"):
                opt.update(g, state)
        else:  # nothing began: the state is as it was
            assert int(state.count) == 0
            opt.update(g, state)


@pytest.mark.cuda
def test_host_state_is_pinned_through_a_save_and_load(tmp_path):
    """The engine copies the state in place: it is pinned (packed small leaves too), and a load
    fills it in place."""
    entry = ELEMENTWISE[0]
    params = make_params(0, device="cuda", big=True)
    opt = entry.make(**entry.hypers, placement=on_host(),
                     executor=HostExecutor(chunk_bytes=4096, slots=2, engine="gpu"))
    state = opt.init(params)
    for g in grad_seq(params, 2):
        params, state = opt.update(g, state)
    fo.save(state, tmp_path / "s")
    loaded = fo.load(tmp_path / "s", like=opt.init(params))
    for s in (state, loaded):
        host = [x for x in optree.tree_leaves(s)
                if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.ndim > 0]
        assert host and all(x.is_pinned() for x in host)
    params, loaded = opt.update(grad_seq(params, 1)[0], loaded)  # steps from the loaded state


@pytest.mark.cuda
def test_state_replaced_by_pageable_tensors_steps_the_same():
    """A state whose moments the caller replaced by pageable copies is still stepped right (its
    copies are synchronous): the bits of placement=on_device()."""
    entry = next(e for e in ELEMENTWISE if e.name == "adamw")
    outs = []
    for placement, engine in ((on_host(), "gpu"), (on_device(), "cpu")):
        params = make_params(0, device="cuda", big=True)
        opt = entry.make(**entry.hypers, placement=placement,
                         executor=HostExecutor(chunk_bytes=4096, slots=2, engine=engine))
        state = opt.init(params)
        state = state._replace(mu=optree.tree_map(lambda x: x.clone(), state.mu))
        assert engine == "cpu" or not any(x.is_pinned() for x in optree.tree_leaves(state.mu))
        for g in grad_seq(params, 2):
            params, state = opt.update(g, state)
        outs.append([p.cpu() for p in optree.tree_leaves(params)])
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_bad_engine_refused():
    for bad in ("tpu", "GPU", None, 1):
        with pytest.raises(ValueError, match="engine must be 'cpu' or 'gpu'"):
            HostExecutor(engine=bad)
    assert HostExecutor().engine == "cpu"


@pytest.mark.parametrize("delayed", [False, True])
def test_gpu_engine_refuses_cpu_params(delayed):
    params = make_params(0)
    opt = fo.adamw(lr=1e-2, placement=on_host(), delayed=delayed,
                   executor=HostExecutor(engine="gpu"))
    with pytest.raises(ValueError, match=r"engine='gpu'.* on cpu"):
        opt.init(params)  # (CPU params' state is host-resident whatever the placement)


@pytest.mark.parametrize("options, what", [
    (dict(store_param_remainders=True), "store_param_remainders"),
    (dict(mu_dtype=torch.uint8, nu_dtype=torch.uint8), "block-wise 8-bit moments")])
def test_gpu_engine_refuses_the_formats_it_does_not_step(options, what):
    """The engine was built before the split master and the 8-bit moments: init refuses them,
    naming the leaf, instead of stepping their bytes as fp32."""
    params = {"w": torch.randn(70_001).to(torch.bfloat16)}  # above the packed size
    opt = fo.adamw(lr=1e-2, placement=on_host(), executor=HostExecutor(engine="gpu"), **options)
    with pytest.raises(ValueError, match=rf"param 'w'.*engine='gpu'.*{what}"):
        opt.init(params)


def test_chunks_cover_the_leaves():
    sizes = [5, 3000, 1, 700, 4096]
    leaves = [with_flat_views(Leaf(
                  f"p{i}", p, p, p, (torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)),
                  torch.zeros(n), True, True))
              for i, n in enumerate(sizes) for p in [torch.zeros(n)]]
    out = chunks(leaves, [0, 1, 3, 4], 4096)
    assert len(out) > 1 and all(c.nbytes <= 4096 for c in out)
    covered = {}
    for c in out:
        for p in c.pieces:
            assert covered.get(p.index, 0) == p.lo < p.hi  # in order, no gap
            covered[p.index] = p.hi
            ends = [off + (p.hi - p.lo) * x.element_size()
                    for off, x in zip(p.offsets, state_of(leaves[p.index]))]
            assert all(a <= b for a, b in zip(ends, p.offsets[1:])) and ends[-1] <= c.nbytes
    assert covered == {0: 5, 1: 3000, 3: 700, 4: 4096}


@pytest.mark.parametrize("numel", [3072, 1050, 5, 70001, 4100])
def test_pieces_keep_the_whole_leafs_kernel_path(numel):
    """Cut leaves take the multi-tensor kernels' path of the whole leaf: pieces of a length
    divisible by 4 start 64 elements apart; others have no piece both aligned and of such a
    length (Adam's L2 step rounded one element in a thousand differently on the other path)."""
    value = torch.zeros(numel)
    leaf = with_flat_views(Leaf("w", value, value, value, (torch.zeros(numel), torch.zeros(numel)),
                                None, True, True))
    pieces = [(p.lo, p.hi) for c in chunks([leaf], [0], 4096) for p in c.pieces]
    assert pieces[0][0] == 0 and pieces[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    for lo, hi in pieces:
        if numel % 4 == 0:
            assert lo % 64 == 0 and (hi - lo) % 4 == 0
        else:
            assert (hi - lo) % 4 != 0 or lo % 4 != 0


def test_a_chunk_too_small_for_one_element_is_refused():
    value = torch.zeros(1000)
    leaf = with_flat_views(Leaf("w", value, value, value, (torch.zeros(1000), torch.zeros(1000)),
                                None, True, True))
    with pytest.raises(ValueError, match="capacity 200 bytes"):
        chunks([leaf], [0], 200)


def test_pinned_arenas_hold_the_state_in_little_more_than_its_bytes():
    """pin_all lays the tensors out in arenas of about the binary digits of their bytes, so torch's
    pinned allocator, which rounds each block up to a power of two, takes little more than the
    tensors' bytes (tensor by tensor it takes up to twice). Laid out unpinned here (no CUDA)."""
    d, vocab, layers = 96, 5000, 8
    shapes = [(vocab, d)] + [s for _ in range(layers)
                             for s in ((3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (d, 4 * d))]
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g).to(dt)
          for s in shapes for dt in (torch.float32, torch.bfloat16)]
    ts += [None, torch.empty(0), torch.zeros((), dtype=torch.int64)]
    out = pin_all(ts, pin=False)
    spans, arenas = [], {}
    for t, x in zip(ts, out):
        if t is None:
            assert x is None
            continue
        assert x.is_contiguous() and x.dtype == t.dtype and x.shape == t.shape and torch.equal(x, t)
        s = x.untyped_storage()
        arenas[s.data_ptr()] = s.nbytes()
        lo = x.data_ptr()
        spans.append((lo, lo + x.numel() * x.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two tensors share a byte
    pinned = sum(1 << (n - 1).bit_length() for n in arenas.values())  # as torch rounds them
    tensor_by_tensor = sum(1 << max(0, (t.numel() * t.element_size() - 1).bit_length())
                           for t in ts if t is not None)
    used = sum(t.numel() * t.element_size() for t in ts if t is not None)
    assert pinned <= 1.15 * used + (1 << 21) < tensor_by_tensor, (pinned, used, tensor_by_tensor)
