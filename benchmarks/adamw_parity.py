"""How many fp32 values of AdamW's step differ between implementations, on the CPU.

    python benchmarks/adamw_parity.py --steps 5

The same fp32 params, grads and hyperparameters (Megatron's: betas (0.9, 0.95), eps 1e-8,
weight decay 0.1) through torch's ``AdamW`` (its for-loop and its fused CPU kernel, which
Megatron's ``HybridDeviceOptimizer`` uses for the offloaded part) and ours (``fo.adamw`` on the
host, ``cpu_kernel="torch"`` and ``"native"``). Prints, per pair, the elements whose values
differ after each step, of all. Values that differ by an ulp can round to different bf16 params.
"""

from __future__ import annotations

import argparse

import torch

import functional_offload as fo

SHAPES = [(256, 64), (64,), (1000, 33), (17,), (4096, 256)]
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def grads(steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def torch_adamw(params: list[torch.Tensor], gs: list, **kw: bool) -> list[list[torch.Tensor]]:
    ms = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ms, **HYPER, **kw)
    out = []
    for step in gs:
        for m, g in zip(ms, step):
            m.grad = g.clone()
        opt.step()
        out.append([m.detach().clone() for m in ms])
    return out


def ours(params: list[torch.Tensor], gs: list, kernel: str) -> list[list[torch.Tensor]]:
    tree = {str(i): p.clone() for i, p in enumerate(params)}
    opt = fo.adamw(**HYPER, placement=fo.placement.on_host(), cpu_kernel=kernel)
    state = opt.init(tree)
    out = []
    for step in gs:
        tree, state = opt.update({str(i): g for i, g in enumerate(step)}, state)
        out.append([tree[str(i)].clone() for i in range(len(params))])
    return out


def differences(steps: int) -> tuple[int, dict[tuple[str, str], list[int]]]:
    """The values in all, and per pair of implementations the elements that differ after each
    of ``steps`` steps."""
    params = [torch.randn(s, generator=torch.Generator().manual_seed(0)) for s in SHAPES]
    gs = grads(steps)
    runs = {"torch for-loop": torch_adamw(params, gs, foreach=False),
            "torch fused": torch_adamw(params, gs, fused=True),
            "ours, torch kernel": ours(params, gs, "torch"),
            "ours, native kernel": ours(params, gs, "native")}
    names = list(runs)
    return sum(p.numel() for p in params), {
        (a, b): [sum(int((x != y).sum()) for x, y in zip(sa, sb))
                 for sa, sb in zip(runs[a], runs[b])]
        for i, a in enumerate(names) for b in names[i + 1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    total, pairs = differences(args.steps)
    print(f"{total:,} fp32 values; elements that differ after steps 1..{args.steps}")
    for (a, b), counts in pairs.items():
        print(f"{a:>20} vs {b:<20} {' '.join(f'{c:>7,}' for c in counts)}")


if __name__ == "__main__":
    main()
