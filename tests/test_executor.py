"""The host pipeline's logic (chunking, ring reuse, ordering, threads, errors) on the CPU.

With ``stage_host_grads=True`` CPU grads and new params go through the staging ring as a GPU's do (with
synchronous copies), so chunks crossing leaves, ring slots reused many times, pieces spread over
worker threads and errors from a worker run the code that runs against a GPU.
"""

import os
import threading

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor, HostLeaf, Timeline, physical_cores
from functional_offload.executor.chunking import arrived, cut
from functional_offload.kernels import native
from functional_offload.kernels.work import Piece, PyQueue, Work
from functional_offload.optimizers.adam import scalars as adam_scalars
from functional_offload.optimizers.adam import AdamHyper
from functional_offload.testing import fail_host_kernel
from conftest import KERNELS, clone, grad_seq, make_params, per_block

CPU = torch.device("cpu")


def staged(**kw):
    """CPU grads through the ring; every thread works on any run, however small."""
    return HostExecutor(stage_host_grads=True, worker_elements=1, **kw)


def run(params, grads, **ex):
    opt = fo.adamw(1e-2, weight_decay=0.1, executor=staged(**ex), cpu_kernel="torch")
    p = clone(params)
    s = opt.init(p)
    for g in grads:
        p, s = opt.update(g, s)
    return p, s


def chunks_of(leaves, chunk_bytes):
    return list(cut(arrived(leaves, None), chunk_bytes, [], []))


def adam_kernel():
    return native.NativeKernel(native.module(), "adam", adam_scalars, (True, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunking_does_not_change_results(dtype):
    params = make_params(dtype=dtype, big=True)
    grads = grad_seq(params, 4)
    whole, _ = run(params, grads, chunk_bytes=1 << 20, slots=2, threads=1)
    # 4 KiB chunks: every leaf splits, chunks cross leaves, the 2..3 slots are reused many times
    for slots, threads in [(2, 1), (3, 4), (5, 3)]:
        chunked, _ = run(params, grads, chunk_bytes=4096, slots=slots, threads=threads)
        for a, b in zip(optree.tree_leaves(whole), optree.tree_leaves(chunked)):
            assert torch.equal(a, b)


def test_chunk_plan_covers_every_element_once():
    sizes = [1000, 3000, 17, 5000, 64]
    leaves = [HostLeaf(str(i), torch.zeros(n), torch.zeros(n), (), None) for i, n in enumerate(sizes)]
    seen = {i: [] for i in range(len(sizes))}
    for chunk in chunks_of(leaves, 4096):
        end = 0
        for seg in chunk:
            assert seg.offset % 64 == 0 and seg.offset >= end
            end = seg.offset + (seg.stop - seg.start) * 4
            assert end <= 4096
            seen[seg.leaf].append((seg.start, seg.stop))
    for i, n in enumerate(sizes):
        spans = sorted(seen[i])
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_ramped_chunks_grow_from_a_sixteenth_and_cover_every_element_once():
    """With ``ramp`` (runs that copy nothing) the first chunks are ``chunk_bytes / 16`` (at
    least RAMP_MIN), each twice the last, up to ``chunk_bytes``; all elements once, as without."""
    from functional_offload.executor.chunking import RAMP_MIN
    budget = 64 * RAMP_MIN
    sizes = [3 * RAMP_MIN // 4, 17, 40 * RAMP_MIN // 4, 333, 200 * RAMP_MIN // 4]  # fp32 elements
    leaves = [HostLeaf(str(i), torch.zeros(n), None, (), None) for i, n in enumerate(sizes)]
    ramped = list(cut(arrived(leaves, None), budget, [], [], ramp=True))
    used = [max(seg.offset + (seg.stop - seg.start) * 4 for seg in c) for c in ramped]
    limits = [min(budget, (budget // 16) << k) for k in range(len(ramped))]
    assert all(u <= lim for u, lim in zip(used, limits))
    assert used[0] > budget // 32 and used[1] > budget // 16  # filled (the leaves are larger)
    assert len(ramped) > len(chunks_of(leaves, budget))
    for i, n in enumerate(sizes):
        spans = sorted((seg.start, seg.stop) for c in ramped for seg in c if seg.leaf == i)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    small = list(cut(arrived(leaves, None), 4096, [], [], ramp=True))  # a sixteenth < RAMP_MIN
    assert small == chunks_of(leaves, 4096)


def test_an_inline_run_makes_its_leaves_as_it_cuts_them():
    """A run driven in the step's thread takes a generator of leaves as it cuts them: the
    kernel ran the first chunk before the last leaf was made, and every leaf was stepped."""
    from functional_offload.executor.shield import shielded
    seen = []

    def kernel(g, st, out, h):
        seen.append(("ran", h))
        st[0].add_(g)

    def made(i, n):
        seen.append(("made", i))
        return HostLeaf(str(i), torch.ones(n), None, (torch.zeros(n),), i)

    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=1, worker_elements=1)
    leaves = []

    def step():
        r = ex.open(CPU, per_block(kernel), elements=10 * 1000)
        r.add_all((leaves.append(made(i, 1000)) or leaves[-1] for i in range(10)), None)
        r.close()
        r.wait()
        return r.error

    error, _ = shielded(step)
    assert error is None
    assert seen.index(("ran", 0)) < seen.index(("made", 9))
    assert all(torch.equal(leaf.state[0], torch.ones(1000)) for leaf in leaves)
    ex.close()


def test_a_leaf_that_allocates_is_made_before_anything_runs(monkeypatch):
    """A leaf whose making allocates (here a transposed grad, made contiguous) is made before
    the run starts, though the others are made as the run cuts them: its failure (an
    allocation's, raised here) leaves every param and the state as they were."""
    from functional_offload.optimizers.forms.base import HostWork
    make = HostWork.host_leaf

    def failing(self, index, g, *args, **kw):
        if not g.is_contiguous():
            raise MemoryError("no memory for the grad's contiguous copy")
        return make(self, index, g, *args, **kw)

    opt = fo.adamw(1e-2, executor=HostExecutor(threads=2, chunk_bytes=1 << 20), cpu_kernel="auto")
    params = {"a": torch.zeros(1 << 19), "b": torch.zeros(1 << 19), "c": torch.zeros(512, 512)}
    state = opt.init(params)
    grads = {"a": torch.ones(1 << 19), "b": torch.ones(1 << 19), "c": torch.ones(512, 512).t()}
    before = clone(params)
    monkeypatch.setattr(HostWork, "host_leaf", failing)
    with pytest.raises(MemoryError, match="contiguous copy"):
        opt.update(grads, state)
    monkeypatch.undo()
    assert all(torch.equal(params[k], before[k]) for k in params)
    params, state = opt.update(grads, state)  # the state is as it was: it steps
    assert all(torch.all(p < 0) for p in params.values())


def _work(sizes, block, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, True)
    pieces = [Piece(torch.randn(n, generator=gen).bfloat16(),
                    (torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                     torch.rand(n, generator=gen)), torch.empty(n, dtype=torch.bfloat16), h)
              for n in sizes]
    return Work(pieces, block)


def test_claimed_blocks_cover_every_element_once():
    import concurrent.futures as cf
    work = _work([1000, 37, 5000, 64], block=64)
    seen, lock = [], threading.Lock()

    def kernel(w):
        for p, a, b in w.claims():
            with lock:
                seen.append((id(p), a, b))

    with cf.ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(kernel, work) for _ in range(4)]:
            f.result()
    for p in work.pieces:
        spans = sorted((a, b) for i, a, b in seen if i == id(p))
        assert spans[0][0] == 0 and spans[-1][1] == p.grad.numel()
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert len(seen) == sum(-(-p.grad.numel() // 64) for p in work.pieces)


def _run_queue(q, works, threads):
    """Add ``works`` to queue ``q`` with ``threads`` workers in its loop; each chunk's error."""
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(threads) as pool:
        loops = [pool.submit(q.work, i) for i in range(threads)]
        for w in works:
            q.ready(q.add(w))
        errors = [q.wait(k) for k in range(len(works))]
        q.close()
        for f in loops:
            f.result(timeout=10)
    return errors


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_native_queue_claims_blocks_like_one_pass():
    kernel = adam_kernel()
    sizes = [1000, 37, 5000, 64]
    whole = [_work(sizes, block=1 << 20, seed=s) for s in range(3)]
    blocked = [_work(sizes, block=256, seed=s) for s in range(3)]
    assert _run_queue(kernel.queue(1), whole, 1) == [None] * 3  # one thread, one block per piece
    assert _run_queue(kernel.queue(4), blocked, 4) == [None] * 3  # 4 threads, 64-element blocks
    for w1, w2 in zip(whole, blocked):
        for a, b in zip(w1.pieces, w2.pieces):
            for x, y in zip((*a.state, a.out), (*b.state, b.out)):
                assert torch.equal(x, y)


@pytest.mark.parametrize("use_native", [False, True])
def test_queue_runs_chunks_in_order_once_ready(use_native):
    """No worker starts chunk 1 before chunk 0 is ready; cancel lets the workers go at once."""
    import concurrent.futures as cf
    if use_native and "native" not in KERNELS:
        pytest.skip("native kernel not built here")
    seen = []
    if use_native:
        q = adam_kernel().queue(3, record=True)
    else:
        def kernel(w):
            for p, a, b in w.claims():
                seen.append(id(p))
        q = PyQueue(kernel, 3, record=True)
    works = [_work([100, 200], block=256, seed=s) for s in range(3)]
    before = [p.state[0].clone() for w in works for p in w.pieces]
    with cf.ThreadPoolExecutor(3) as pool:
        loops = [pool.submit(q.work, i) for i in range(3)]
        for w in works:
            q.add(w)
        q.ready(1)
        waiter = threading.Thread(target=q.wait, args=(1,))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # chunk 1 is ready, but chunk 0 is not: nothing ran
        after = [p.state[0] for w in works for p in w.pieces]
        assert all(torch.equal(x, y) for x, y in zip(before, after)) and not seen
        q.ready(0)
        waiter.join(5)
        assert not waiter.is_alive() and q.wait(0) is None
        q.cancel()  # chunk 2 never becomes ready: the workers still return
        for f in loops:
            f.result(timeout=5)
    assert q.wait(2) is not None  # "cancelled"
    assert {(k, waiting) for _, k, waiting, _, _ in q.spans() if not waiting} == {(0, False), (1, False)}


def test_worker_error_surfaces_at_caller():
    ex = staged(chunk_bytes=4096, slots=2, threads=2)
    n = 5000
    calls = []

    def kernel(g, st, out, h):
        calls.append(g.numel())
        if len(calls) == 3:
            raise FloatingPointError("boom")
        st[0].add_(g)

    leaf = HostLeaf("w", torch.ones(n), None, (torch.zeros(n),), None)
    with pytest.raises(fo.HostStepError, match="host optimizer step failed on leaf 'w'.*boom") as e:
        ex.run([leaf], per_block(kernel))
    assert isinstance(e.value.__cause__, FloatingPointError)
    ex.close()


def _adam_leaf(name, n=5000, value_dtype=torch.float32):
    """A host leaf of ones as grads, zero value and moments, one AdamW step's scalars."""
    return HostLeaf(name, torch.ones(n), None,
                    (torch.zeros(n, dtype=value_dtype), torch.zeros(n), torch.zeros(n)),
                    AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1, True))


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_native_queue_error_surfaces_and_releases_workers():
    """A chunk the native queue refuses (here: an fp64 value) fails the run with the leaf's name;
    the workers already in the queue's loop are released, and the executor runs again after."""
    kernel = adam_kernel()
    ex = staged(chunk_bytes=4096, slots=2, threads=3)
    with pytest.raises(fo.HostStepError, match="failed on leaf .*'bad'.*value must be fp32"):
        ex.run([_adam_leaf("good"), _adam_leaf("bad", value_dtype=torch.float64)], kernel)
    ok = _adam_leaf("ok")
    ex.run([ok], kernel)
    assert torch.all(ok.state[0] < 0)  # one Adam step on a grad of ones moves every value down
    ex.close()


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_native_queue_runs_on_its_own_workers():
    """``start`` puts native pool threads in the loop, no Python thread; ``join`` waits for
    them; the results are one pass's; threads are kept across queues (a second queue with
    as many workers starts no new thread)."""
    sizes = [1000, 37, 5000, 64]
    whole = [_work(sizes, block=1 << 20, seed=s) for s in range(3)]
    assert _run_queue(adam_kernel().queue(1), whole, 1) == [None] * 3
    for round_ in range(2):
        blocked = [_work(sizes, block=256, seed=s) for s in range(3)]
        q = adam_kernel().queue(4)
        python_threads = threading.active_count()
        q.start(4, [])
        for w in blocked:
            q.ready(q.add(w))
        assert [q.wait(k) for k in range(3)] == [None] * 3
        q.close()
        q.join()
        assert threading.active_count() == python_threads  # native threads: not Python's
        if round_ == 0:
            kept = len(_tasks())
        else:
            assert len(_tasks()) == kept
        for w1, w2 in zip(whole, blocked):
            for a, b in zip(w1.pieces, w2.pieces):
                for x, y in zip((*a.state, a.out), (*b.state, b.out)):
                    assert torch.equal(x, y)


def _tasks() -> list[int]:
    """The ids of this process's threads, Python's and native (Linux; else none)."""
    task = "/proc/self/task"
    return [int(t) for t in os.listdir(task)] if os.path.isdir(task) else []


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_native_queue_dropped_without_join_lets_its_workers_go():
    """A queue dropped while its workers wait for a chunk (the caller failed between ``start``
    and ``join``) releases them: the next queue's workers run."""
    import gc
    q = adam_kernel().queue(2)
    q.start(2, [])
    q.add(_work([100], block=256))  # never readied
    del q
    gc.collect()
    works = [_work([300, 70], block=64, seed=1)]
    q = adam_kernel().queue(2)
    q.start(2, [])
    q.ready(q.add(works[0]))
    assert q.wait(0) is None
    q.close()
    q.join()


@pytest.mark.skipif("native" not in KERNELS or not hasattr(os, "fork"),
                    reason="native kernel not built here, or no fork")
def test_native_workers_run_in_a_forked_child():
    """A child forked after the pool's threads started gets a pool of its own (the parent's
    threads are not in it) and steps the same as the parent. (Leaves below torch's parallel
    grain: a child forked after OpenMP ran hangs in torch's next parallel region.)"""
    import multiprocessing
    ex = HostExecutor(threads=2, worker_elements=1)
    leaf = _adam_leaf("w", n=20_000)
    ex.run([leaf], adam_kernel())  # the pool's threads exist now
    expected = _adam_leaf("w", n=20_000)
    ex.run([expected], adam_kernel())

    def child() -> None:  # exit status 0 only if its run matched
        again = _adam_leaf("w", n=20_000)
        ex.run([again], adam_kernel())
        if not all(torch.equal(a, b) for a, b in zip(again.state, expected.state)):
            raise SystemExit(1)

    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    assert p.exitcode == 0


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_native_workers_pinned_to_the_executors_cpus():
    """With ``cpus`` the native workers run on the executor's CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: pinned and unpinned are the same")
    ex = HostExecutor(threads=2, cpus=[cpus[1]], worker_elements=1)
    leaf = _adam_leaf("w", n=200_000)
    ex.run([leaf], adam_kernel())
    assert torch.all(leaf.state[0] < 0)
    affinities = []
    for tid in _tasks():
        try:
            affinities.append(os.sched_getaffinity(tid))
        except OSError:  # (a thread that ended meanwhile)
            pass
    assert {cpus[1]} in affinities  # a pool thread pinned to the executor's CPU


@pytest.mark.parametrize("use_native", [False, True])
def test_failure_while_landing_a_chunk_does_not_hang(use_native):
    """A failure where the lander thread readies a chunk surfaces at the caller, naming the
    chunk's leaf; the workers waiting in the queue are released and the executor runs again."""
    if use_native and "native" not in KERNELS:
        pytest.skip("native kernel not built here")
    kernel = adam_kernel() if use_native else per_block(lambda g, st, out, h: st[0].sub_(g))
    ex = staged(chunk_bytes=4096, slots=2, threads=2)
    with fail_host_kernel(after=2, exc=OSError("event wait failed")):
        with pytest.raises(fo.HostStepError, match="failed on leaf 'w'.*event wait failed"):
            ex.run([_adam_leaf("w")], kernel)  # five chunks of 4096 bytes
    ok = _adam_leaf("w")
    ex.run([ok], kernel)
    assert torch.all(ok.state[0] < 0)
    ex.close()


def test_param_out_path_copies_values_back():
    ex = staged(chunk_bytes=4096, slots=2, threads=2)
    n = 3000
    value = torch.arange(n, dtype=torch.float32)
    param = torch.zeros(n, dtype=torch.bfloat16)

    def kernel(g, st, out, h):
        st[0].add_(g.float())
        out.copy_(st[0])

    ex.run([HostLeaf("p", torch.ones(n, dtype=torch.bfloat16), param, (value,), None)], per_block(kernel))
    assert torch.equal(param, (torch.arange(n) + 1).to(torch.bfloat16))
    assert ex.pinned_bytes == 0


def test_grads_laid_end_to_end_in_one_storage_are_copied_as_one_range():
    """Segments that lie in one storage as they lie in a slot (a delayed step's buffer) are copied
    with one call per range of bytes; a gap (a leaf whose bytes are not a multiple of 64) and a
    strided grad start new ranges. The kernel sees the values of separate grads."""
    sizes = [16, 48, 1000, 33, 4096, 512]  # elements (fp32): 1000 and 33 leave gaps after them
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + -(-n // 16) * 16)
    flat = torch.randn(starts[-1] + sizes[-1], generator=torch.Generator().manual_seed(0))
    grads = [flat[a:a + n] for a, n in zip(starts, sizes)] + [torch.randn(600)[::2]]

    def kernel(g, st, out, h):
        st[0].copy_(g)

    def go(gs):
        ex = staged(chunk_bytes=8192, slots=2, threads=2)
        t = ex.transport(CPU)
        calls = []

        def copy_in(dst, src, plain=t.copy_in):
            calls.append(dst.numel())
            plain(dst, src)

        t.copy_in = copy_in
        values = [torch.zeros(g.numel()) for g in gs]
        ex.run([HostLeaf(str(i), g, None, (v,), None) for i, (g, v) in enumerate(zip(gs, values))],
               per_block(kernel))
        return values, len(calls)

    merged, calls = go(grads)
    separate, separate_calls = go([g.clone() for g in grads])
    for v, w, g in zip(merged, separate, grads):
        assert torch.equal(v, g) and torch.equal(w, g)
    assert calls < separate_calls


def test_host_grads_are_read_in_place_without_a_ring():
    """CPU params: the kernel reads the grads where they are (no staging copy, no ring)."""
    tl = Timeline()
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2, timeline=tl)
    params = make_params(big=True)
    opt = fo.adamw(1e-2, executor=ex)
    state = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], state)
    lanes = {e["lane"] for e in tl.events()}
    assert "D2H" not in lanes and "H2D" not in lanes and any(x.startswith("fo-host") for x in lanes)
    assert ex.pinned_bytes == 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_sgd_host_kernels_agree(kernel):
    params = make_params(dtype=torch.bfloat16)
    grads = grad_seq(params, 5)
    outs = []
    for k in ("torch", kernel):
        opt = fo.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, cpu_kernel=k,
                     executor=HostExecutor(chunk_bytes=4096, threads=2))
        p = clone(params)
        s = opt.init(p)
        for g in grads:
            p, s = opt.update(g, s)
        outs.append(s.master)
    for a, b in zip(optree.tree_leaves(outs[0]), optree.tree_leaves(outs[1])):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_executor_arguments():
    assert physical_cores() >= 1
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostExecutor(chunk_bytes=10)
    with pytest.raises(ValueError, match="multiple of 64.*chunk_bytes=4097"):
        HostExecutor(chunk_bytes=4097)  # a ring region would start inside an element
    with pytest.raises(ValueError, match="threads"):
        HostExecutor(threads=0)
    with pytest.raises(ValueError, match="cpu_kernel"):
        fo.adamw(1e-3, cpu_kernel="fast")
    with pytest.raises(TypeError, match="executor must be a HostExecutor"):
        fo.adamw(1e-3, executor="default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_params_requiring_grad(dtype):
    """Params of an nn.Module require grad; the workers' writes to them must still work."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(dtype)
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, executor=HostExecutor(chunk_bytes=4096, threads=3))
    state = opt.init(params)
    model(torch.randn(8, 64, dtype=dtype)).square().mean().backward()
    before = params["weight"].detach().clone()
    new, state = opt.update({k: p.grad for k, p in params.items()}, state)
    assert new["weight"] is params["weight"] and new["weight"].requires_grad
    assert not torch.equal(new["weight"], before)


def test_a_delayed_run_through_the_ring_cuts_bigger_chunks():
    """A delayed step's run copies through the ring beside the caller's next forward and
    backward: its chunks are BESIDE times the executor's, the ring grows for them, and the
    plain steps before and after (the first chunks of the old ring, then of the grown one) and
    the delayed one give the bits of runs in place."""
    from functional_offload.executor.host import BESIDE
    tl = Timeline()
    ex = staged(chunk_bytes=4096, slots=2, threads=2, timeline=tl)
    assert ex.chunk(CPU) == ex.chunk(CPU, beside=True) // BESIDE == 4096
    assert HostExecutor(chunk_bytes=4096).chunk(CPU, beside=True) == 4096  # no ring: in place
    params = make_params(big=True)  # (fp32: 27 KB of grads, two chunks beside)
    grads = grad_seq(params, 2)
    flat = [HostLeaf("", g.reshape(-1), None, (), None) for g in optree.tree_leaves(grads[0])]

    def copied_in():  # the chunks of the runs since the last call (their grads' copies in)
        names = {e["name"] for e in tl.events() if e["lane"] == "D2H"}
        tl.clear()
        return len(names)

    got = []
    for delayed in (False, fo.Delay(lookahead=False), False):
        opt = fo.adamw(1e-2, delayed=delayed, executor=ex)
        p, s = clone(params), None
        s = opt.init(p)
        tl.clear()
        p, s = opt.update(grads[0], s)
        fo.flush(s)
        size = 4096 * BESIDE if delayed else 4096
        assert copied_in() == len(chunks_of(flat, size)) > 1, delayed
        p, s = opt.update(grads[1], s)
        fo.flush(s)
        want_opt = fo.adamw(1e-2, delayed=delayed, executor=HostExecutor(chunk_bytes=4096, threads=2))
        q = clone(params)
        w = want_opt.init(q)
        for g in grads[:2]:
            q, w = want_opt.update(g, w)
        fo.flush(w)
        for a, b in zip(optree.tree_leaves(p), optree.tree_leaves(q)):
            assert torch.equal(a, b)
        got.append(p)
    for a, b in zip(optree.tree_leaves(got[0]), optree.tree_leaves(got[2])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", KERNELS)
def test_timeline_records_every_chunk_and_exports(tmp_path, kernel):
    """Worker spans come from the Python queue and from the native one (its own clock)."""
    import json
    tl = Timeline()
    ex = staged(chunk_bytes=4096, slots=3, threads=2, timeline=tl)
    params = make_params(dtype=torch.bfloat16, big=True)
    opt = fo.adamw(1e-2, executor=ex, cpu_kernel=kernel)
    state = opt.init(params)
    grads = grad_seq(params, 1)[0]
    params, state = opt.update(grads, state)
    events = tl.events()
    chunks = len(chunks_of([HostLeaf("", g.reshape(-1), None, (), None) for g in optree.tree_leaves(grads)],
                           4096))
    assert chunks > 2
    names = {e["lane"]: set() for e in events}
    for e in events:
        names[e["lane"]].add(e["name"])
        assert e["dur_us"] >= 0 and e["start_us"] >= 0
    assert names["D2H"] == {f"grads c{k}" for k in range(chunks)}
    assert names["H2D"] == {f"params c{k}" for k in range(chunks)}  # staged as a GPU's
    kernels = {n for k, v in names.items() if k.startswith("fo-host") for n in v if n.startswith("kernel")}
    assert kernels == {f"kernel c{k}" for k in range(chunks)}
    d2h = {e["name"][len("grads "):]: e for e in events if e["lane"] == "D2H"}
    for e in events:  # one clock: no chunk's kernel starts before its grads were copied
        if e["name"].startswith("kernel"):
            c = d2h[e["name"][len("kernel "):]]
            assert e["start_us"] >= c["start_us"] + c["dur_us"] - 1
    tl.to_chrome(tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in trace) == len(events)
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == set(names)
    tl.plot(tmp_path / "t.png", title="cpu")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tl.clear()
    assert tl.events() == []


@pytest.mark.parametrize("kernel", KERNELS)
def test_concurrent_runs_on_one_executor(kernel):
    """Two threads updating through one executor at once (e.g. a delayed step in the background
    and another optimizer's update) both finish, each with the result of running alone."""
    a, b = make_params(dtype=torch.bfloat16, big=True), make_params(dtype=torch.float32, big=True)
    ga, gb = grad_seq(a, 3, seed=1), grad_seq(b, 3, seed=2)
    results = {}

    def train(ex, name, params, grads):
        opt = fo.adamw(1e-2, weight_decay=0.1, executor=ex, cpu_kernel=kernel)
        p = clone(params)
        s = opt.init(p)
        for g in grads:
            p, s = opt.update(g, s)
        results[name] = p

    train(staged(chunk_bytes=4096, slots=2, threads=2), "a", a, ga)
    train(staged(chunk_bytes=4096, slots=2, threads=2), "b", b, gb)
    alone = [results.pop("a"), results.pop("b")]
    ex = staged(chunk_bytes=4096, slots=2, threads=2)  # shared: one ring for both
    threads = [threading.Thread(target=train, args=(ex, *x)) for x in (("a", a, ga), ("b", b, gb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for name, want in zip("ab", alone):
        for x, y in zip(optree.tree_leaves(results[name]), optree.tree_leaves(want)):
            assert torch.equal(x, y)
    ex.close()


def test_a_run_fed_leaf_by_leaf_cuts_chunks_from_what_has_arrived():
    """A run fed one leaf at a time: a chunk never waits to be filled (the second leaf is only
    handed over once the first one's kernel ran), and every element is updated once."""
    ex = staged(chunk_bytes=4096, slots=2, threads=2)
    sizes = [300, 5000, 7, 2048]
    leaves = [HostLeaf(str(i), torch.full((n,), float(i + 1)), None, (torch.zeros(n),), None)
              for i, n in enumerate(sizes)]
    ran = {i: threading.Event() for i in range(len(sizes))}

    def kernel(work):
        for p, a, b in work.claims():
            p.state[0][a:b].add_(p.grad[a:b])
            ran[int(p.grad[a]) - 1].set()

    r = ex.open(CPU, kernel)
    late = []
    for i, leaf in enumerate(leaves):
        r.add(leaf, None)
        if not ran[i].wait(5):
            late.append(i)  # its chunk waited for a later leaf
    r.close()
    r.wait()
    assert late == [] and r.error is None
    for i, leaf in enumerate(leaves):
        assert torch.equal(leaf.state[0], torch.full((sizes[i],), float(i + 1)))
    ex.close()


@pytest.mark.parametrize("stage", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_in_the_steps_thread_give_the_results_of_spread_runs(dtype, stage):
    """A plain update's run sized when it opens: one chunk and one worker in the step's own
    thread, or several chunks driven there with fewer workers, give the same bits as every
    thread working on tiny chunks."""
    params = make_params(dtype=dtype, big=True)
    grads = grad_seq(params, 3)

    def run_with(ex):
        opt = fo.adamw(1e-2, weight_decay=0.1, ema_decay=0.9, executor=ex)
        p = clone(params)
        s = opt.init(p)
        for g in grads:
            p, s = opt.update(g, s)
        return p, fo.state_dict(s)

    spread = run_with(HostExecutor(stage_host_grads=stage, chunk_bytes=4096, threads=3, worker_elements=1))
    for ex in (HostExecutor(stage_host_grads=stage, chunk_bytes=1 << 20),  # alone
               HostExecutor(stage_host_grads=stage, chunk_bytes=4096, threads=3)):  # driven there
        p, sd = run_with(ex)
        for a, b in zip(optree.tree_leaves(p), optree.tree_leaves(spread[0])):
            assert torch.equal(a, b)
        assert sd.keys() == spread[1].keys() and all(torch.equal(sd[k], spread[1][k]) for k in sd)


def test_a_small_update_starts_no_thread(monkeypatch):
    """Below ``worker_elements`` a plain update's run has no driver, lander or worker thread:
    the step's own thread does it all."""
    params = make_params(big=True)
    opt = fo.adamw(1e-2, executor=HostExecutor(threads=4))
    p = clone(params)
    s = opt.init(p)
    p, s = opt.update(grad_seq(params, 1)[0], s)  # the executor exists from here
    started = []
    start = threading.Thread.start

    def counted(self):
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    p, s = opt.update(grad_seq(params, 1, seed=2)[0], s)
    assert not [n for n in started if n.startswith(("fo-run", "fo-land", "fo-host"))], started


def test_an_executor_is_shared_by_deep_copies_and_refuses_pickling():
    """copy.deepcopy of an optimizer built with a HostExecutor (a TorchOptimizer, say) shares
    the executor (it raised: cannot pickle '_thread.lock'); pickling names what to do."""
    import copy
    import pickle
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    m = torch.nn.Linear(4, 4)
    opt = fo.TorchOptimizer(m.parameters(), fo.adamw, lr=1e-2, executor=ex)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    twin = copy.deepcopy(opt)
    assert copy.deepcopy(ex) is ex
    assert torch.equal(twin.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(TypeError, match="cannot be pickled.*fo.save"):
        pickle.dumps(ex)
