import signal

import pytest
import torch

from functional_offload.kernels import native

HAS_NATIVE = native.module() is not None
import functional_offload as fo  # noqa: E402

STALE = fo.Delay(lookahead=False)  # every delayed step in flight, the params one step stale
AHEAD = fo.Delay()  # every delayed step in flight, the params landed by the look-ahead
DELAYS = {"stale": STALE, "ahead": AHEAD}  # the two machineries of delayed=...


def delay_of(mode: str):
    """The ``delayed`` option of a test's mode: "delayed" (:data:`STALE`), "ahead"
    (:data:`AHEAD`), else False."""
    return {"delayed": STALE, "ahead": AHEAD}.get(mode, False)

KERNELS = ["torch"] + (["native"] if HAS_NATIVE else [])
# the compact state formats (store_param_remainders, block-wise 8-bit or bf16 moments) by name
FORMATS = {"split": dict(store_param_remainders=True),
           "8bit": dict(mu_dtype=torch.uint8, nu_dtype=torch.uint8),
           "split-8bit": dict(store_param_remainders=True, mu_dtype=torch.uint8,
                              nu_dtype=torch.uint8),
           "split-bf16": dict(store_param_remainders=True, mu_dtype=torch.bfloat16,
                              nu_dtype=torch.bfloat16)}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _sigint_raises_keyboardinterrupt():
    """The Ctrl-C tests send SIGINT to the main thread (``_thread.interrupt_main``): a process
    started with SIGINT ignored (a background job of a non-interactive shell) would drop it."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def make_params(seed: int = 0, dtype=torch.float32, device="cpu", big: bool = False):
    """A small two-layer tree with a 3-D leaf; values drawn in fp32, then cast. ``big``: leaves
    of thousands of elements, so that a 4 KiB-chunk executor cuts several chunks."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"layer1": {"weight": (16, 8), "bias": (16,)},
              "layer2": {"weight": (4, 16), "bias": (4,)}, "scale": (3, 5, 7)}
    if big:
        shapes = {"layer1": {"weight": (64, 48), "bias": (64,)},
                  "layer2": {"weight": (40, 64), "bias": (40,)}, "scale": (3, 50, 7)}
    import optree
    return optree.tree_map(lambda s: torch.randn(s, generator=g).to(device, dtype), shapes,
                           is_leaf=lambda x: isinstance(x, tuple))


def grad_seq(params, steps: int, seed: int = 1):
    import optree
    g = torch.Generator().manual_seed(seed)
    return [optree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(p.device, p.dtype), params)
            for _ in range(steps)]


def clone(tree):
    import optree
    return optree.tree_map(lambda t: t.detach().clone(), tree)


def small_executor():
    """Tiny chunks, few slots and two threads, both working on any run: every run cuts several
    chunks, reuses slots and spreads them over the threads."""
    from functional_offload.executor import HostExecutor
    return HostExecutor(chunk_bytes=4096, slots=3, threads=2, worker_elements=1)


def resume(opt, state, params, path):
    """Save ``state``, then load it into a fresh state of ``opt`` on a copy of ``params``."""
    import functional_offload as fo
    fo.save(state, path)
    params = clone(params)
    return params, fo.load(path, like=opt.init(params))


def run(opt, params, grads):
    """``opt`` from ``init`` through ``update`` on each of ``grads``; anything delayed landed."""
    import functional_offload as fo
    params = clone(params)
    state = opt.init(params)
    for g in grads:
        params, state = opt.update(g, state)
    fo.flush(state)
    return params, state


def step_by(opt, state, params, grads, mode: str):
    """One step of ``opt`` by ``grads`` in ``mode``: "stream" (``fo.stream`` around a backward
    that gives ``params`` those grads, which are then cleared), else ``update``; the new state."""
    import functional_offload as fo
    if mode != "stream":
        return opt.update(grads, state)[1]
    with fo.stream(opt, state) as s:
        sum((p.float() * grads[k].float()).sum() for k, p in params.items()).backward()
    _, state = s.finish()
    for p in params.values():
        p.grad = None
    return state


def per_block(fn):
    """A host kernel from ``fn(grad, state, out, hyper)`` on each block the task claims."""
    def kernel(work):
        for p, a, b in work.claims():
            fn(p.grad[a:b], tuple(x[a:b] for x in p.state), p.out[a:b] if p.out is not None else None,
               p.hyper)
    return kernel


def end_rank() -> None:
    """A spawned rank's end (the two-process tests): its process group destroyed, then its
    garbage collected while the interpreter is whole. Left to the interpreter's teardown, the
    cycles holding a rank's sharded models and states went in an order that aborted the process
    now and then ("terminate called without an active exception": 5 of 34 runs of test_dcp with
    CUBLAS_WORKSPACE_CONFIG set, as test_convergence's import sets it; 0 of 30 with this)."""
    import gc

    import torch.distributed as dist
    dist.destroy_process_group()
    gc.collect()
