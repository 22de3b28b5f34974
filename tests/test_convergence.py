"""Training on real text (the Python standard library's sources, bytes as tokens): a small
GPT-style decoder's loss curve under each mode against torch.optim.AdamW's, same init and
batches. The exact modes follow torch's loss to the kernels' rounding; the delayed mode with its
look-ahead follows it too, within a stated bound, where one-step-stale gradients do not."""

import argparse
import glob
import math
import os
import sys
import sysconfig

import pytest
import torch

import functional_offload as fo
from conftest import STALE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import convergence  # noqa: E402
import gpt  # noqa: E402

CFG = gpt.GPTConfig(d=32, layers=2, heads=2, vocab=256, ctx=32)
STEPS, BATCH, PEAK = 200, 8, 3e-3
HYPER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _text() -> torch.Tensor:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


TEXT = _text()


def lr_at(t: int) -> float:
    warm = 20
    if t < warm:
        return PEAK * (t + 1) / warm
    return PEAK * (0.1 + 0.45 * (1 + math.cos(math.pi * (t - warm) / (STEPS - warm))))


def _batch(g: torch.Generator):
    ix = torch.randint(len(TEXT) - CFG.ctx - 1, (BATCH,), generator=g)
    x = torch.stack([TEXT[i:i + CFG.ctx] for i in ix])
    return x, torch.stack([TEXT[i + 1:i + CFG.ctx + 1] for i in ix])


def _model():
    torch.manual_seed(0)
    return gpt.GPT(CFG)


def losses(mode: str) -> list[float]:
    model = _model()
    g = torch.Generator().manual_seed(1)
    out = []
    if mode == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=PEAK, foreach=False, **HYPER)
        for t in range(STEPS):
            loss = gpt.loss(model, *_batch(g))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
            for group in opt.param_groups:
                group["lr"] = lr_at(t)
            opt.step()
            out.append(loss.item())
        return out
    delayed = {"exact": False, "delayed": True, "stale": STALE}[mode]
    opt = fo.chain(fo.clip_by_global_norm(1.0),
                   fo.adamw(lr_at, **HYPER, cpu_kernel="torch", delayed=delayed))
    params = dict(model.named_parameters())
    state = opt.init(params)
    for t in range(STEPS):
        loss = gpt.loss(model, *_batch(g))
        grads = torch.autograd.grad(loss, list(params.values()))
        _, state = opt.update(dict(zip(params, grads)), state)
        out.append(loss.item())
    fo.flush(state)
    return out


@pytest.fixture(scope="module")
def reference():
    return losses("torch")


def test_the_exact_host_step_follows_torch_adamw(reference):
    ours = losses("exact")
    assert max(abs(a - b) for a, b in zip(ours, reference)) < 1e-5  # (0.0 measured)
    assert reference[-1] < reference[0] - 1.5  # it learns: the check is not of a flat curve


def test_the_lookahead_follows_the_exact_curve_where_stale_gradients_do_not(reference):
    """Every step delayed. With the look-ahead (``delayed=True``) each forward reads about the
    params the exact run reads, and the loss follows torch's; with one-step-stale gradients
    instead (``lookahead=False``) it falls behind."""
    ahead, stale = losses("delayed"), losses("stale")
    tail = lambda xs: sum(xs[-40:]) / 40  # noqa: E731
    late = lambda xs: max(abs(a - b) for a, b in zip(xs[20:], reference[20:]))  # noqa: E731
    assert abs(tail(ahead) - tail(reference)) < 0.01  # -0.0001 measured; stale: +0.10
    assert late(ahead) < 0.1  # 0.028 measured; stale: 0.95
    assert tail(stale) - tail(reference) > 0.05  # the check is not of a case without staleness


# The state formats on bf16 params with fp32 masters, through the GPU benchmark's own runs
# (benchmarks/convergence.py --smoke: a 1-block decoder with leaves past 65,536 elements, so the
# 8-bit moments are in use), against torch.optim.AdamW(fused=True) on fp32 masters.
FORMATS = argparse.Namespace(device="cpu", model="smoke", seed=0, steps=200, batch=4, threads=2,
                             eval_every=1000, val_sequences=8, save_every=1000, out=None)


@pytest.fixture(scope="module")
def fused_reference():
    return convergence.run_one("torch", FORMATS)


@pytest.mark.parametrize("run", ["plain", "r", "bf16", "q8", "r8"])
def test_each_state_format_trains_like_torch(fused_reference, run):
    """The native kernel rounds within a few ulps of torch's, the split master's param rounds
    ties away from zero, the compact moments round the moments: each a small difference in a
    step's loss (measured: 0.0017 for the native kernel, 0.0025-0.0030 for the formats, at most
    over 200 steps), none in where training ends
    (final validation loss within 4e-4 measured)."""
    ours = convergence.run_one(run, FORMATS)
    ref = fused_reference
    assert max(abs(a - b) for a, b in zip(ours["loss"], ref["loss"])) < 0.02
    assert abs(ours["final_val"] - ref["final_val"]) < 0.01
    assert ref["loss"][-1] < ref["loss"][0] - 2.0  # it learns
