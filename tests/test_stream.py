"""Grad streaming: updates start during backward and equal the plain update bit for bit."""

import optree
import pytest
import torch

import functional_offload as fo
from functional_offload.executor import HostExecutor
from conftest import KERNELS


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 4)).to(dtype)


def train(model, opt, streamed, steps=5, dtype=torch.float32):
    params = dict(model.named_parameters())
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(steps):
        loss = model(torch.randn(32, 16, generator=g).to(dtype)).float().square().mean()
        if streamed:
            with fo.stream(opt, state) as s:
                loss.backward()
                counts.append(len(s.streamed))  # handed over during backward
            params, state = s.finish()
        else:
            loss.backward()
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
    return params, state, counts


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", ["adamw", "sgd"])
def test_streamed_equals_plain_bit_for_bit(make, dtype, kernel):
    mk = (lambda: fo.adamw(1e-2, weight_decay=0.1, cpu_kernel=kernel,
                           executor=HostExecutor(chunk_bytes=4096, threads=2))) if make == "adamw" else \
         (lambda: fo.sgd(0.05, momentum=0.9, cpu_kernel=kernel, executor=HostExecutor(chunk_bytes=4096, threads=2)))
    a, b = make_model(dtype), make_model(dtype)
    pa, sa, _ = train(a, mk(), streamed=False, dtype=dtype)
    pb, sb, counts = train(b, mk(), streamed=True, dtype=dtype)
    assert counts == [6] * 5  # every param was handed over before backward returned
    for x, y in zip(optree.tree_leaves(pa), optree.tree_leaves(pb)):
        assert torch.equal(x, y)
    da, db = fo.state_dict(sa), fo.state_dict(sb)
    for k in da:
        assert torch.equal(da[k], db[k]), k


def test_frozen_params_and_weight_decay_mask():
    a, b = make_model(), make_model()
    for m in (a, b):
        m[0].weight.requires_grad_(False)
    mask = lambda p: {k: v.ndim > 1 for k, v in p.items()}  # noqa: E731
    mk = lambda: fo.adamw(1e-2, weight_decay=0.3, weight_decay_mask=mask)  # noqa: E731
    pa, _, _ = train(a, mk(), streamed=False)
    pb, _, counts = train(b, mk(), streamed=True)
    assert counts == [5] * 5
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_stream_rejects_chains_delayed_and_second_gradients():
    model = make_model()
    params = dict(model.named_parameters())
    chain = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2))
    with pytest.raises(TypeError, match="delayed=True"):
        fo.stream(chain, chain.init(params))
    delayed = fo.adamw(1e-2, delayed=True)
    with pytest.raises(ValueError, match="pick one|one of them"):
        fo.stream(delayed, delayed.init(params))
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    x = torch.randn(4, 16)
    with fo.stream(opt, state) as s:
        model(x).sum().backward()
        model(x).sum().backward()  # an accumulation streamed twice
    with pytest.raises(RuntimeError, match="second gradient"):
        s.finish()
