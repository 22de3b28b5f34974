"""A functional loop with both offload mechanisms: activations and optimizer state.

    python examples/train_both.py [--steps 60]

Residual MLP blocks, one layer group each. The activations saved by the earliest groups go to
host memory during the forward and come back during backward (``ActivationOffload``); the AdamW
state of every leaf lives in host memory (``placement.on_host()``). On a machine without a GPU
both run their CPU path (activation hooks as a pass-through).
"""

from __future__ import annotations

import argparse
import time

import torch

import functional_offload as fo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d, n = args.d, args.blocks
    g = torch.Generator().manual_seed(0)
    params = {f"block{i}": {"w1": (torch.randn(4 * d, d, generator=g) / d ** 0.5).to(device),
                            "w2": torch.zeros(d, 4 * d).to(device)} for i in range(n)}
    target = torch.randn(d, d, generator=g).to(device) / d ** 0.5

    off = fo.ActivationOffload(num_groups=n, offload=n - 1, min_bytes=1 << 14)

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(n):
            with off.group(i):
                h = h + torch.nn.functional.gelu(h @ p[f"block{i}"]["w1"].t()) @ p[f"block{i}"]["w2"].t()
        return (h - x @ target).square().mean()

    value_and_grad = off.value_and_grad(loss_fn)
    opt = fo.chain(fo.clip_by_global_norm(1.0),
                   fo.adamw(1e-3, weight_decay=0.0, placement=fo.placement.on_host()))
    state = opt.init(params)
    t0 = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(512, d, generator=g).to(device)
        loss, grads = value_and_grad(params, x)
        params, state = opt.update(grads, state)
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.5f}")
    print(f"\n{args.steps / (time.perf_counter() - t0):.1f} steps/s on {device}; activations "
          f"offloaded per step: {off.stats['offloaded_bytes'] / max(1, args.steps) / 2**20:.1f} MiB "
          f"(0 on the CPU: pass-through); optimizer state on host: "
          f"{fo.placement_report(state).host_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
