"""CPU AdamW kernel throughput (G elements/s): ours against DeepSpeed's CPUAdam and torch.

    python benchmarks/cpu_kernel.py --numel 268435456 --threads 16

Ours: the native one-pass kernel (bf16 grad in; fp32 value, mu, nu; bf16 param out), run by
``threads`` workers in one native queue as the executor runs it; in place, and writing the new
state to second buffers as a speculative streamed step does. Torch: ``torch.optim.AdamW(fused=True)``
on fp32 CPU tensors (fp32 grad, no bf16 output). DeepSpeed: ``DeepSpeedCPUAdam`` on fp32 CPU
tensors, when installed. Each is the median of ``--reps`` steps after a warm-up.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from host_floor import median_time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 28)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    from functional_offload.executor import physical_cores
    from functional_offload.kernels import native
    from functional_offload.kernels.work import Piece, Work
    from functional_offload.optimizers.adam import AdamHyper, scalars

    n = args.numel
    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)
    rows = {}

    mod = native.module()
    p = torch.randn(n)
    g = torch.randn(n).to(torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, 10, True)
    pool = cf.ThreadPoolExecutor(threads)

    kernel = native.NativeKernel(mod, "adam", scalars, (True, False))

    def run_chunks(outs, targets=()):  # as the executor runs: `threads` workers in one queue's loop
        q = kernel.queue(threads)
        loops = [pool.submit(q.work, i) for i in range(threads)]
        for c, o in outs:
            part = slice(c, c + len(o))
            q.ready(q.add(Work([Piece(g[part], (p[part], m[part], v[part]), o, h,
                                      tuple(t[part] for t in targets))], block)))
        q.close()
        for f in loops:
            f.result()

    chunk = 16 << 20  # elements: a 32 MiB chunk of bf16 grads
    block = max(1 << 14, -(-chunk // (4 * threads)))
    rows["ours (bf16 g in, bf16 p out)"] = n / median_time(
        lambda: run_chunks([(c, out[c:c + chunk]) for c in range(0, n, chunk)]), args.reps) / 1e9
    # As in the executor: the bf16 output goes to a reused staging slot, not a fresh array.
    slot = torch.empty(min(n, chunk), dtype=torch.bfloat16)
    rows["ours (bf16 p out to a 32 MiB slot)"] = n / median_time(
        lambda: run_chunks([(c, slot[:min(chunk, n - c)]) for c in range(0, n, chunk)]), args.reps) / 1e9
    # A speculative step (clipping streamed): the new state goes to second buffers.
    spare = [torch.empty(n) for _ in range(3)]
    rows["ours, new state to second buffers"] = n / median_time(
        lambda: run_chunks([(c, slot[:min(chunk, n - c)]) for c in range(0, n, chunk)], spare),
        args.reps) / 1e9
    p = g = m = v = out = slot = spare = None  # free 7 GiB before the next kernel

    pt = torch.randn(n, requires_grad=True)
    pt.grad = torch.randn(n)
    opt = torch.optim.AdamW([pt], lr=1e-3, weight_decay=0.1, fused=True)
    rows["torch fused AdamW (fp32)"] = n / median_time(opt.step, args.reps) / 1e9
    del opt, pt

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        pd = torch.randn(n, requires_grad=True)
        pd.grad = torch.randn(n)
        ds = DeepSpeedCPUAdam([pd], lr=1e-3, weight_decay=0.1, adamw_mode=True)
        rows["DeepSpeed CPUAdam (fp32)"] = n / median_time(ds.step, args.reps) / 1e9
    except Exception as e:  # noqa: BLE001
        rows["DeepSpeed CPUAdam (fp32)"] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"

    print(f"\nCPU AdamW, {n:,} elements, {threads} threads (G elements/s)")
    for k, val in rows.items():
        print(f"{k:<32} {val:.2f}" if isinstance(val, float) else f"{k:<32} {val}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"numel": n, "threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
