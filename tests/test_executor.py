"""The host pipeline's logic (chunking, ring reuse, ordering, threads, errors) on the CPU.

With params on the CPU the transport's copies are synchronous, but every other part — chunks
crossing leaves, ring slots reused many times, pieces spread over worker threads, errors from a
worker — is the code that runs against a GPU.
"""

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor, HostLeaf, physical_cores
from conftest import KERNELS, per_block, clone, grad_seq, make_params


def run(params, grads, **ex):
    opt = fo.adamw(1e-2, weight_decay=0.1, executor=HostExecutor(**ex), cpu_kernel="torch")
    p = clone(params)
    s = opt.init(p)
    for g in grads:
        p, s = opt.update(g, s)
    return p, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunking_does_not_change_results(dtype):
    params = make_params(dtype=dtype)
    grads = grad_seq(params, 4)
    whole, _ = run(params, grads, chunk_bytes=1 << 20, slots=2, threads=1)
    # 4 KiB chunks: every leaf splits, chunks cross leaves, the 2..3 slots are reused many times
    for slots, threads in [(2, 1), (3, 4), (5, 3)]:
        chunked, _ = run(params, grads, chunk_bytes=4096, slots=slots, threads=threads)
        for a, b in zip(optree.tree_leaves(whole), optree.tree_leaves(chunked)):
            assert torch.equal(a, b)


def test_chunk_plan_covers_every_element_once():
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=3)
    sizes = [1000, 3000, 17, 5000, 64]
    leaves = [HostLeaf(str(i), torch.zeros(n), torch.zeros(n), (), False, None) for i, n in enumerate(sizes)]
    chunks = ex._chunks(leaves)
    seen = {i: [] for i in range(len(sizes))}
    for chunk in chunks:
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


def _work(sizes, block, seed=0):
    from functional_offload.kernels.reference import AdamHyper
    from functional_offload.kernels.work import Piece, Work
    gen = torch.Generator().manual_seed(seed)
    h = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, True)
    pieces = [Piece(torch.randn(n, generator=gen).bfloat16(),
                    (torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                     torch.rand(n, generator=gen)), torch.empty(n, dtype=torch.bfloat16), h)
              for n in sizes]
    return Work(pieces, block)


def _claim_from_threads(kernel, work, threads=4):
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(kernel, work) for _ in range(threads)]:
            f.result()


def test_claimed_blocks_cover_every_element_once():
    import threading
    work = _work([1000, 37, 5000, 64], block=64)
    seen, lock = [], threading.Lock()

    def kernel(w):
        for p, a, b in w.claims():
            with lock:
                seen.append((id(p), a, b))

    _claim_from_threads(kernel, work)
    for p in work.pieces:
        spans = sorted((a, b) for i, a, b in seen if i == id(p))
        assert spans[0][0] == 0 and spans[-1][1] == p.grad.numel()
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert len(seen) == sum(-(-p.grad.numel() // 64) for p in work.pieces)


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_native_kernel_claims_blocks_like_one_pass():
    from functional_offload.kernels import cpu
    mod = cpu.native()
    sizes = [1000, 37, 5000, 64]
    whole, blocked = _work(sizes, block=1 << 20), _work(sizes, block=64)
    cpu.adam_chunk(mod, whole)  # one thread, one block per piece
    _claim_from_threads(lambda w: cpu.adam_chunk(mod, w), blocked)  # 4 threads, 64-element blocks
    assert int(blocked.counter) >= sum(-(-n // 64) for n in sizes)
    for a, b in zip(whole.pieces, blocked.pieces):
        for x, y in zip((*a.state, a.out), (*b.state, b.out)):
            assert torch.equal(x, y)


def test_worker_error_surfaces_at_caller():
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    n = 5000
    calls = []

    def kernel(g, st, out, h):
        calls.append(g.numel())
        if len(calls) == 3:
            raise FloatingPointError("boom")
        st[0].add_(g)

    leaf = HostLeaf("w", torch.ones(n), torch.zeros(n), (torch.zeros(n),), False, None)
    with pytest.raises(RuntimeError, match="host optimizer step failed on leaf 'w'.*boom") as e:
        ex.run([leaf], per_block(kernel))
    assert isinstance(e.value.__cause__, FloatingPointError)
    ex.close()


def test_write_param_path_copies_values_back():
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    n = 3000
    value = torch.arange(n, dtype=torch.float32)
    param = torch.zeros(n, dtype=torch.bfloat16)

    def kernel(g, st, out, h):
        st[0].add_(g.float())
        out.copy_(st[0])

    ex.run([HostLeaf("p", torch.ones(n, dtype=torch.bfloat16), param, (value,), True, None)], per_block(kernel))
    assert torch.equal(param, (torch.arange(n) + 1).to(torch.bfloat16))
    assert ex.pinned_bytes == 0 and ex.staging_bytes == 2 * 2 * 4096


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
    with pytest.raises(ValueError, match="threads"):
        HostExecutor(threads=0)
    with pytest.raises(ValueError, match="cpu_kernel"):
        fo.adamw(1e-3, cpu_kernel="fast")


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


def test_error_in_a_copy_does_not_hang():
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    n = 5000
    leaf = HostLeaf("w", torch.ones(n), torch.zeros(n), (torch.zeros(n),), False, None)
    ex.reserve(torch.device("cpu"))
    transport = ex._transports[torch.device("cpu")]
    calls = []

    def failing_copy(dst, src):  # the third copy in (issued once chunk 0 is done) fails
        calls.append(1)
        if len(calls) == 3:
            raise OSError("DMA failed")
        dst.copy_(src)

    transport.copy_in = failing_copy
    with pytest.raises(RuntimeError, match="leaf 'w'.*DMA failed"):
        ex.run([leaf], per_block(lambda g, st, out, h: st[0].add_(g)))
    ex.close()


def test_timeline_records_every_chunk_and_exports(tmp_path):
    import json

    from functional_offload.executor import Timeline
    tl = Timeline()
    ex = HostExecutor(chunk_bytes=4096, slots=3, threads=2, timeline=tl)
    params = make_params(dtype=torch.bfloat16)  # bf16: params are written back (H2D lane)
    opt = fo.adamw(1e-2, executor=ex)
    state = opt.init(params)
    params, state = opt.update(grad_seq(params, 1)[0], state)
    events = tl.events()
    chunks = len(ex._chunks([HostLeaf("", g.reshape(-1), g.reshape(-1), (), True, None)
                             for g in optree.tree_leaves(grad_seq(params, 1)[0])]))
    names = {e["lane"]: set() for e in events}
    for e in events:
        names[e["lane"]].add(e["name"])
        assert e["dur_us"] >= 0 and e["start_us"] >= 0
    assert names["D2H"] == {f"grads c{k}" for k in range(chunks)}
    assert "H2D" not in names  # CPU params are written in place: nothing to copy back
    kernels = {n for k, v in names.items() if k.startswith("fo-host") for n in v if n.startswith("kernel")}
    assert kernels == {f"kernel c{k}" for k in range(chunks)}
    tl.to_chrome(tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in trace) == len(events)
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == set(names)
    tl.plot(tmp_path / "t.png", title="cpu")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tl.clear()
    assert tl.events() == []


def test_streamed_run_cuts_chunks_from_what_has_arrived():
    """``run_stream``: one run fed leaf by leaf; a chunk never waits to be filled (the second
    leaf is only sent once the first one's kernel ran), and every element is updated once."""
    import queue
    import threading

    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2)
    sizes = [300, 5000, 7, 2048]
    leaves = [HostLeaf(str(i), torch.full((n,), float(i + 1)), torch.zeros(n), (torch.zeros(n),), False, None)
              for i, n in enumerate(sizes)]
    ran = {i: threading.Event() for i in range(len(sizes))}

    def kernel(work):
        for p, a, b in work.claims():
            p.state[0][a:b].add_(p.grad[a:b])
            ran[int(p.grad[a]) - 1].set()

    arrivals: "queue.Queue" = queue.Queue()
    late = []

    def feed():
        for i, leaf in enumerate(leaves):
            arrivals.put((leaf, None))
            if not ran[i].wait(5):
                late.append(i)  # its chunk waited for a later leaf
        arrivals.put(None)

    feeder = threading.Thread(target=feed)
    feeder.start()
    ex.run_stream(arrivals, kernel)
    feeder.join()
    assert late == []
    for i, leaf in enumerate(leaves):
        assert torch.equal(leaf.state[0], torch.full((sizes[i],), float(i + 1)))
    ex.close()
