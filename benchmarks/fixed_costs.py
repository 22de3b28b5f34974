"""Fixed cost per update with many small leaves: ours (state on the device / on the host) against
torch's fused AdamW, each system and leaf count in a fresh process.

    python benchmarks/fixed_costs.py --out fixed.json                 # 4, 64, 292 leaves x 256
    python benchmarks/fixed_costs.py --leaves 292 --numel 4096 --dtype float32
    python benchmarks/fixed_costs.py --clip                           # clipping at 1.0 first, both
    python benchmarks/fixed_costs.py --smoke                          # on the CPU, few updates
    python benchmarks/fixed_costs.py --layout gpt                     # a 24-layer GPT's 292 leaves
    python benchmarks/fixed_costs.py --layout gpt --width 2048 --systems torch,device,devicete,fusedadam

Leaves of ``--numel`` elements (``--layout gpt``: the 292 leaves of a 24-layer GPT-style
decoder of width 32, 310 k elements, shaped as its params) on ``--device`` (a GPU by default)
in ``--dtype`` (bf16 by default: ours then keeps fp32
masters, torch updates the bf16 params directly), fixed random grads, no forward or backward.
Systems: ``torch`` (``torch.optim.AdamW(fused=True)``, grads set on the params), ``device``
(``fo.adamw(placement=on_device())``), ``host`` (``fo.adamw(placement=on_host())``: D2H, CPU
kernel, H2D per update), ``delayed`` (the same with ``delayed=fo.Delay(lookahead=False, warmup=0,
exact_when_clipped=False)``: the host part runs in the background, landed by the next update;
the landed step's form) and ``lookahead`` (the same with the look-ahead: ``delayed=True``'s
steady state); ``devicete`` (``device`` with ``device_kernel="te"``: TransformerEngine's fused
Adam) and ``fusedadam`` (TransformerEngine's ``FusedAdam(master_weights=True)``), where
TransformerEngine imports. ``--width`` sets the GPT layout's width (1.2 B params at 2048). After ``--warmup`` updates: ``mean ms`` = wall time of ``--updates`` back-to-back
updates with one flush and sync at the end, divided by their number; ``median ms`` = the median
of as many updates each followed by a sync (a delayed one's host part may still run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

import gpt
from ours import HYPER, fo

SYSTEMS = ("torch", "device", "host", "delayed", "lookahead", "devicete", "fusedadam")


def updater(system: str, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
            clip: bool = False) -> tuple[Callable[[], None], Callable[[], None]]:
    """One update of ``params`` with ``grads`` by ``system``, and what lands the last one;
    ``clip``: gradient clipping at 1.0 first (torch: ``clip_grad_norm_``; ours:
    ``clip_by_global_norm`` chained in front)."""
    if system in ("torch", "fusedadam"):
        for k, p in params.items():
            p.requires_grad_(True).grad = grads[k]
        if system == "torch":
            opt = torch.optim.AdamW(list(params.values()), fused=True, **HYPER)
        else:
            from transformer_engine.pytorch.optimizers import FusedAdam
            opt = FusedAdam(list(params.values()), master_weights=True, **HYPER)
        if not clip:
            return opt.step, lambda: None

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            opt.step()
        return step, lambda: None
    if system not in SYSTEMS:
        raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    where = (fo.placement.on_device() if system in ("device", "devicete")
             else fo.placement.on_host())
    delayed = (fo.Delay(lookahead=system == "lookahead", warmup=0, exact_when_clipped=False)
               if system in ("delayed", "lookahead") else False)
    opt = fo.adamw(placement=where, delayed=delayed,
                   device_kernel="te" if system == "devicete" else "torch", **HYPER)
    if clip:
        opt = fo.chain(fo.clip_by_global_norm(1.0), opt)
    holder = [opt.init(params)]

    def update() -> None:
        _, holder[0] = opt.update(grads, holder[0])

    def flush() -> None:
        holder[0] = fo.flush(holder[0])
    return update, flush


def gpt_shapes(width: int = 32) -> dict[str, tuple[int, ...]]:
    """The param shapes of a 24-layer GPT-style decoder of ``width`` (292 leaves)."""
    model = gpt.build(gpt.GPTConfig(d=width, layers=24, heads=2, vocab=128, ctx=16), "meta")
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


def run_one(system: str, leaves: int, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    shapes = gpt_shapes(args.width) if args.layout == "gpt" else {f"p{i}": (args.numel,) for i in range(leaves)}
    params = {k: torch.randn(s, device=device, generator=g).to(dtype) for k, s in shapes.items()}
    grads = {k: torch.randn(s, device=device, generator=g).to(dtype) for k, s in shapes.items()}
    update, flush = updater(system, params, grads, args.clip)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        update()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.updates):
        update()
    flush()
    sync()
    mean = (time.perf_counter() - t0) / args.updates
    each = []
    for _ in range(args.updates):
        t0 = time.perf_counter()
        update()
        sync()
        each.append(time.perf_counter() - t0)
    return {"system": system, "leaves": leaves, "mean_ms": 1e3 * mean,
            "median_ms": 1e3 * statistics.median(each)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", default="4,64,292", help="leaf counts, comma-separated")
    ap.add_argument("--numel", type=int, default=256, help="elements per leaf")
    ap.add_argument("--layout", choices=["flat", "gpt"], default="flat",
                    help="gpt: a 24-layer GPT's leaves (292, in place of --leaves)")
    ap.add_argument("--width", type=int, default=32, help="the gpt layout's width")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clip", action="store_true", help="clip gradients at norm 1.0 first")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, 5 updates (sets the options)")
    ap.add_argument("--one", help="SYSTEM:LEAVES, run in this process and print its JSON")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.updates, args.warmup = "cpu", 5, 1
    if args.one:
        system, _, leaves = args.one.partition(":")
        print("RESULT " + json.dumps(run_one(system, int(leaves), args)), flush=True)
        return
    rows = []
    counts = [len(gpt_shapes())] if args.layout == "gpt" else [int(n) for n in args.leaves.split(",")]
    for leaves in counts:
        for system in args.systems.split(","):
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                                   "--one", f"{system}:{leaves}"], capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = (json.loads(line[-1][7:]) if line
                   else {"system": system, "leaves": leaves, "error": proc.stderr[-800:]})
            rows.append(row)
            print(json.dumps(row), flush=True)
    clipped = " with clipping" if args.clip else ""
    what = (f"a 24-layer GPT's leaves (width {args.width})" if args.layout == "gpt"
            else f"leaves of {args.numel} elements")
    print(f"\nfixed cost per update{clipped}, {what} in {args.dtype} on {args.device} "
          f"({args.updates} updates; ratio: mean over torch's, where torch ran)")
    print(f"{'system':<8} {'leaves':>6} {'mean ms':>8} {'median ms':>10} {'x torch':>8}")
    for r in rows:
        if "mean_ms" not in r:
            print(f"{r['system']:<8} {r['leaves']:>6} error: {r['error'][-200:]!r}")
            continue
        ref = next((t["mean_ms"] for t in rows if t["system"] == "torch" and t["leaves"] == r["leaves"]
                    and "mean_ms" in t), None)
        ratio = f"{r['mean_ms'] / ref:>8.2f}" if ref else f"{'—':>8}"
        print(f"{r['system']:<8} {r['leaves']:>6} {r['mean_ms']:>8.3f} {r['median_ms']:>10.3f} {ratio}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
