"""The host floor of an offloaded step, measured on this machine: our CPU kernel's rate and DRAM.

    python benchmarks/host_floor.py --size 1.3b --out floor.json     # N = that model's params
    python benchmarks/host_floor.py --numel 1000000 --reps 2          # a quick one

Kernel: one ``fo.adamw(placement=on_host(), cpu_kernel="native")`` update, through the public
API, on bf16 CPU params shaped as the GPT model's leaves (or one flat leaf of ``--numel``):
bf16 grads in, fp32 master/mu/nu, bf16 params written back, run by the executor's worker
threads (default: physical cores) — the element types and the kernel of the offloaded GPU step
(CPU grads are read where they are). Measured with fp32 and with bf16 moments. Rate =
elements / median update time (G elem/s); the floor of a step is offloaded params / rate.
``--optimizers`` measures others the same way (``adamw``, ``adamw16`` (bf16 moments),
``adamw_ema`` (with ``ema_decay``), ``lion``, ``sgd`` (momentum), ``adafactor``).

DRAM: STREAM-style copy (``a.copy_(b)``, 8 B/elem) and triad (``torch.add(b, c, alpha=3,
out=a)``, 12 B/elem) on fp32 CPU tensors, GB/s, median of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from ours import HYPER, fo  # first: it puts the library to measure on the path
from functional_offload.executor import HostExecutor, physical_cores  # noqa: E402

import gpt  # noqa: E402


def median_time(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def leaf_shapes(size: str, max_numel: int) -> list[tuple[int, ...]]:
    """The model's leaf shapes in order, cut off once ``max_numel`` elements are reached."""
    shapes, total = [], 0
    for p in gpt.build(size, "meta").parameters():
        if total >= max_numel:
            break
        shapes.append(tuple(p.shape))
        total += p.numel()
    return shapes


OPTIMIZERS: dict[str, Callable[..., fo.Optimizer]] = {
    "adamw": lambda **kw: fo.adamw(cpu_kernel="native", **HYPER, **kw),
    "adamw16": lambda **kw: fo.adamw(cpu_kernel="native", mu_dtype=torch.bfloat16,
                                     nu_dtype=torch.bfloat16, **HYPER, **kw),
    "adamw8": lambda **kw: fo.adamw(cpu_kernel="native", mu_dtype=torch.uint8,
                                    nu_dtype=torch.uint8, **HYPER, **kw),
    "adamw_ema": lambda **kw: fo.adamw(cpu_kernel="native", ema_decay=0.999, **HYPER, **kw),
    "lion": lambda **kw: fo.lion(1e-5, betas=(0.9, 0.99), weight_decay=0.1, cpu_kernel="native", **kw),
    "sgd": lambda **kw: fo.sgd(1e-3, momentum=0.9, cpu_kernel="native", **kw),
    "adafactor": lambda **kw: fo.adafactor(1e-2, **kw),
}


def kernel_rate(shapes: list[tuple[int, ...]], threads: int, reps: int,
                optimizer: str = "adamw") -> float:
    """G elements/s of one host update of bf16 CPU params of ``shapes`` by ``optimizer`` (a key of
    :data:`OPTIMIZERS`)."""
    params = {str(i): torch.empty(s, dtype=torch.bfloat16).uniform_(-1, 1) for i, s in enumerate(shapes)}
    grads = {k: torch.empty_like(p).uniform_(-1e-3, 1e-3) for k, p in params.items()}
    opt = OPTIMIZERS[optimizer](placement=fo.placement.on_host(), executor=HostExecutor(threads=threads))
    holder = [opt.init(params)]

    def update() -> None:
        _, holder[0] = opt.update(grads, holder[0])

    n = sum(p.numel() for p in params.values())
    return n / median_time(update, reps) / 1e9


def dram_bandwidth(numel: int, reps: int) -> dict[str, float]:
    """GB/s of copy (8 B/elem) and triad (12 B/elem) on fp32 tensors of ``numel`` elements."""
    a, b, c = (torch.full((numel,), float(i)) for i in range(3))
    copy = median_time(lambda: a.copy_(b), reps)
    triad = median_time(lambda: torch.add(b, c, alpha=3.0, out=a), reps)
    return {"copy_gbs": 8 * numel / copy / 1e9, "triad_gbs": 12 * numel / triad / 1e9}


def measure(shapes: list[tuple[int, ...]], threads: int = 0, reps: int = 3,
            dram_numel: int = 1 << 27) -> dict:
    """The floor's inputs: kernel rates (fp32, bf16 and 8-bit moments) and DRAM bandwidth."""
    threads = threads or physical_cores()
    torch.set_num_threads(threads)
    out = {"numel": sum(torch.Size(s).numel() for s in shapes), "leaves": len(shapes),
           "threads": threads}
    out.update(dram_bandwidth(dram_numel, reps))
    out["kernel_gelems"] = kernel_rate(shapes, threads, reps)
    out["kernel16_gelems"] = kernel_rate(shapes, threads, reps, optimizer="adamw16")
    out["kernel8_gelems"] = kernel_rate(shapes, threads, reps, optimizer="adamw8")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.3b", help="GPT size whose leaves are updated (see gpt.py)")
    ap.add_argument("--numel", type=int, default=0, help="one flat leaf of this many elements instead")
    ap.add_argument("--max-numel", type=int, default=1 << 31,
                    help="cap on the elements updated (16 B/elem of host memory)")
    ap.add_argument("--threads", type=int, default=0, help="0: physical cores")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dram-numel", type=int, default=1 << 27)
    ap.add_argument("--optimizers", default="", help=f"also these: {', '.join(OPTIMIZERS)}")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [(args.numel,)] if args.numel else leaf_shapes(args.size, args.max_numel)
    r = measure(shapes, args.threads, args.reps, args.dram_numel)
    for name in filter(None, args.optimizers.split(",")):
        r[f"{name}_gelems"] = kernel_rate(shapes, r["threads"], args.reps, optimizer=name)
        print(f"{name:<34} {r[f'{name}_gelems']:>10.2f} G elem/s", flush=True)
    print(f"\nhost floor inputs: {r['numel']:,} elements in {r['leaves']} leaves, {r['threads']} threads")
    print(f"{'what':<34} {'rate':>10}")
    print(f"{'kernel, fp32 moments (G elem/s)':<34} {r['kernel_gelems']:>10.2f}")
    print(f"{'kernel, bf16 moments (G elem/s)':<34} {r['kernel16_gelems']:>10.2f}")
    print(f"{'kernel, 8-bit moments (G elem/s)':<34} {r['kernel8_gelems']:>10.2f}")
    print(f"{'DRAM copy (GB/s)':<34} {r['copy_gbs']:>10.1f}")
    print(f"{'DRAM triad (GB/s)':<34} {r['triad_gbs']:>10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **r}, f, indent=1)


if __name__ == "__main__":
    main()
