"""E2E step time with host-resident optimizer state, side by side with the anchors.

The model is DESIGN §3's: ``blocks`` residual blocks ``x -> x + W2·gelu(W1·x)``, bias-free,
bf16, loss ``mean(out²)``. Each system runs in a fresh process (host memory and allocator state
do not leak between systems); the driver prints a table and writes JSON.

    python benchmarks/offload_step.py --tokens 16384 --out results.json
    python benchmarks/offload_step.py --one ours:0.5 --tokens 16384      # a single system

Systems: ``gpu`` (torch fused AdamW on bf16 params, no master), ``fwdbwd`` (no optimizer: the
forward+backward time subtracted to get optimizer overhead), ``ours:F`` (fo.adamw with
offload_fraction F), ``hdo:F`` (Megatron's HybridDeviceOptimizer, overlap on, fp32 update),
``delayed:F`` (ours with the delayed parameter update), ``delayed16:F`` (the same with bf16
moments; fp32 masters kept), ``stream:F`` / ``stream16:F`` (grad streaming during backward, fp32 /
bf16 moments), ``streamtail:F`` (streaming with ``offload_fraction(F, from_end=True)``: the first
layers, whose grads come last, keep their state on the GPU), ``clip:F`` / ``streamclip:F``
(``apply_if_finite(chain(clip_by_global_norm(1.0), adamw))``, through ``update`` / through
``fo.stream``, which runs that update after backward), ``torchao`` (CPUOffloadOptimizer,
fused AdamW, bf16 states). A ``@spin`` suffix (e.g. ``stream:1@spin``) makes our workers wait on
default CUDA events, which spin, instead of blocking-sync ones (an A/B of that choice). Missing
peers are reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def build(d: int, ffn: int, blocks: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = []
    for _ in range(blocks):
        for shape in ((ffn, d), (d, ffn)):
            w = torch.randn(shape, device="cuda", generator=g, dtype=torch.float32) / shape[1] ** 0.5
            ps.append(w.to(torch.bfloat16).requires_grad_())
    return ps


def loss_fn(ps: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for w1, w2 in zip(ps[0::2], ps[1::2]):
        x = x + torch.nn.functional.gelu(x @ w1.t()) @ w2.t()
    return x.float().square().mean()


def run_one(system: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    ps = build(args.d, args.ffn, args.blocks)
    model_bytes = sum(p.numel() * p.element_size() for p in ps)
    x = torch.randn(args.tokens, args.d, device="cuda", dtype=torch.bfloat16)
    info: dict = {"system": system}
    system_name, _, variant = system.partition("@")
    spin = variant == "spin"
    name, _, frac = system_name.partition(":")
    pinned = timeline = None
    if name == "fwdbwd":
        def step():
            loss_fn(ps, x).backward()
            for p in ps:
                p.grad = None
    elif name == "gpu":
        opt = torch.optim.AdamW(ps, fused=True, **HYPER)

        def step():
            loss_fn(ps, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif name in ("ours", "delayed", "delayed16", "stream", "stream16", "streamtail", "clip",
                  "streamclip"):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import functional_offload as fo
        from functional_offload.executor import HostExecutor, Timeline, physical_cores
        from functional_offload.executor.transport import CudaTransport

        if spin:  # A/B: the workers wait on default (spinning) CUDA events
            CudaTransport._record = staticmethod(lambda stream: stream.record_event())

        timeline = Timeline() if args.timeline else None
        threads = args.threads or (  # as fo.adamw(delayed=True) picks by default
            max(1, physical_cores() - 1) if name.startswith("delayed") else None)
        ex = HostExecutor(chunk_bytes=args.chunk_mb << 20, slots=args.slots, threads=threads,
                          timeline=timeline)
        low = dict(mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16) if name.endswith("16") else {}
        where = fo.placement.offload_fraction(float(frac), from_end=name.endswith("tail"))
        opt = fo.adamw(placement=where, executor=ex,
                       delayed=name.startswith("delayed"), **low, **HYPER)
        if name.endswith("clip"):  # what LLM loops run: the guard around clipping
            opt = fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), opt))
        tree = {str(i): p for i, p in enumerate(ps)}
        state = opt.init(tree)
        holder = [state]
        info["threads"] = ex.threads

        def step():
            loss = loss_fn(ps, x)
            if name.startswith("stream"):
                with fo.stream(opt, holder[0]) as s:
                    loss.backward()
                _, holder[0] = s.finish()
            else:
                loss.backward()
                _, holder[0] = opt.update({k: p.grad for k, p in tree.items()}, holder[0])
            for p in ps:
                p.grad = None
        pinned = lambda: ex.pinned_bytes  # noqa: E731
    elif name == "hdo":
        try:
            from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
        except Exception as e:  # noqa: BLE001
            return {"system": system, "error": f"megatron-core unavailable: {e}"}
        opt = HybridDeviceOptimizer(ps, offload_fraction=float(frac), cpu_optimizer_cls=torch.optim.AdamW,
                                    gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                                    overlap_cpu_optimizer_d2h_h2d=True, fused=True, **HYPER)

        def step():
            loss_fn(ps, x).backward()
            opt.step()
            opt.zero_grad()
    elif name == "torchao":
        try:
            from torchao.optim import CPUOffloadOptimizer
        except Exception as e:  # noqa: BLE001
            return {"system": system, "error": f"torchao unavailable: {e}"}
        opt = CPUOffloadOptimizer(ps, torch.optim.AdamW, fused=True, **HYPER)

        def step():
            loss_fn(ps, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        raise SystemExit(f"unknown system {system}")

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # Per step: until the training stream's work is done (what a loop reading the loss waits
    # for; background copies of a delayed step still running are not waited on). Over all steps:
    # wall time with a device-wide sync at the end, so nothing is left out of the mean.
    times = []
    stream = torch.cuda.current_stream()
    start = time.perf_counter()
    for i in range(args.steps):
        if timeline is not None and i == args.steps - 1:
            timeline.clear()  # keep the last step only
        t0 = time.perf_counter()
        step()
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    info["mean_wall_s"] = (time.perf_counter() - start) / args.steps
    if name == "fwdbwd":  # forward alone, for the streamed target fwd + max(bwd, floor)
        fwd = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            with torch.no_grad():
                loss_fn(ps, x)
            torch.cuda.synchronize()
            fwd.append(time.perf_counter() - t0)
        info["fwd_s"] = statistics.median(fwd)
    info.update(step_s=statistics.median(times), step_min_s=min(times),
                peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                peak_extra_gib=(torch.cuda.max_memory_allocated() - model_bytes) / 2**30,
                params=sum(p.numel() for p in ps), pinned_bytes=pinned() if pinned else None)
    if timeline is not None:
        os.makedirs(args.timeline, exist_ok=True)
        stem = os.path.join(args.timeline, "timeline_" + system.replace(":", "-"))
        timeline.to_chrome(stem + ".json")
        timeline.plot(stem + ".png", title=f"{system}, {args.tokens} tokens: one update (last step)")
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=16384)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk-mb", type=int, default=32)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--kernel-gelems", type=float, default=4.0,
                    help="CPU-kernel throughput (G elem/s) for the floor column; see cpu_kernel.py")
    ap.add_argument("--systems", default="fwdbwd,gpu,ours:0,ours:0.25,ours:0.5,ours:0.75,ours:1,"
                                         "hdo:0.5,hdo:1,torchao")
    ap.add_argument("--timeline", default="", help="folder for a Chrome trace and PNG per ours:F system")
    ap.add_argument("--one", help="run one system in this process and print its JSON")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    rows = []
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("d", "ffn", "blocks", "tokens", "warmup", "steps", "chunk_mb", "slots", "threads",
                        "timeline")]
    for system in args.systems.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", system, *common]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(line[-1][7:]) if line else {"system": system, "error": proc.stderr[-800:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    fb = next((r["step_s"] for r in rows if r["system"] == "fwdbwd" and "step_s" in r), None)
    fwd = next((r["fwd_s"] for r in rows if "fwd_s" in r), None)
    if fwd is not None:
        print(f"\nforward {fwd:.3f} s, backward {fb - fwd:.3f} s (no-grad forward, from fwdbwd)")
    print(f"\nE2E d={args.d} ffn={args.ffn} blocks={args.blocks} tokens={args.tokens} "
          f"(step: median of {args.steps} steps; mean: wall / steps; overhead = step - fwd/bwd; "
          f"floor = offloaded params / "
          f"{args.kernel_gelems} G elem/s)")
    print(f"{'system':<12} {'step s':>8} {'mean s':>7} {'overhead s':>11} {'ovh/floor':>10} "
          f"{'peak GiB':>9} {'extra GiB':>10} {'pinned MiB':>11}")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['system']:<12} error: {r.get('error', '')[-200:]!r}")
            continue
        ovh = r["step_s"] - fb if fb is not None and r["system"] != "fwdbwd" else None
        name, _, frac = r["system"].partition("@")[0].partition(":")
        floor = float(frac) * r["params"] / (args.kernel_gelems * 1e9) if frac and float(frac) > 0 else None
        pin = f"{r['pinned_bytes'] / 2**20:.0f}" if r.get("pinned_bytes") is not None else "-"
        print(f"{r['system']:<12} {r['step_s']:>8.3f} {r['mean_wall_s']:>7.3f} "
              f"{ovh if ovh is not None else float('nan'):>11.3f} "
              f"{(ovh / floor) if ovh is not None and floor else float('nan'):>10.2f} "
              f"{r['peak_gib']:>9.2f} {r['peak_extra_gib']:>10.2f} {pin:>11}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
