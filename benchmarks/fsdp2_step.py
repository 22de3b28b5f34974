"""FSDP2 training step of the GPT model (``gpt.py``): torch's optimizers and FSDP2's own CPU offload
against ours on the same sharded model, each system in a fresh ``torchrun``; the host floor is
measured in the same run.

    python benchmarks/fsdp2_step.py --nproc 2 --size 1.3b --tokens 16384 --out fsdp.json
    python benchmarks/fsdp2_step.py --nproc 2 --size 125m --check          # ours == torch AdamW?
    torchrun --nproc_per_node=2 benchmarks/fsdp2_step.py --one plain:1 --size 1.3b   # one system
    python benchmarks/fsdp2_step.py --smoke        # 2 CPU processes (gloo), tiny model, + --check

``fully_shard`` on each block, then on the root; ``--tokens`` per rank (each rank its own random
tokens). The process group is ``cpu:gloo,cuda:nccl`` on GPUs (clipping FSDP2's CPU-offloaded
DTensor grads needs a CPU backend), ``gloo`` with ``--device cpu``. Systems:
  ``fwdbwd``       forward + backward only (bf16 params).
  ``gpu``          bf16 sharded params, torch ``AdamW(fused=True)``, no master.
  ``gpu32``        fp32 sharded params (the masters) with ``MixedPrecisionPolicy(param_dtype=bf16,
                   reduce_dtype=fp32)``, torch fused AdamW on the GPU.
  ``cpuoffload``   the same with ``CPUOffloadPolicy()``: fp32 params, grads and AdamW on the CPU.
  ``plain:F``, ``stream:F``, ``delayed:F`` (and ``stream16:F``, ``delayed16:F``: bf16 moments)
                   ours (``ours.py``) on bf16 sharded params: each rank's local shards, fp32
                   masters and moments, fraction F of them in host memory.
Clipping at 1.0 everywhere (torch: ``clip_grad_norm_`` on the DTensor grads; ours:
``fo.clip_by_global_norm(1.0)`` in front); ``--no-clip`` turns it off. Each rank's host work
gets ``physical cores / local ranks`` threads (``--threads``): the host is shared.

Reported: per-rank step medians, the slowest rank's median and mean wall (all timed steps, the
final flush and a device sync included), the largest per-rank peak GPU memory and its part above
the rank's GPU-resident params, pinned host bytes summed over ranks. Floor = offloaded params of
all ranks / the kernel rate of the whole host (``host_floor.py``, one process, all cores).

``--check`` (the ``check`` system) builds the model twice in fp32 without mixed precision and runs
3 steps of torch ``AdamW`` (with ``clip_grad_norm_``) and of ours (``plain`` and ``stream``,
fraction ``--check-fraction``) on the same batches; it prints, per step, the global grad norm
from ``fo.global_norm``, from ``clip_grad_norm_`` and from the full (gathered) grads, and the
largest parameter difference over all ranks after the 3 steps; ``ok`` when the norms agree to
1e-5 and the parameters to 1e-6 (a step that updated nothing differs by about 3·lr = 3e-4).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

import gpt
import host_floor
from ours import HYPER, MOMENTS, build_ours, fo, moments_of
from functional_offload.executor import physical_cores

OURS = ("plain", "stream", "delayed", "stream16", "delayed16")
DEFAULT = "fwdbwd,gpu,gpu32,cpuoffload,plain:1,stream:1,delayed:1"
SMOKE = "fwdbwd,gpu,gpu32,cpuoffload,plain:1,stream:0.5,delayed:1,check"
NORM_TOL, PARAM_TOL = 1e-5, 1e-6  # check: relative grad-norm error, parameter difference (fp32)
LossFn = Callable[[], torch.Tensor]
Step = Callable[[LossFn], None]


def setup(args: argparse.Namespace) -> tuple[torch.device, object]:
    """Init the process group for this torchrun rank; ``(device, mesh)``."""
    from torch.distributed.device_mesh import init_device_mesh

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    threads = args.threads or max(1, physical_cores() // int(os.environ["LOCAL_WORLD_SIZE"]))
    torch.set_num_threads(threads)
    args.threads = threads
    return device, init_device_mesh(device.type, (dist.get_world_size(),))


def sharded(args: argparse.Namespace, device: torch.device, mesh: object, kind: str) -> torch.nn.Module:
    """The GPT model with ``fully_shard`` on each block and the root. ``kind``: ``bf16`` (bf16
    params; fp32 on the CPU), ``mixed`` (fp32 params, bf16 compute, fp32 reduce), ``offload``
    (``mixed`` with ``CPUOffloadPolicy``) or ``fp32``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    low = kind == "bf16" and device.type == "cuda"
    model = gpt.build(args.size, device, torch.bfloat16 if low else torch.float32)
    kw: dict = {"mesh": mesh}
    if kind in ("mixed", "offload") and device.type == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if kind == "offload":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def system(name: str, frac: float, args: argparse.Namespace, device: torch.device, mesh: object,
           info: dict) -> tuple[torch.nn.Module, Step, Callable[[], None]]:
    """``(model, step, flush)`` for a system; fills ``info`` (offloaded elements of this rank, ...)."""
    kind = {"gpu32": "mixed", "cpuoffload": "offload"}.get(name, "bf16")
    model = sharded(args, device, mesh, kind)
    ps = list(model.parameters())
    clip = not args.no_clip
    info.update(clip="yes" if clip else "no", offloaded=0)

    def zero() -> None:
        for p in ps:
            p.grad = None

    if name == "fwdbwd":
        info["clip"] = "-"

        def step(loss_fn: LossFn) -> None:
            loss_fn().backward()
            zero()
        return model, step, lambda: None
    if name in ("gpu", "gpu32", "cpuoffload"):
        opt = torch.optim.AdamW(ps, fused=True, **HYPER)
        if name == "cpuoffload":
            info["offloaded"] = sum(local(p).numel() for p in ps)

        def step(loss_fn: LossFn) -> None:
            loss_fn().backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(ps, 1.0)
            opt.step()
            zero()
        return model, step, lambda: None
    if name in OURS:
        m = moments_of(name)
        ours = build_ours(name.removesuffix(m), dict(model.named_parameters()), frac, clip=1.0 if clip else None,
                          moments=MOMENTS[m], threads=args.threads)
        info.update(offloaded=ours.offloaded, host_state_gib=ours.host_state_bytes / 2**30)
        return model, ours.step, ours.flush
    raise SystemExit(f"unknown system {name!r}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_system(spec: str, args: argparse.Namespace, device: torch.device, mesh: object) -> dict:
    """This rank's row for ``spec``."""
    name, _, frac = spec.partition(":")
    info: dict = {"threads": args.threads}
    model, step, flush = system(name, float(frac or 0), args, device, mesh, info)
    inputs, targets = gpt.batch(gpt.config(args.size), args.tokens, device, seed=1 + dist.get_rank())

    def loss_fn() -> torch.Tensor:
        return gpt.loss(model, inputs, targets)

    for _ in range(args.warmup):
        step(loss_fn)
    flush()
    sync(device)
    gc.collect()  # the building's and warm-up's garbage goes before the timed steps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    times = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(loss_fn)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        times.append(time.perf_counter() - t0)
    flush()
    sync(device)
    info.update(mean_s=(time.perf_counter() - start) / args.steps, step_s=statistics.median(times))
    if device.type == "cuda":
        on_gpu = sum(local(p).numel() * p.element_size() for p in model.parameters() if p.is_cuda)
        peak = torch.cuda.max_memory_allocated(device)
        info.update(peak_gib=peak / 2**30, peak_extra_gib=(peak - on_gpu) / 2**30,
                    pinned_bytes=torch.cuda.host_memory_stats().get("allocated_bytes.current"))
    return info


def check(args: argparse.Namespace, device: torch.device, mesh: object) -> dict:
    """Ours (plain, stream) against torch AdamW + clip_grad_norm_ on fp32 FSDP2 models: grad
    norms per step and the largest parameter difference after 3 steps (all ranks)."""
    from torch.distributed.tensor import DTensor

    def value(t: torch.Tensor) -> float:
        return float(t.full_tensor() if isinstance(t, DTensor) else t)

    clip = not args.no_clip
    out: dict = {"clip": clip, "fraction": args.check_fraction, "modes": {}}
    for mode in ("plain", "stream"):
        ref = sharded(args, device, mesh, "fp32")
        mine = sharded(args, device, mesh, "fp32")
        opt = torch.optim.AdamW(ref.parameters(), **HYPER)
        ours = build_ours(mode, dict(mine.named_parameters()), args.check_fraction, clip=1.0 if clip else None,
                          threads=args.threads)
        norms = []
        for i in range(3):
            batch = gpt.batch(mine.cfg, args.tokens, device, seed=100 * i + 1 + dist.get_rank())
            gpt.loss(ref, *batch).backward()
            grads = {k: p.grad for k, p in ref.named_parameters()}
            full = math.sqrt(sum(float(g.full_tensor().double().square().sum()) for g in grads.values()))
            mine_norm = value(fo.global_norm(grads))
            torch_norm = value(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0 if clip else math.inf))
            norms.append({"fo": mine_norm, "torch": torch_norm, "full": full})
            opt.step()
            opt.zero_grad()
            ours.step(lambda: gpt.loss(mine, *batch))
        ours.flush()
        sync(device)
        diff = torch.tensor(max(float((local(a) - local(b)).detach().abs().max())
                                for a, b in zip(ref.parameters(), mine.parameters())))
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        out["modes"][mode] = {"norms": norms, "max_param_diff": float(diff),
                              "offloaded": ours.offloaded}
    return out


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: run ``args.one``; rank 0 prints the gathered result."""
    device, mesh = setup(args)
    try:
        if args.one == "check":
            row = {"system": "check", **check(args, device, mesh)}
        else:
            mine = run_system(args.one, args, device, mesh)
            ranks: list = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            row = {"system": args.one, "ranks": ranks, "clip": mine["clip"],
                   "step_s": max(r["step_s"] for r in ranks), "mean_s": max(r["mean_s"] for r in ranks),
                   "offloaded": sum(r["offloaded"] for r in ranks)}
            if device.type == "cuda":
                row.update(peak_gib=max(r["peak_gib"] for r in ranks),
                           peak_extra_gib=max(r["peak_extra_gib"] for r in ranks),
                           pinned_bytes=sum(r["pinned_bytes"] or 0 for r in ranks))
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N``: torchrun would take ``--nproc`` as an ambiguous prefix of its
    own ``--nproc-per-node`` and refuse to start (the ranks read their count from torchrun)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(spec: str, args: argparse.Namespace) -> dict:
    """Run ``spec`` in a fresh torchrun (the floor: in a fresh plain process); its row."""
    me = [os.path.abspath(__file__), *without_nproc(sys.argv[1:]), "--one", spec]
    if spec == "floor":
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", *me]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if line:
        return json.loads(line[-1][7:])
    # rank 0's traceback, not torchrun's summary of it
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank0]:")] or proc.stderr.splitlines()
    return {"system": spec, "error": "\n".join(err[-12:])}


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    nan = math.nan
    fl = next((r for r in rows if r["system"] == "floor" and "kernel_gelems" in r), None)
    fb = next((r for r in rows if r["system"] == "fwdbwd" and "mean_s" in r), None)
    gpu = next((r for r in rows if r["system"] == "gpu" and "mean_s" in r), None)
    out = [f"\nFSDP2 GPT {args.size}, {args.nproc} ranks, {args.tokens} tokens per rank, device "
           f"{args.device}; median of {args.steps} steps after {args.warmup}; ratios use the mean wall time"]
    if fl:
        out.append(f"host: kernel {fl['kernel_gelems']:.2f} G elem/s (bf16 moments "
                   f"{fl['kernel16_gelems']:.2f}), {fl['threads']} threads; DRAM copy "
                   f"{fl['copy_gbs']:.1f} GB/s, triad {fl['triad_gbs']:.1f} GB/s")
    out.append(f"{'system':<12} {'clip':>4} {'rank steps s':>16} {'step s':>7} {'mean s':>7} {'x gpu':>6} "
               f"{'x fb':>6} {'floor s':>8} {'ovh/flr':>7} {'peak GiB':>9} {'extra':>6} {'pin MiB':>8}")
    for r in rows:
        if r["system"] in ("floor", "check"):
            continue
        if "mean_s" not in r:
            out.append(f"{r['system']:<12} error: {r.get('error', '')[-300:]!r}")
            continue
        name = r["system"].partition(":")[0]
        rate = (fl or {}).get("kernel16_gelems" if name.endswith("16") else "kernel_gelems")
        floor = r["offloaded"] / (rate * 1e9) if rate and r["offloaded"] else nan
        ovh = (r["mean_s"] - fb["mean_s"]) / floor if fb else nan
        pin = f"{r['pinned_bytes'] / 2**20:.0f}" if "pinned_bytes" in r else "-"
        per_rank = "/".join(f"{x['step_s']:.3f}" for x in r["ranks"])
        out.append(f"{r['system']:<12} {r['clip']:>4} {per_rank:>16} {r['step_s']:>7.3f} {r['mean_s']:>7.3f} "
                   f"{r['mean_s'] / gpu['mean_s'] if gpu else nan:>6.2f} "
                   f"{r['mean_s'] / fb['mean_s'] if fb else nan:>6.2f} {floor:>8.3f} {ovh:>7.2f} "
                   f"{r.get('peak_gib', nan):>9.2f} {r.get('peak_extra_gib', nan):>6.2f} {pin:>8}")
    out.append("x gpu / x fb = mean over gpu's / fwdbwd's mean; ovh/flr = (mean - fwdbwd mean) / floor")
    for r in rows:
        if r["system"] == "check" and "modes" in r:
            out.append(f"\ncheck: 3 steps, fp32, ours fraction {r['fraction']}, clip {r['clip']} "
                       f"(grad norms per step: fo.global_norm / clip_grad_norm_ / full grads)")
            for mode, m in r["modes"].items():
                norms = "  ".join(f"{n['fo']:.6g}/{n['torch']:.6g}/{n['full']:.6g}" for n in m["norms"])
                rel = max(abs(n["fo"] - n["full"]) / n["full"] for n in m["norms"])
                ok = rel < NORM_TOL and m["max_param_diff"] < PARAM_TOL
                out.append(f"{mode:<7} norms {norms}  (fo vs full: {rel:.1e})  max |param diff| "
                           f"{m['max_param_diff']:.2e}  {'ok' if ok else 'MISMATCH'}")
        elif r["system"] == "check":
            out.append(f"\ncheck failed: {r.get('error', '')[-600:]}")
    return out


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    ap.add_argument("--size", default="1.3b", help="GPT size (gpt.py)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank per step")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--systems", default=DEFAULT)
    ap.add_argument("--check", action="store_true", help="run only the check (see above)")
    ap.add_argument("--check-fraction", type=float, default=0.5)
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="host threads per rank; 0: cores / local ranks")
    ap.add_argument("--floor-max-numel", type=int, default=1 << 31)
    ap.add_argument("--dram-numel", type=int, default=1 << 28)
    ap.add_argument("--smoke", action="store_true",
                    help="2 CPU ranks (gloo), tiny model, 1+2 steps, with the check (sets the options)")
    ap.add_argument("--one", help="(under torchrun) run one system; 'floor' runs without torchrun")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        args.nproc, args.size, args.tokens, args.device = 2, "tiny", 128, "cpu"
        args.warmup, args.steps, args.dram_numel = 1, 2, 1 << 20
        if args.systems == DEFAULT:
            args.systems = SMOKE
    return args


def main() -> None:
    args = parse()
    if args.one == "floor":
        shapes = host_floor.leaf_shapes(args.size, args.floor_max_numel)
        floor = host_floor.measure(shapes, 0, 3, args.dram_numel)
        print("RESULT " + json.dumps({"system": "floor", **floor}))
        return
    if args.one:
        worker(args)
        return
    specs = ["check"] if args.check else ["floor", *args.systems.split(",")]
    rows = []
    for spec in specs:
        rows.append(launch(spec, args))
        print(json.dumps(rows[-1]), flush=True)
    print("\n".join(table(rows, args)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
