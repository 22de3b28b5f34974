"""Train a small MLP with a functional loop and host-resident optimizer state, then resume.

    python examples/train_mlp.py [--steps 300] [--fraction 1.0]

Runs on CUDA when there is a GPU (the state of the offloaded leaves then lives in host memory
and the host executor runs their update), on the CPU otherwise.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import optree
import torch

import functional_offload as fo


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 1),
    ).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fraction", type=float, default=1.0, help="offload fraction in [0, 1]")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model = make_model(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(4096, 32, generator=g).to(device)
    w = torch.randn(32, 1, generator=g).to(device)
    y = torch.sin(x @ w) + 0.1 * torch.cos(3 * x[:, :1])

    def loss_fn(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (xb,)), yb)

    grad_fn = torch.func.grad_and_value(loss_fn)
    schedule = fo.schedules.warmup_cosine(3e-3, 20, 2 * args.steps, end=3e-4)
    opt = fo.chain(
        fo.clip_by_global_norm(1.0),
        fo.adamw(lr=schedule, betas=(0.9, 0.95), weight_decay=0.01,
                 placement=fo.placement.offload_fraction(args.fraction),
                 weight_decay_mask=lambda p: optree.tree_map(lambda t: t.ndim > 1, p)),
    )
    state = opt.init(params)

    def train(params: dict, state, steps: int, start: int):
        t0 = time.perf_counter()
        for i in range(start, start + steps):
            idx = torch.randint(0, x.shape[0], (256,), generator=g).to(device)
            grads, loss = grad_fn(params, x[idx], y[idx])
            params, state = opt.update(grads, state)
            if i % 50 == 0 or i == start + steps - 1:
                print(f"step {i:4d}  loss {loss.item():.5f}")
        if device.type == "cuda":
            torch.cuda.synchronize()
        return params, state, steps / (time.perf_counter() - t0)

    print(f"device {device}; {sum(p.numel() for p in params.values()):,} params")
    params, state, rate = train(params, state, args.steps, 0)
    full_loss = loss_fn(params, x, y).item()

    adam_state = state[-1]
    leaves = optree.tree_leaves((adam_state.mu, adam_state.nu, adam_state.master))
    host = sum(t.numel() * t.element_size() for t in leaves if t.device.type == "cpu")
    dev = sum(t.numel() * t.element_size() for t in leaves if t.device.type != "cpu")
    where = sorted({f"{k}: {v.device}" for k, v in adam_state.mu.items()})
    print(f"\nsummary: {rate:.1f} steps/s, full-batch loss {full_loss:.5f}")
    print(f"state bytes on host {host:,}, on device {dev:,}")
    print("where the moments live:", "; ".join(where))

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "opt.safetensors")
        fo.save(state, path)
        resumed = fo.load(path, like=opt.init(params))  # a fresh state, filled from the file
        print(f"\ncheckpointed at step {int(adam_state.count)}, resumed into a fresh state")
        params, resumed, _ = train(params, resumed, args.steps // 3, args.steps)
    print(f"after resume: full-batch loss {loss_fn(params, x, y).item():.5f} "
          f"(was {full_loss:.5f} at the checkpoint)")


if __name__ == "__main__":
    main()
