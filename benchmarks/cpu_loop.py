"""CPU-only training loop: fo.adamw on params in host memory against torch.optim.AdamW, one process.

    python benchmarks/cpu_loop.py --out cpu_loop.json        # 50 M fp32 params, both layouts
    python benchmarks/cpu_loop.py --numel 2000000 --steps 3   # quick (the smoke test's size)

Layouts: ``flat`` (``--numel`` fp32 elements in 4 equal leaves) and ``gpt`` (the 292 leaf shapes
of a 24-layer GPT (``gpt.py``) of the largest width, a multiple of 64, with at most ``--numel``
params; at least width 64, 4.5 M params). Systems, each on
its own copy of the same params and the same grads: ``torch fused`` (``AdamW(fused=True)``, the
reference), ``torch foreach`` (``AdamW(foreach=True)``), ``ours`` (``fo.adamw(...)``, its default
CPU kernel for CPU params) and ``ours native`` (``cpu_kernel="native"``). Reported: median
seconds per step after ``--warmup``, G elem/s, time over torch fused's, and the largest
difference from torch fused's params after the same steps (``allclose`` at rtol 1e-5, atol 1e-6).
The systems' steps are interleaved (each step of every system, then the next, the order reversed
every other step), so that a drift of the machine's speed falls on all of them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Callable

import torch

import gpt
from ours import HYPER, fo
from functional_offload.executor import HostExecutor, physical_cores

Params = dict[str, torch.Tensor]


def flat_shapes(numel: int) -> list[tuple[int, ...]]:
    return [(numel // 4,)] * 4


def gpt_shapes(numel: int) -> list[tuple[int, ...]]:
    """Leaf shapes of a 24-layer GPT (vocab 50,304, context 2,048) of at most ``numel`` params
    (width a multiple of 64, at least 64)."""
    d = 64
    while gpt.count_params(gpt.GPT(gpt.GPTConfig(d + 64, 24, 1), device="meta")) <= numel:
        d += 64
    return [tuple(p.shape) for p in gpt.GPT(gpt.GPTConfig(d, 24, 1), device="meta").parameters()]


def steppers(params: Params, threads: int) -> dict[str, tuple[Params, Callable[[Params], None]]]:
    """Per system: its copy of the params and ``step(grads)``."""
    out: dict[str, tuple[Params, Callable[[Params], None]]] = {}
    for name, kw in (("torch fused", dict(fused=True)), ("torch foreach", dict(foreach=True))):
        mine = {k: p.clone().requires_grad_() for k, p in params.items()}
        opt = torch.optim.AdamW(list(mine.values()), **kw, **HYPER)

        def step(grads: Params, mine: Params = mine, opt: torch.optim.Optimizer = opt) -> None:
            for k, p in mine.items():
                p.grad = grads[k]
            opt.step()
        out[name] = (mine, step)
    for name, kernel in (("ours", "auto"), ("ours native", "native")):
        mine = {k: p.clone() for k, p in params.items()}
        opt = fo.adamw(executor=HostExecutor(threads=threads), cpu_kernel=kernel, **HYPER)
        holder = [opt.init(mine)]

        def step(grads: Params, opt: fo.Optimizer = opt, holder: list = holder) -> None:
            _, holder[0] = opt.update(grads, holder[0])
        out[name] = (mine, step)
    return out


def run(layout: str, shapes: list[tuple[int, ...]], args: argparse.Namespace, threads: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    grad_sets = [{k: torch.randn(p.shape, generator=g) for k, p in params.items()} for _ in range(2)]
    numel = sum(p.numel() for p in params.values())
    rows = []
    systems = steppers(params, threads)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(args.warmup + args.steps):  # interleaved, the order reversed every other
        if i == args.warmup:  # the garbage of building and warm-up goes before the timed steps
            gc.collect()
        for name in list(systems)[::1 if i % 2 else -1]:  # step: the machine's drift and
            t0 = time.perf_counter()                      # a system's place are shared
            systems[name][1](grad_sets[i % 2])
            times[name].append(time.perf_counter() - t0)
    for name in systems:
        s = statistics.median(times[name][args.warmup:])
        rows.append({"layout": layout, "system": name, "leaves": len(shapes), "numel": numel,
                     "step_s": s, "gelems": numel / s / 1e9})
    ref = systems["torch fused"][0]
    for row, (mine, _) in zip(rows, systems.values()):
        pairs = [(mine[k].detach(), ref[k].detach()) for k in ref]
        row["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in pairs)
        row["allclose"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=50_000_000, help="fp32 params per layout")
    ap.add_argument("--layouts", default="flat,gpt")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch and executor threads; 0: physical cores")
    ap.add_argument("--smoke", action="store_true", help="2 M params, 1+2 steps (sets the options)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        args.numel, args.steps, args.warmup = 2_000_000, 2, 1
    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)
    layouts = {"flat": flat_shapes, "gpt": gpt_shapes}
    rows = [r for name in args.layouts.split(",")
            for r in run(name, layouts[name](args.numel), args, threads)]
    print(f"\nCPU loop, fp32 params in host memory, {threads} threads, median of {args.steps} steps "
          f"after {args.warmup}")
    print(f"{'layout':<6} {'leaves':>6} {'params':>12} {'system':<14} {'step s':>8} {'G elem/s':>9} "
          f"{'x fused':>8} {'max |diff|':>11} {'allclose':>8}")
    for r in rows:
        ref = next(t["step_s"] for t in rows if t["layout"] == r["layout"] and t["system"] == "torch fused")
        print(f"{r['layout']:<6} {r['leaves']:>6} {r['numel']:>12,} {r['system']:<14} {r['step_s']:>8.4f} "
              f"{r['gelems']:>9.3f} {r['step_s'] / ref:>8.2f} {r['max_abs_diff']:>11.2e} "
              f"{'yes' if r['allclose'] else 'NO':>8}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
