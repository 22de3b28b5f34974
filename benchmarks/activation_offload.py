"""Activation offload on a transformer-like stack: none vs save_on_cpu vs ours.

    python benchmarks/activation_offload.py --d 4096 --blocks 8 --tokens 16384

Blocks ``x -> x + W2·gelu(W1·x)`` (bf16, ffn = 4d), one group each. Modes: ``none``;
``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the whole
forward); ``ours-all`` (every group but the last) and ``ours-half`` (the earliest half), prefetch
1. Reports step time (forward+backward), peak GPU memory over the params, bytes moved to the
host per step and their rate, and the ratio to ``max(no-offload step, bytes / PCIe rate)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import optree
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from functional_offload.activations import ActivationOffload  # noqa: E402


def d2h_rate(nbytes: int = 1 << 30) -> float:
    """Pinned device-to-host copy rate in GB/s (median of 5 copies of ``nbytes``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--inflight-groups", type=float, default=2.0,
                    help="max bytes in flight to the host, in groups' worth of activations")
    ap.add_argument("--out")
    args = ap.parse_args()
    d, n = args.d, args.blocks
    g = torch.Generator(device="cuda").manual_seed(0)
    params = {f"b{i}": {"w1": (torch.randn(4 * d, d, device="cuda", generator=g) / d ** 0.5).bfloat16(),
                        "w2": (torch.randn(d, 4 * d, device="cuda", generator=g) / (4 * d) ** 0.5).bfloat16()}
              for i in range(n)}
    x = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16)
    model_bytes = sum(t.numel() * t.element_size() for t in optree.tree_leaves(params))

    def forward(p, x, off=None):
        for i in range(n):
            with off.group(i) if off else torch.enable_grad():
                x = x + torch.nn.functional.gelu(x @ p[f"b{i}"]["w1"].t()) @ p[f"b{i}"]["w2"].t()
        return x.float().square().mean()

    def plain(p, x, ctx=None):
        leaves, spec = optree.tree_flatten(p)
        inputs = [t.detach().requires_grad_() for t in leaves]
        with ctx if ctx is not None else torch.enable_grad():
            loss = forward(optree.tree_unflatten(spec, inputs), x)
        return torch.autograd.grad(loss, inputs)

    modes = {"none": lambda: plain(params, x),
             "save_on_cpu": lambda: plain(params, x, torch.autograd.graph.save_on_cpu(pin_memory=True))}
    per_group = args.tokens * (d + 2 * 4 * d) * 2  # bf16: x, pre-gelu, gelu output
    bound = dict(min_bytes=1 << 20, max_inflight_bytes=args.inflight_groups * per_group)
    offs = {"ours-all": ActivationOffload(n, n - 1, **bound),
            "ours-half": ActivationOffload(n, n // 2, **bound)}
    for name, off in offs.items():
        vg = off.value_and_grad(lambda p, x, off=off: forward(p, x, off))
        modes[name] = lambda vg=vg: vg(params, x)[1]  # the grads, as plain() returns them

    pcie = d2h_rate()
    ref = modes["none"]()
    rows = []
    for name, fn in modes.items():
        got = fn()
        pairs = list(zip(optree.tree_leaves(ref), optree.tree_leaves(got)))
        same = all(torch.equal(a, b) for a, b in pairs)
        max_diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        off = offs.get(name)
        before = off.stats["offloaded_bytes"] if off else 0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        moved = (off.stats["offloaded_bytes"] - before) / args.steps if off else None
        rows.append({"mode": name, "step_s": statistics.median(times), "grads_equal": same, "max_abs_diff": max_diff,
                     "peak_gib": (torch.cuda.max_memory_allocated() - model_bytes) / 2**30,
                     "bytes_moved": moved, "pinned_bytes": off.pinned_bytes if off else None})
    base = rows[0]["step_s"]
    print(f"\nactivation offload, d={d} blocks={n} tokens={args.tokens} bf16 (median of {args.steps}); "
          f"pinned D2H measured {pcie:.1f} GB/s")
    print(f"{'mode':<12} {'step s':>8} {'peak GiB':>9} {'GB moved':>9} {'GB/s':>7} {'vs bound':>9} "
          f"{'grads':>6}")
    for r in rows:
        gb = r["bytes_moved"] / 1e9 if r["bytes_moved"] is not None else None
        bound = max(base, gb / pcie) if gb else base
        rate = f"{gb / r['step_s']:.1f}" if gb else "-"
        print(f"{r['mode']:<12} {r['step_s']:>8.3f} {r['peak_gib']:>9.2f} "
              f"{gb if gb is not None else float('nan'):>9.2f} {rate:>7} {r['step_s'] / bound:>9.2f} "
              f"{'same' if r['grads_equal'] else 'DIFF':>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "pcie_gbs": pcie, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
