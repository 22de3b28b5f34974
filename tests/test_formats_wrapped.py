"""The compact state formats (split master, block-wise 8-bit moments, bf16 moments) inside the
optax combinators — ``MultiSteps``, ``inject_hyperparams``, ``partition`` — each against its
oracle run on the same format, through a checkpoint taken mid-run, plain and streamed."""

from __future__ import annotations

import optree
import pytest
import torch

import functional_offload as fo
from conftest import FORMATS, KERNELS, clone, resume, run
from functional_offload.executor import HostExecutor

LABELS = {"w": "big", "v": "big", "b": "small"}


def _params() -> dict[str, torch.Tensor]:
    """bf16 leaves above the size that keeps fp32 masters and moments (``w``, ``v``: a last
    8-bit block of 113 and 17 elements) and one below it."""
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (300, 233), "v": (66_065,), "b": (37,)}
    return {k: torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}


def _grads(params: dict, steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{k: torch.randn(v.shape, generator=g).bfloat16() for k, v in params.items()}
            for _ in range(steps)]


def _adamw(fmt: str, kernel: str, lr=1e-2) -> fo.Optimizer:
    return fo.adamw(lr, weight_decay=0.1, cpu_kernel=kernel, **FORMATS[fmt],
                    executor=HostExecutor(chunk_bytes=1 << 16, slots=3, threads=2))


def _same(a, b) -> bool:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y)
                                      for x, y in zip(la, lb))


def _stored(state, fmt: str) -> None:
    """The big leaves hold the format (a run that fell back to fp32 state would pass the
    comparisons trivially); the small one an fp32 master, and 8-bit moments only above a size."""
    dtypes = {".".join(r["path"].split(".")[-2:]): r["dtype"] for r in fo.placement_report(state).rows}
    mu = {"8bit": "uint8", "split-8bit": "uint8", "split-bf16": "bfloat16"}.get(fmt, "float32")
    for k in ("w", "v"):
        assert dtypes[f"master.{k}"] == ("int16" if "split" in fmt else "float32"), dtypes
        assert dtypes[f"mu.{k}"] == mu and dtypes[f"nu.{k}"] == mu, dtypes
    if "master.b" in dtypes:  # (not in a partition's part of the big leaves)
        assert dtypes["master.b"] == "float32" and dtypes["mu.b"] == mu.replace("uint8", "float32")


@pytest.fixture(params=list(FORMATS))
def fmt(request) -> str:
    return request.param


def _mean(cycle: list[dict]) -> dict:
    return {k: (sum(g[k].float() for g in cycle) / len(cycle)).bfloat16() for k in cycle[0]}


@pytest.mark.parametrize("kernel", KERNELS)
def test_multisteps_of_a_format_is_its_mean_grad_step_through_a_checkpoint(fmt, kernel, tmp_path):
    k, params = 3, _params()
    grads = _grads(params, 2 * k)
    mk = lambda: fo.chain(fo.clip_by_global_norm(1.0), _adamw(fmt, kernel))  # noqa: E731
    want, want_state = run(mk(), params, [_mean(grads[:k]), _mean(grads[k:])])
    opt = fo.MultiSteps(mk(), k, acc_dtype=torch.float32)
    p, s = clone(params), None
    s = opt.init(p)
    for j, g in enumerate(grads):
        if j == k + 1:
            p, s = resume(opt, s, p, tmp_path / "ms")
        p, s = opt.update(g, s)
    fo.flush(s)
    _stored(s, fmt)
    assert _same(p, want)
    inner = {n.removeprefix("inner_state."): v for n, v in fo.state_dict(s).items()
             if n.startswith("inner_state.")}
    assert _same(inner, fo.state_dict(want_state))


@pytest.mark.parametrize("kernel", KERNELS)
def test_injected_hyperparams_of_a_format_are_the_schedule_through_a_checkpoint(fmt, kernel,
                                                                                  tmp_path):
    sched = fo.schedules.warmup_cosine(1e-2, 2, 8)
    params = _params()
    grads = _grads(params, 6)
    want, want_state = run(_adamw(fmt, kernel, lr=sched), params, grads)
    opt = fo.inject_hyperparams(fo.adamw, static_args=("cpu_kernel",))(
        lr=sched, weight_decay=0.1, cpu_kernel=kernel, **FORMATS[fmt],
        executor=HostExecutor(chunk_bytes=1 << 16, slots=3, threads=2))
    p = clone(params)
    s = opt.init(p)
    for n, g in enumerate(grads):
        if n == 3:
            p, s = resume(opt, s, p, tmp_path / "inject")
        p, s = opt.update(g, s)
    fo.flush(s)
    _stored(s, fmt)
    assert _same(p, want)
    assert _same(fo.state_dict(s.inner_state), fo.state_dict(want_state))


@pytest.mark.parametrize("streamed", [False, True], ids=["update", "stream"])
def test_a_partition_of_formats_is_its_parts_run_separately(fmt, streamed, tmp_path):
    """The big leaves in the format (clipped over their part), the small one by SGD with
    momentum; through a checkpoint; plain or with every grad streamed in during backward."""
    params = _params()
    grads = _grads(params, 4)
    mk_big = lambda: fo.chain(fo.clip_by_global_norm(0.5), _adamw(fmt, KERNELS[-1]))  # noqa: E731
    mk_small = lambda: fo.sgd(0.05, momentum=0.9)  # noqa: E731
    opt = fo.partition({"big": mk_big(), "small": mk_small()}, LABELS)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    s = opt.init(p)
    for n, g in enumerate(grads):
        if n == 2:
            fo.save(s, tmp_path / "part")
            p = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
            s = fo.load(tmp_path / "part", like=opt.init(p))
        if streamed:
            with fo.stream(opt, s) as st:
                sum((x.float() * g[k].float()).sum() for k, x in p.items()).backward()
            p, s = st.finish()
            assert st.arrived == set(range(len(p)))
            for x in p.values():
                x.grad = None
        else:
            p, s = opt.update(g, s)
    fo.flush(s)
    _stored(s.inner_states["big"], fmt)
    for label, mk in (("big", mk_big), ("small", mk_small)):
        keys = [k for k in params if LABELS[k] == label]
        want, want_state = run(mk(), {k: params[k] for k in keys},
                               [{k: g[k] for k in keys} for g in grads])
        assert _same({k: p[k].detach() for k in keys}, want), label
        assert _same(fo.state_dict(s.inner_states[label]), fo.state_dict(want_state)), label
