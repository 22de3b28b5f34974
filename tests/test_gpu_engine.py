"""The GPU engine (``HostExecutor(engine="gpu")``): host-resident leaves stepped on their params'
GPU give the bits of ``placement=on_device()``. The CUDA tests (marker ``cuda``) skip without a
GPU; the option's checks and the chunking run everywhere."""

import os
import subprocess
import sys

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor, SplitStep, Timeline
from functional_offload.executor.pinned import pin_all
from functional_offload.kernels import blockwise
from functional_offload.optimizers.forms.gpu_engine import chunks, state_of, steppable, takes
from functional_offload.optimizers.forms.split import (PHI, TOL, WARM, SplitPlan, next_share,
                                                        plan, remember)
from functional_offload.optimizers.layout import Leaf, with_flat_views
from functional_offload.placement import on_device, on_host
from functional_offload.testing import fail_host_kernel, slow_host_kernel

from conftest import FORMATS, grad_seq, make_params
from registry import OPTIMIZERS

ELEMENTWISE = [e for e in OPTIMIZERS if e.delayed]  # delayed=True needs element-wise math


def matrices(params):
    """The weight-decay mask of the tests: decay on the leaves of more than one dimension."""
    return optree.tree_map(lambda p: p.ndim > 1, params)


def run(entry, placement, engine, dtype=torch.float32, ema=False, mask=False, chunk_bytes=4096,
        steps=3, delayed=False, **formats):
    """``steps`` updates of CUDA params (the second without a grad for one leaf); the params
    and the state's tensors by name (on the CPU). ``formats``: state formats' options."""
    params = make_params(0, dtype, device="cuda", big=True)
    ex = HostExecutor(chunk_bytes=chunk_bytes, slots=2, engine=engine,
                      engine_chunk_bytes=None if engine == "cpu" else chunk_bytes)
    kw = dict(entry.hypers, placement=placement, executor=ex, **formats)
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
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("ema", [False, True], ids=["", "ema"])
def test_formats_give_the_bits_of_on_device(fmt, ema):
    """The split master and 8-bit moments on the leaves above the packed size: the engine's
    chunks (cut on whole blocks; ``w2``, of a length not divisible by 4, whole) give the bits
    of the same formats on the device. (The small leaves keep fp32 masters on the host, split
    ones on the device: not compared.)"""
    options = dict(FORMATS[fmt], **({"ema_decay": 0.9} if ema else {}))
    got, got_state, _ = run_split("gpu", dtype=torch.bfloat16, chunk_bytes=2 << 20, **options)
    want, want_state, _ = run_split("cpu", dtype=torch.bfloat16, placement=on_device(),
                                    chunk_bytes=2 << 20, **options)
    for k in ("emb", "w1", "w2"):
        assert_leaf_same(k, got, got_state, want, want_state)


@pytest.mark.cuda
@pytest.mark.parametrize("entry", ELEMENTWISE[:1], ids=lambda e: e.name)
def test_one_chunk_and_strided_params(entry):
    assert_same(run(entry, on_host(), "gpu", chunk_bytes=32 << 20), run(entry, on_device(), "cpu"))
    ex = HostExecutor(chunk_bytes=4096, slots=2, engine="gpu", engine_chunk_bytes=4096)
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
def test_timeline_records_the_engines_copies_and_math():
    """Each chunk's state goes up and comes down on the engine's lanes, its math on the GPU's."""
    tl = Timeline()
    params = make_params(0, device="cuda", big=True)
    opt = fo.adamw(1e-2, placement=on_host(),
                   executor=HostExecutor(chunk_bytes=4096, slots=2, engine="gpu", timeline=tl,
                                         engine_chunk_bytes=4096))
    state = opt.init(params)
    for g in grad_seq(params, 1):
        params, state = opt.update(g, state)
    events = tl.events()
    ups = [e["name"] for e in events if e["lane"] == "H2D engine"]
    downs = [e["name"] for e in events if e["lane"] == "D2H engine"]
    assert len(ups) > 1 and sorted(ups) == sorted(n.replace("down", "up") for n in downs)
    assert any(e["lane"] == "GPU update" for e in events)
    assert all(e["dur_us"] >= 0 for e in events)
    assert tl.lanes(events).index("D2H engine") < tl.lanes(events).index("H2D engine")


@pytest.mark.cuda
def test_a_delayed_step_takes_bigger_engine_chunks():
    """Beside the caller's forward and backward a delayed step's engine cuts chunks four times
    the executor's (fewer calls, each of which may wait behind the caller's kernels)."""
    tl = Timeline()
    ex = HostExecutor(chunk_bytes=4096, slots=2, engine="gpu", timeline=tl, engine_chunk_bytes=4096)
    assert ex.engine_chunk(beside=True) == 4 * ex.engine_chunk() == 4 * 4096
    counts = []
    for delayed in (False, fo.Delay(lookahead=False)):
        params = make_params(0, device="cuda", big=True)
        opt = fo.adamw(1e-2, placement=on_host(), executor=ex, delayed=delayed)
        state = opt.init(params)
        tl.clear()
        params, state = opt.update(grad_seq(params, 1)[0], state)
        fo.flush(state)
        counts.append(len({e["name"] for e in tl.events() if e["lane"] == "H2D engine"}))
    plain, beside = counts
    assert 1 < beside and 3 * beside <= plain, counts


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
                         executor=HostExecutor(chunk_bytes=4096, slots=2, engine="gpu",
                                               engine_chunk_bytes=4096))
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
@pytest.mark.parametrize("engine", ["gpu", "both"])
@pytest.mark.parametrize("delayed", [False, fo.Delay(lookahead=False)], ids=["plain", "delayed"])
def test_host_state_is_pinned_through_a_save_and_load(tmp_path, engine, delayed):
    """The engine copies the state in place, in plain and delayed steps: it is pinned (packed
    small leaves too, with engine='gpu'; with 'both' the leaves it can step), and a load fills
    it in place. (Pageable state is copied synchronously, through the driver's staging: 6x
    slower at 6.7 B.)"""
    entry = next(e for e in ELEMENTWISE if e.name == "adamw")
    params = {**make_params(0, device="cuda", big=True),  # packed small leaves, and one not
              "w": torch.randn(300, 300, device="cuda")}
    opt = entry.make(**entry.hypers, placement=on_host(), delayed=delayed,
                     executor=HostExecutor(chunk_bytes=4096, slots=2, engine=engine,
                                           engine_chunk_bytes=4096))
    state = opt.init(params)
    for g in grad_seq(params, 2):
        params, state = opt.update(g, state)
    state = fo.flush(state)
    if engine == "both":  # the big leaf, which the engine can step
        assert all(x.is_pinned() for x in (state.mu["w"], state.nu["w"]))
        return
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
                         executor=HostExecutor(chunk_bytes=4096, slots=2, engine=engine,
                                               engine_chunk_bytes=4096 if engine == "gpu" else None))
        state = opt.init(params)
        state = state._replace(mu=optree.tree_map(lambda x: x.clone(), state.mu))
        assert engine == "cpu" or not any(x.is_pinned() for x in optree.tree_leaves(state.mu))
        for g in grad_seq(params, 2):
            params, state = opt.update(g, state)
        outs.append([p.cpu() for p in optree.tree_leaves(params)])
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_bad_engine_refused():
    for bad in ("tpu", "GPU", None, 1):
        with pytest.raises(ValueError, match="engine must be 'cpu', 'gpu' or 'both'"):
            HostExecutor(engine=bad)
    assert HostExecutor().engine == "cpu"


@pytest.mark.parametrize("engine, share", [("gpu", 0.5), ("cpu", 0.5), ("both", 1.5),
                                           ("both", -0.1), ("both", True), ("both", "half")])
def test_bad_gpu_share_refused(engine, share):
    with pytest.raises(ValueError, match="gpu_share must be None or a number in"):
        HostExecutor(engine=engine, gpu_share=share)


@pytest.mark.parametrize("engine, size", [("cpu", 1 << 20), ("gpu", 4095), ("both", 4096 + 1),
                                          ("gpu", True), ("both", 1.5e6)])
def test_bad_engine_chunk_bytes_refused(engine, size):
    with pytest.raises(ValueError, match="engine_chunk_bytes must be None or an int >= 4096"):
        HostExecutor(engine=engine, engine_chunk_bytes=size)


def test_engine_chunk_bytes_defaults_to_128_mib():
    assert HostExecutor(chunk_bytes=1 << 16, engine="gpu").engine_chunk_bytes == 128 << 20
    assert HostExecutor(engine="both", engine_chunk_bytes=1 << 27).engine_chunk_bytes == 1 << 27


@pytest.mark.cuda
def test_engine_chunks_are_cut_by_engine_chunk_bytes():
    """The engine's chunks and buffers take engine_chunk_bytes, not the CPU kernel's
    chunk_bytes: 4 KiB engine chunks beside 1 MiB ones give the bits of 4 KiB chunks, and a
    leaf that goes whole is refused by the engine's size."""
    entry = ELEMENTWISE[0]
    outs = []
    for ex in (HostExecutor(chunk_bytes=1 << 20, slots=2, engine="gpu", engine_chunk_bytes=4096),
               HostExecutor(chunk_bytes=4096, slots=2, engine="gpu", engine_chunk_bytes=4096)):
        params = make_params(0, device="cuda", big=True)
        opt = entry.make(**entry.hypers, placement=on_host(), executor=ex)
        state = opt.init(params)
        for g in grad_seq(params, 2):
            params, state = opt.update(g, state)
        outs.append([p.cpu() for p in optree.tree_leaves(params)])
    assert all(torch.equal(x, y) for x, y in zip(*outs))
    odd = {"w": torch.zeros(70_001, device="cuda", dtype=torch.bfloat16)}
    opt = fo.adamw(1e-2, placement=on_host(), store_param_remainders=True,
                   executor=HostExecutor(chunk_bytes=1 << 22, engine="gpu",
                                         engine_chunk_bytes=1 << 16))
    with pytest.raises(ValueError, match=r"'w'.*engine_chunk_bytes \(65536\)"):
        opt.init(odd)


@pytest.mark.parametrize("engine", ["gpu", "both"])
@pytest.mark.parametrize("delayed", [False, True])
def test_gpu_engine_refuses_cpu_params(engine, delayed):
    params = make_params(0)
    opt = fo.adamw(lr=1e-2, placement=on_host(), delayed=delayed,
                   executor=HostExecutor(engine=engine))
    with pytest.raises(ValueError, match=rf"is on cpu, but HostExecutor\(engine='{engine}'\)"):
        opt.init(params)  # (CPU params' state is host-resident whatever the placement)


@pytest.mark.parametrize("engine", ["gpu", "both"])
def test_cpu_params_are_refused_first_naming_the_leaf(engine):
    """A CPU param is refused for what it is, whichever engine and whatever else the leaf has
    that the engine would not step (here: 8-bit moments of a length not divisible by 4 over a
    chunk), naming the leaf, by ``init`` and by ``fo.plan`` alike."""
    params = {"a": torch.randn(100_001)}
    opt = fo.adamw(lr=1e-2, placement=on_host(), mu_dtype=torch.uint8, nu_dtype=torch.uint8,
                   executor=HostExecutor(engine=engine, engine_chunk_bytes=4096))
    for call in (opt.init, lambda p: fo.plan(opt, p)):
        with pytest.raises(ValueError, match=rf"param 'a' is on cpu.*engine='{engine}'"):
            call(params)


def step_of(share, phase, gpu_rate=0.0, cpu_rate=0.0):
    return SplitStep(share, (), 0, 0, None, None, 0.0, 0.0, gpu_rate, cpu_rate, phase, ())


def search(host_s, steps=14, fixed=None):
    """``steps`` plans of a split whose host step takes ``host_s(share)`` seconds an element:
    the (share, phase) of each step and the last memory."""
    memory, out = SplitPlan(), []
    for _ in range(steps):
        share, phase, _, _ = plan([100, 300], 0, memory, fixed)
        out.append((share, phase))
        memory = remember(memory, share, host_s(share), step_of(share, phase, 1.0, 1.0))
    return out, memory


@pytest.mark.parametrize("best", [0.0, 0.3, 0.62, 1.0])
def test_split_share_is_searched_from_the_measured_times(best):
    """A warm-up step of both engines, the CPU kernel alone measured, then a golden-section
    search; within ten steps the share settles within the search's tolerance of the fastest (0:
    the CPU kernel alone, where both engines at once are slower at every share) and stays
    there."""
    steps, memory = search(lambda x: 1.0 + abs(x - best))
    assert steps[0] == (WARM, "warm-up") and steps[1] == (0.0, "search")
    assert all(phase == "search" for _, phase in steps[1:9])
    settled = [x for x, phase in steps if phase == "settled"]
    assert len(settled) == len(steps) - 9 and len(set(settled)) == 1
    assert abs(settled[0] - best) < TOL
    assert memory.steps == len(steps)


def test_split_search_keeps_the_least_time_of_a_share_and_the_override_is_fixed():
    """A share measured again keeps its least time (a slow first step does not count against it
    for ever); ``gpu_share`` is taken as it is at every step and counts for no search."""
    times = iter([5.0, 1.0])
    memory = SplitPlan()
    for _ in range(2):
        memory = remember(memory, 0.0, next(times), step_of(0.0, "search"))
    assert [(x, t) for x, t, _, _ in memory.tried] == [(0.0, 1.0)]
    assert next_share({0.0: 1.0}) == (round(1 - PHI, 6), "search")
    steps, memory = search(lambda x: 1.0, steps=3, fixed=0.25)
    assert steps == [(0.25, "fixed")] * 3 and memory.tried == ()


def test_split_step_prints_each_leaf_with_its_engine_and_predicted_time():
    step = SplitStep(0.5, ("w1",), 300, 100, 0.6, 0.2, 0.7, 0.3, 500.0, 300.0, "settled",
                     (("emb", "cpu", 100), ("w1", "gpu", 300)))
    lines = step.per_leaf().splitlines()
    assert lines[0].split() == ["leaf", "engine", "elements", "predicted", "ms"]
    assert lines[1].split() == ["emb", "cpu", "100", "200.00"]  # all of the CPU's 0.2 s
    assert lines[2].split() == ["w1", "gpu", "300", "600.00"]
    assert "settled" in str(step)


def test_split_predictions_use_the_rates_measured_at_the_share():
    """The predicted times of a share come from the rates measured at it, else the last step's;
    an engine with no rate known yet has no prediction (one with no elements: 0)."""
    memory = SplitPlan()
    share, phase, pg, pc = plan([100, 300], 50, memory, None)
    assert (share, phase, pg, pc) == (WARM, "warm-up", None, None)
    memory = remember(memory, WARM, 1.0, step_of(WARM, "warm-up", 0.0, 900.0))
    assert plan([100, 300], 50, memory, None) == (0.0, "search", 0.0, 450 / 900)
    memory = remember(memory, 0.0, 1.0, step_of(0.0, "search", 0.0, 450.0))
    share, phase, pg, pc = plan([100, 300], 50, memory, None)
    assert share == round(1 - PHI, 6) and pg is None
    assert pc == pytest.approx((450 - share * 400) / 450)
    memory = remember(memory, share, 0.5, step_of(share, "search", 200.0, 300.0))
    _, _, pg, pc = plan([100, 300], 50, memory, share)  # at the share measured: its rates
    assert pg == pytest.approx(share * 400 / 200) and pc == pytest.approx((450 - share * 400) / 300)


@pytest.mark.parametrize("delayed", [False, fo.Delay(lookahead=False), True],
                         ids=["plain", "stale", "lookahead"])
def test_gpu_engine_refuses_8bit_moments_it_would_have_to_cut_off_the_kernels_path(delayed):
    """8-bit moments are cut on their blocks; a leaf of a length not divisible by 4 goes whole
    into a chunk, and init refuses one whose state is over the chunk, naming it (delayed steps
    too: the engine steps those without a look-ahead, and a look-ahead delay's exact ones).
    (``fo.plan`` runs init's checks; on meta params here, as no GPU is needed for them.)"""
    params = {"w": torch.empty(70_001, dtype=torch.bfloat16, device="meta")}  # not packed
    opt = fo.adamw(lr=1e-2, placement=on_host(), mu_dtype=torch.uint8, nu_dtype=torch.uint8,
                   delayed=delayed,
                   executor=HostExecutor(engine="gpu", engine_chunk_bytes=1 << 16))
    with pytest.raises(ValueError, match=r"param 'w'.*engine='gpu'.*8-bit moments of a length "
                                         r"not divisible by 4.*engine_chunk_bytes \(65536\)"):
        fo.plan(opt, params)


def _leaf(n: int, dtypes, split: bool = False) -> Leaf:
    """A host leaf of ``n`` elements: a split or fp32 value, moments of ``dtypes``."""
    value = torch.zeros((2, n), dtype=torch.int16) if split else torch.zeros(n)
    moments = tuple(torch.zeros(blockwise.nbytes(n), dtype=torch.uint8) if d == torch.uint8
                    else torch.zeros(n, dtype=d) for d in dtypes)
    param = torch.zeros(n, dtype=torch.bfloat16)
    return with_flat_views(Leaf("w", param, param, value, moments, None, True, True))


@pytest.mark.parametrize("numel", [70_000, 4_100, 1_050, 300])
@pytest.mark.parametrize("split", [False, True], ids=["fp32", "split"])
def test_8bit_chunks_are_cut_on_whole_blocks(numel, split):
    """Pieces of a leaf with 8-bit moments start on a block, cover it in order, and take the
    bytes of their blocks; one of a length not divisible by 4 is never cut."""
    leaves = [_leaf(700, [torch.float32, torch.float32]),
              _leaf(numel, [torch.uint8, torch.uint8], split)]
    capacity = 1 << 14
    if not steppable(leaves[1], capacity):
        assert numel % 4 != 0
        return
    out = chunks(leaves, [0, 1], capacity)
    assert all(c.nbytes <= capacity for c in out)
    pieces = [p for c in out for p in c.pieces if p.index == 1]
    assert pieces[0].lo == 0 and pieces[-1].hi == numel
    assert all(a.hi == b.lo and a.lo % blockwise.BLOCK == 0 for a, b in zip(pieces, pieces[1:]))
    if numel % 4 != 0:
        assert len(pieces) == 1
    for p in pieces:
        sizes = [off2 - off1 for off1, off2 in zip(p.offsets, p.offsets[1:])]
        state = state_of(leaves[1])
        assert sizes[-1] >= blockwise.nbytes(p.hi - p.lo)  # the first moment's blocks
        assert sizes[0] >= (p.hi - p.lo) * state[0].element_size()


@pytest.mark.parametrize("split, dtypes", [(False, [torch.uint8, torch.uint8]),
                                           (True, [torch.uint8, torch.uint8]),
                                           (True, [torch.float32, torch.float32])],
                         ids=["8bit", "split-8bit", "split"])
@pytest.mark.parametrize("numel", [65_551, 1_050])
def test_a_leaf_that_goes_whole_is_taken_exactly_when_a_chunk_holds_it(split, dtypes, numel):
    """init's check (``takes``), the split's (``steppable``) and the chunking agree at the
    capacity where a leaf of a length not divisible by 4 just fits one chunk, and one byte
    below it."""
    leaf = _leaf(numel, dtypes, split)
    need = next(c for c in range(numel, 40 * numel, 8) if steppable(leaf, c))
    need = next(c for c in range(need - 8, need + 1) if steppable(leaf, c))
    sizes = [2 * numel, 2 * numel] if split else [4 * numel]  # the state init makes, by bytes
    sizes += [blockwise.nbytes(numel) if d == torch.uint8 else numel * d.itemsize for d in dtypes]
    eight = torch.uint8 in dtypes
    assert takes(numel, split, eight, sizes, need) and not takes(numel, split, eight, sizes,
                                                                 need - 1)
    assert not steppable(leaf, need - 1)
    assert [(p.lo, p.hi) for c in chunks([leaf], [0], need) for p in c.pieces] == [(0, numel)]
    with pytest.raises(ValueError, match="holds no piece"):
        chunks([leaf], [0], need - 1)


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


ENGINE_INIT = """
import resource, sys, torch
import functional_offload as fo
from functional_offload.executor import HostExecutor
from functional_offload.placement import on_host
engine, fmt = sys.argv[1], sys.argv[2]
dtype = torch.bfloat16 if fmt == "split" else torch.float32
options = dict(store_param_remainders=True) if fmt == "split" else {}
params = {f"w{i}": torch.randn(1 << 24, device="cuda", dtype=dtype) for i in range(6)}
ex = HostExecutor(engine=engine)
fo.adamw(1e-3, placement=on_host(), executor=ex).init({"a": torch.zeros(1 << 12, device="cuda")})
torch.cuda.synchronize()  # the CUDA context and the executor's ring are made
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before, pinned = rss(), torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
opt = fo.adamw(1e-3, placement=on_host(), executor=ex, **options)
state = opt.init(params)
with open("/proc/self/status") as f:  # this process's peak (ru_maxrss is the parent's too)
    peak = 1024 * int(next(x for x in f if x.startswith("VmHWM")).split()[1])
pinned = torch.cuda.host_memory_stats()["allocated_bytes.current"] - pinned
state_bytes = sum(v.numel() * v.element_size() for k, v in fo.state_dict(state).items()
                  if v.numel() > 1)
print("RESULT", max(0, peak - before), pinned, state_bytes)
"""


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["gpu", "both"])
@pytest.mark.parametrize("fmt", ["fp32", "split"])
def test_engine_state_is_made_pinned_without_a_second_copy(engine, fmt):
    """The GPU engine's host state (1.2 GiB here) is made in pinned arenas: init's host memory
    grows by about the state's bytes, not twice them (state made pageable, then pinned), and
    what is pinned is the state's bytes (a split master is not pinned twice). In a fresh
    process, whose peak resident memory (``VmHWM``: ``ru_maxrss`` would count the parent's,
    inherited at fork) is init's."""
    out = subprocess.run([sys.executable, "-c", ENGINE_INIT, engine, fmt], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert line, out.stderr[-2000:]
    grew, pinned, state_bytes = map(int, line[0].split()[1:])
    assert state_bytes >= 6 * (1 << 24) * 12
    assert pinned <= 1.05 * state_bytes + (1 << 22), (pinned, state_bytes)
    if fmt == "split":  # the remainder alone: the GPU param is the high half (10 of 12 bytes)
        assert pinned <= 1.05 * state_bytes * 10 / 12 + (1 << 22), (pinned, state_bytes)
    assert grew <= 1.25 * state_bytes, (grew, state_bytes)


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


def split_params(dtype=torch.float32):
    """Leaves above the packed size (the engine's) and small ones (packed: the CPU kernel's)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"emb": (300, 256), "w1": (256, 300), "b1": (300,), "w2": (70_001,), "ln": (256,)}
    return {k: torch.randn(s, generator=g).to("cuda", dtype) for k, s in shapes.items()}


def run_split(engine, share=None, dtype=torch.float32, steps=3, placement=None,
              chunk_bytes=1 << 16, **options):
    """``steps`` updates of :func:`split_params` with all state on the host (or ``placement``;
    the second without a grad for ``b1``): params and state on the CPU by name, and the
    executor's last split."""
    params = split_params(dtype)
    ex = HostExecutor(chunk_bytes=chunk_bytes, slots=2, engine=engine,
                      gpu_share=share if engine == "both" else None,
                      engine_chunk_bytes=None if engine == "cpu" else chunk_bytes)
    opt = fo.adamw(1e-2, weight_decay=0.1, placement=placement or on_host(), executor=ex,
                   **options)
    state = opt.init(params)
    for n, g in enumerate(grad_seq(params, steps)):
        if n == 1:
            g["b1"] = None
        params, state = opt.update(g, state)
    fo.flush(state)
    return ({k: p.cpu() for k, p in params.items()},
            {k: v.cpu() for k, v in fo.state_dict(state).items()}, ex.last_split)


def of_leaf(state, path):
    return {k: v for k, v in state.items() if k.split(".", 1)[-1] == path}


def assert_leaf_same(k, got, got_state, want, want_state):
    """Leaf ``k``'s param and every state tensor of it, bit for bit."""
    assert torch.equal(got[k], want[k]), k
    mine, theirs = of_leaf(got_state, k), of_leaf(want_state, k)
    assert mine.keys() == theirs.keys() and mine, k
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.cuda
@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_gives_each_leaf_the_bits_of_its_engine(share, dtype):
    """Each leaf the GPU engine stepped has the bits of engine='gpu', each other one those of
    the CPU kernel (engine='cpu'); packed small leaves are the CPU kernel's."""
    params, state, split = run_split("both", share, dtype)
    by = {"gpu": run_split("gpu", dtype=dtype), "cpu": run_split("cpu", dtype=dtype)}
    assert split.gpu and set(split.gpu) <= {"emb", "w1", "w2"}
    assert split.gpu_elements == sum(params[k].numel() for k in split.gpu)
    for k in params:
        ref_params, ref_state, _ = by["gpu" if k in split.gpu else "cpu"]
        assert_leaf_same(k, params, state, ref_params, ref_state)


@pytest.mark.cuda
def test_split_times_each_engine_on_its_own_work():
    """The CPU kernel's time ends when its own leaves are done, not when the GPU engine's
    (here 40-odd chunks, each slowed by 10 ms, against the CPU kernel's one packed chunk)."""
    with slow_host_kernel(0.01):
        *_, split = run_split("both", 1.0, steps=2)
    assert split.cpu_elements > 0 and split.gpu_s > 0.3
    assert split.cpu_s < 0.25 * split.gpu_s, (split.cpu_s, split.gpu_s)


@pytest.mark.cuda
def test_split_share_is_searched_and_predicted_from_the_steps_before():
    """The fourth step is the search's second share, its times predicted from the rates of the
    step before."""
    params, state, split = run_split("both", None, steps=4)
    assert split.phase == "search"
    assert 0.0 < split.share <= 1.0 and split.gpu_s > 0 and split.cpu_s > 0
    assert split.predicted_gpu_s is not None and split.predicted_cpu_s is not None
    assert "predicted ms" in str(split)
    assert all(torch.isfinite(p).all() for p in params.values())


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_split_steps_the_formats_and_leaves_what_it_cannot_cut_to_the_cpu(fmt):
    """The split master and 8-bit moments go to the GPU engine with engine='both'; the leaf of
    a length not divisible by 4 whose state is over a chunk (``w2``: 70,001 elements, 64 KiB
    chunks) is not refused (as with 'gpu'): it runs on the CPU kernel. Each leaf has the bits
    of its engine."""
    dtype = torch.bfloat16
    params, state, split = run_split("both", 1.0, dtype, **FORMATS[fmt])
    assert set(split.gpu) == {"emb", "w1"}
    by = {"gpu": run_split("cpu", dtype=dtype, placement=on_device(), **FORMATS[fmt]),
          "cpu": run_split("cpu", dtype=dtype, **FORMATS[fmt])}
    for k in params:
        ref_params, ref_state, _ = by["gpu" if k in split.gpu else "cpu"]
        assert_leaf_same(k, params, state, ref_params, ref_state)


@pytest.mark.cuda
def test_split_failure_marks_the_state():
    params = split_params()
    opt = fo.adamw(1e-2, placement=on_host(),
                   executor=HostExecutor(chunk_bytes=1 << 16, slots=2, engine="both",
                                         engine_chunk_bytes=1 << 16))
    state = opt.init(params)
    g = grad_seq(params, 1)[0]
    with fail_host_kernel(after=1):
        with pytest.raises(fo.HostStepError, match="injected failure"):
            opt.update(g, state)
    with pytest.raises(fo.StateError, match="failed"):
        opt.update(g, state)


STALE = fo.Delay(lookahead=False)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp32", "split-8bit"])
@pytest.mark.parametrize("engine, share", [("gpu", None), ("both", 0.5)])
def test_delayed_steps_give_the_bits_of_the_plain_ones(engine, share, fmt):
    """Without a look-ahead a delayed step's leaves are stepped by the engine the plain step
    gives them (the GPU engine's on the device, in the background): the same grads give the
    same bits, params and state."""
    options = FORMATS.get(fmt, {})
    dtype = torch.bfloat16 if options else torch.float32
    size = 2 << 20 if options else 1 << 16  # (w2 goes whole into a chunk with 8-bit moments)
    got, got_state, split = run_split(engine, share, dtype=dtype, delayed=STALE,
                                      chunk_bytes=size, **options)
    want, want_state, want_split = run_split(engine, share, dtype=dtype, chunk_bytes=size,
                                             **options)
    if engine == "both":
        assert split.gpu == want_split.gpu and split.gpu and split.phase == "fixed"
        assert split.gpu_s > 0 and split.cpu_s > 0
    for k in want:
        assert_leaf_same(k, got, got_state, want, want_state)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda().bfloat16()


def _mlp_chain(engine: str, max_norm: float, **options):
    """:func:`_mlp`, its params by name, an executor of ``engine`` (half the elements on the
    GPU with 'both') and a clipped AdamW chain on the host (``options`` to ``fo.adamw``)."""
    model = _mlp()
    ex = HostExecutor(chunk_bytes=1 << 16, slots=2, engine=engine, engine_chunk_bytes=1 << 16,
                      gpu_share=0.5 if engine == "both" else None)
    opt = fo.chain(fo.clip_by_global_norm(max_norm),
                   fo.adamw(1e-2, placement=on_host(), executor=ex, **options))
    return model, dict(model.named_parameters()), ex, opt


@pytest.mark.cuda
@pytest.mark.parametrize("side", [False, True], ids=["", "side-stream"])
@pytest.mark.parametrize("engine", ["gpu", "both"])
def test_landing_before_the_forward_is_exact_on_the_gpu_engine(engine, side):
    """``fo.land_before_forward`` with the GPU engine stepping in the background: each module's
    forward waits for its params, and training gives the plain steps' bits; also where the
    delayed loop runs on a side stream (its copies ordered against the caller's stream)."""
    outs = []
    for delayed in (STALE, False):
        with torch.cuda.stream(torch.cuda.Stream() if side and delayed else
                               torch.cuda.current_stream()):
            outs.append(_train_landed(engine, delayed))
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(x, y) for x, y in zip(outs[0][1], outs[1][1]))


def _train_landed(engine: str, delayed) -> tuple[list[float], list[torch.Tensor]]:
    """Five clipped steps of :func:`_mlp` (landed before each module's forward where delayed):
    the losses and the final params."""
    model, params, _, opt = _mlp_chain(engine, 0.1, delayed=delayed,
                                       store_param_remainders=True, mu_dtype=torch.uint8,
                                       nu_dtype=torch.uint8)
    state = opt.init(params)
    hooks = fo.land_before_forward(model, lambda: state) if delayed else None
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(5):
        x = torch.randn(64, 256, device="cuda", generator=g).bfloat16()
        loss = model(x).float().square().mean()
        loss.backward()
        losses.append(loss.item())
        params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
    state = fo.flush(state)
    if hooks is not None:
        hooks.remove()
    return losses, [p.detach().cpu() for p in params.values()]


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["gpu", "both"])
def test_a_delayed_engine_step_that_fails_marks_the_state(engine):
    """A chunk of the engine failing in the background: the error comes at the landing (the
    next update), the state is marked failed, and nothing can use or save it."""
    params = split_params()
    ex = HostExecutor(chunk_bytes=1 << 16, slots=2, engine=engine, engine_chunk_bytes=1 << 16,
                      gpu_share=1.0 if engine == "both" else None)
    opt = fo.adamw(1e-2, placement=on_host(), executor=ex, delayed=STALE)
    state = opt.init(params)
    grads = grad_seq(params, 3)
    params, state = opt.update(grads[0], state)
    state = fo.flush(state)  # (its engine done before the fault is injected)
    with fail_host_kernel(after=2, leaves=["w1"]):
        params, state = opt.update(grads[1], state)
        with pytest.raises(fo.HostStepError, match="injected failure"):
            opt.update(grads[2], state)
    with pytest.raises(fo.StateError, match="failed"):
        opt.update(grads[2], state)


ENGINE_STREAMS = """
import sys, threading, torch
import functional_offload as fo
from functional_offload.executor import HostExecutor, faults
from functional_offload.placement import on_host
device = torch.device("cuda", torch.cuda.current_device())
g = torch.Generator().manual_seed(0)
params = {k: torch.randn(s, generator=g).to(device)
          for k, s in {"emb": (300, 256), "w1": (256, 300), "w2": (70_001,)}.items()}
ex = HostExecutor(chunk_bytes=1 << 16, slots=2, engine="gpu", engine_chunk_bytes=1 << 16)
delay = {"delayed": fo.Delay(lookahead=False)} if sys.argv[1] == "delayed" else {}
opt = fo.adamw(1e-2, placement=on_host(), executor=ex, **delay)
seen = []
def hook(k, paths):  # the engine's chunks: in the caller's thread (plain) or its own (delayed)
    here = threading.current_thread()
    if here is threading.main_thread() or here.name == "functional_offload GPU engine":
        seen.append((k, torch.cuda.current_stream(device).cuda_stream))
faults.add(hook)
state = opt.init(params)
t = ex.transport(device)
drawn = [torch.cuda.Stream(device) for _ in range(30)]  # torch's next draws: its copy streams
for _ in range(2):
    params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state)
fo.flush(state)
copies = {t.stream_in.cuda_stream, t.stream_out.cuda_stream}
by_slot = [{s for k, s in seen if k % 2 == slot} for slot in (0, 1)]
assert len({k for k, _ in seen}) > 2, seen  # several chunks a step
assert all(len(on) == 1 for on in by_slot) and by_slot[0] != by_slot[1], by_slot
assert not copies & (by_slot[0] | by_slot[1]), (copies, by_slot)
print("OK")
"""


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["plain", "delayed"])
def test_the_engines_chunks_run_their_math_on_its_math_streams_off_the_copy_streams(mode):
    """Chunk ``k``'s math is queued on the executor's math stream ``k mod 2`` (beside the
    chunk before it), never on a copy stream, where it would wait behind the next chunk's
    copies (and they behind it) — even where the process drew so many streams that torch's
    pool of 32 (handed out in turn) comes round to the copy streams again. In a fresh process,
    to know where the pool stands."""
    out = subprocess.run([sys.executable, "-c", ENGINE_STREAMS, mode], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("max_norm", [1e6, 1e-3], ids=["kept", "clipped"])
@pytest.mark.parametrize("engine", ["gpu", "both"])
def test_a_clipped_stream_is_update_bit_for_bit_on_the_gpu_engine(engine, max_norm):
    """``fo.stream`` with a clip in front gives ``update``'s bits under the GPU engine, where
    the clip holds (the step run ahead is kept: with 'both' the CPU kernel's leaves ran ahead
    into spare buffers, the engine's at finish) and where it scales (the step redone)."""
    outs = []
    for streamed in (True, False):
        model, params, ex, opt = _mlp_chain(engine, max_norm, weight_decay=0.1)
        state = opt.init(params)
        g = torch.Generator(device="cuda").manual_seed(1)
        committed = []
        for _ in range(3):
            loss = model(torch.randn(64, 256, device="cuda", generator=g).bfloat16()).float()
            if not streamed:
                loss.square().mean().backward()
                params, state = opt.update({k: p.grad for k, p in params.items()}, state)
            else:  # the grads fed to the step as backward makes them
                with fo.stream(opt, state, params=model) as s:
                    loss.square().mean().backward()
                params, state = s.finish()
                committed.append(s.committed)
            model.zero_grad(set_to_none=True)
        if streamed:  # kept where the clip holds, redone where it scales
            assert all(c is not (max_norm < 1) for c in committed), committed
        if engine == "both":
            assert ex.last_split is not None and ex.last_split.gpu and ex.last_split.cpu_elements
        outs.append(([p.detach().cpu() for p in params.values()],
                     {k: v.cpu() for k, v in fo.state_dict(state).items()}))
    (got, got_state), (want, want_state) = outs
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
