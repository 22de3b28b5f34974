"""E2E training step of the GPT model (``gpt.py``) with host-resident optimizer state, beside the
anchors and peers, each system in a fresh process; the host floor is measured in the same run.

    python benchmarks/offload_step.py --size 1.3b --tokens 16384 --out e2e.json
    python benchmarks/offload_step.py --size 1.3b --systems fwdbwd,stream:1,delayed:1   # a subset
    python benchmarks/offload_step.py --one stream:1 --size 1.3b      # one system, this process
    python benchmarks/offload_step.py --smoke                         # tiny model on the CPU
    FUNCTIONAL_OFFLOAD_PATH=../old python benchmarks/offload_step.py ...  # "ours" from another checkout

Systems (``F``: offload fraction, Megatron's semantics):
  ``fwdbwd``       forward + backward only; gives the fwd and bwd columns (timed apart).
  ``gpu``          torch ``AdamW(fused=True)`` on the bf16 params, no master.
  ``gpu32``        fp32 masters on the GPU: fp32 grads copied from the bf16 ones, torch fused
                   AdamW on the masters, params copied back.
  ``plain:F``      ours: ``loss.backward()``, then ``opt.update({path: p.grad}, state)``.
  ``stream:F``     ours with ``fo.stream`` around backward.
  ``delayed:F``    ours with ``delayed=True`` (ZeRO-Offload's delayed parameter update, with
                   the look-ahead); ``stale:F`` (``stale16``, ``stale8``, ``staler``...) the
                   same without it (``fo.Delay(lookahead=False)``: one step stale, 2 B/param
                   fewer copied up); ``land:F`` (``land16``...) that update made exact by
                   ``fo.land_before_forward``: each module's forward lands its params, so the
                   host step overlaps the next forward and nothing is stale.
  ``stream16:F`` / ``delayed16:F``   the same with bf16 moments (fp32 masters kept); ``...8:F``
                   (``plain8``, ``stream8``, ``delayed8``) with block-wise 8-bit moments.
  ``plainr:F``, ``streamr:F``, ``delayedr:F`` (and ``...r16:F``, ``...r8:F``)   the same with
                   ``store_param_remainders=True`` (the exact master as the bf16 param plus an
                   int16 remainder), with fp32 (bf16, 8-bit) moments.
  ``lion:F`` / ``streamlion:F``   ``fo.lion`` (lr / 10, weight decay x 10), plain / streamed.
  ``engine:F`` / ``engine16:F``   plain, the host-resident state stepped on the GPU
                   (``HostExecutor(engine="gpu")``: the pinned state up and back in place,
                   grads and params stay in HBM), fp32 / bf16 moments (``engine8``, and
                   ``enginer``... with the split master, as for ``plain``).
  ``both:F`` / ``both16:F``   plain, the host-resident leaves divided between the GPU engine
                   and the CPU kernel, run at once (``HostExecutor(engine="both")``; the GPU's
                   share searched for over the first steps, which the warm-up runs until it
                   settles, or ``--gpu-share``); the last split in the row (``both8``,
                   ``bothr16``, ``bothr8``...: the formats, as for ``plain``).
  ``staleboth:F`` / ``landboth:F``   ``stale:F`` / ``land:F`` with both engines (the GPU
                   engine's leaves stepped on the device in the background).
  ``hdo:F``        Megatron-core's ``HybridDeviceOptimizer`` (fp32 update, D2H/H2D overlap on).
  ``torchao``      torchao's ``CPUOffloadOptimizer`` (fused AdamW; bf16 states, no master).
  ``zero``         DeepSpeed's ZeRO-Offload on one GPU (ZeRO stage 2, ``offload_optimizer`` to
                   the CPU, pinned; bf16; its CPUAdam on fp32 masters; its own clipping).
Clipping at 1.0 is on for every system (ours: ``fo.clip_by_global_norm(1.0)`` in a chain in front
of the optimizer; torch and Megatron: ``torch.nn.utils.clip_grad_norm_`` before ``step``;
DeepSpeed: its ``gradient_clipping``) except
torchao, whose CPU steps start during backward and so cannot clip: it runs unclipped, marked
``no*``. ``--no-clip`` turns clipping off everywhere. Peers that are not installed are reported
as unavailable. FSDP2's own CPU offload is in ``fsdp2_step.py``.

Reported per system: step (median, the training stream synced after each step), mean wall per
step over all timed steps including the final flush (``fo.flush(state)``) and a device sync,
peak GPU memory and its part above the bf16 model, pinned host memory (the CUDA caching host
allocator's bytes; it rounds blocks up to powers of two), host state, and the host memory a
system took per param (the process's resident set grown from before the system was built to
after its flush: state, staging and pinned buffers; the ``fwdbwd`` row gives the rest), and the
longest of the interpreter's garbage collections in the timed steps (the garbage is collected
once after the warm-up: the full collection that follows building falls there). The floor process (first,
fresh) times our CPU kernel through the public API on the model's leaf shapes and the host DRAM
bandwidth (``host_floor.py``); a system's floor = its offloaded params / the kernel rate of its
moments' format (fp32, bf16 or 8-bit moments, fp32 masters; torchao, whose CPU step is torch's
AdamW on bf16 params and states, gets the bf16-moment rate as a stand-in). Bounds: ``fwd + bwd + floor`` for plain and Megatron (host step
after backward), ``fwd + 1.1·max(bwd, floor)`` for streamed and torchao, ``1.1·max(fwd + bwd,
floor)`` for delayed, ``fwd + bwd`` for the all-on-GPU systems. Ratios use the mean wall time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

import gpt
import host_floor
from ours import HYPER, MOMENTS, Timeline, build_ours, fo, moments_of

LossFn = Callable[[], torch.Tensor]
Step = Callable[[LossFn], None]

OURS = ("lion", "streamlion",
        *(mode + r + m for mode in ("plain", "stream", "delayed", "stale", "land", "engine", "both",
                                    "staleboth", "landboth")
          for r in ("", "r")
          for m in MOMENTS))
DEFAULT = "fwdbwd,gpu,gpu32,plain:1,stream:1,delayed:1,stream16:1,delayed16:1,hdo:1,torchao"
SMOKE = "fwdbwd,gpu,gpu32,plain:1,stream:0.5,delayed:1,stale:1,delayed16:1,hdo:1,torchao"


class Unavailable(Exception):
    """A peer that is not installed, does not import here, or needs CUDA on a CPU run."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bytes(device: torch.device) -> Optional[int]:
    """Bytes the CUDA caching host allocator holds (``pin_memory=True`` tensors), or None."""
    if device.type != "cuda":
        return None
    return torch.cuda.host_memory_stats().get("allocated_bytes.current")


MAX_NORM = [1.0]  # --max-norm
SEARCHING: list[Callable[[], bool]] = []  # both:F: whether the GPU share is still searched for
SPLITS: list = []  # both:F: the split steps seen while searching (SplitStep)


def torch_clip(params: list[torch.Tensor]) -> None:
    torch.nn.utils.clip_grad_norm_(params, MAX_NORM[0], foreach=True)


def system(name: str, frac: float, model: torch.nn.Module, args: argparse.Namespace, info: dict,
           timeline: Optional[Timeline] = None) -> tuple[Step, Callable[[], None]]:
    """``(step, flush)`` for a system: ``step(loss_fn)`` runs one training step, ``flush()``
    lands whatever is still in flight. Fills ``info`` (offloaded params, clipping, ...); ours
    record into ``timeline``."""
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
        return step, lambda: None
    if name == "gpu":
        opt = torch.optim.AdamW(ps, fused=True, **HYPER)

        def step(loss_fn: LossFn) -> None:
            loss_fn().backward()
            if clip:
                torch_clip(ps)
            opt.step()
            zero()
        return step, lambda: None
    if name == "gpu32":
        masters = [p.detach().to(torch.float32, copy=True) for p in ps]
        for m in masters:
            m.grad = torch.empty_like(m)
        opt = torch.optim.AdamW(masters, fused=True, **HYPER)

        def step(loss_fn: LossFn) -> None:
            loss_fn().backward()
            torch._foreach_copy_([m.grad for m in masters], [p.grad for p in ps])
            if clip:
                torch_clip(masters)
            opt.step()
            with torch.no_grad():
                torch._foreach_copy_(ps, masters)
            zero()
        return step, lambda: None
    if name in OURS:
        m = moments_of(name)
        base = name.removesuffix(m)
        mode = base.removesuffix("r") if base.endswith("r") else base.removesuffix("lion") or "plain"
        stale = mode in ("stale", "land", "staleboth", "landboth")
        ours = build_ours({"engine": "plain", "both": "plain"}.get(mode, "delayed" if stale else mode),
                          dict(model.named_parameters()), frac, clip=args.max_norm if clip else None,
                          delay=fo.Delay(lookahead=False) if stale else None,
                          optimizer="lion" if name.endswith("lion") else "adamw",
                          moments=MOMENTS[m], remainders=base.endswith("r"),
                          threads=args.threads,
                          engine={"engine": "gpu", "both": "both", "staleboth": "both",
                                  "landboth": "both"}.get(mode, "cpu"),
                          gpu_share=args.gpu_share if mode.endswith("both") else None,
                          chunk_mb=args.chunk_mb, slots=args.slots, timeline=timeline,
                          engine_chunk_mb=args.engine_chunk_mb if mode in (
                              "engine", "both", "staleboth", "landboth") else None)
        info.update(offloaded=ours.offloaded, host_state_gib=ours.host_state_bytes / 2**30,
                    threads=ours.executor.threads, ahead=ours.ahead)
        if mode in ("land", "landboth"):  # the hooks stay for the process's one model
            fo.land_before_forward(model, ours.state)
        if mode.endswith("both"):
            def searching() -> bool:
                last = ours.executor.last_split
                if last is not None and (not SPLITS or SPLITS[-1] is not last):
                    SPLITS.append(last)
                return last is None or last.phase in ("warm-up", "search")
            SEARCHING.append(searching)

            def flush() -> None:  # the row takes the last step's split (its times and share)
                ours.flush()
                info["split"] = str(ours.executor.last_split)
            return ours.step, flush
        return ours.step, ours.flush
    plan = fo.placement.offload_fraction(frac).plan(dict(model.named_parameters()))
    if name == "hdo":
        try:
            from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
        except Exception as e:  # noqa: BLE001 - missing, or failing to import: reported as such
            raise Unavailable(f"megatron-core: {type(e).__name__}: {e}") from e
        if args.device == "cpu" or not torch.cuda.is_available():
            raise Unavailable("megatron-core's HybridDeviceOptimizer needs CUDA")
        opt = HybridDeviceOptimizer(ps, offload_fraction=frac, cpu_optimizer_cls=torch.optim.AdamW,
                                    gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                                    overlap_cpu_optimizer_d2h_h2d=True, fused=True, **HYPER)
        info["offloaded"] = sum(n for n, h in zip(plan.numels, plan.on_host) if h)

        def step(loss_fn: LossFn) -> None:
            loss_fn().backward()
            if clip:
                torch_clip(ps)
            opt.step()
            opt.zero_grad()
        return step, lambda: None
    if name == "torchao":
        try:
            from torchao.optim import CPUOffloadOptimizer
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"torchao: {type(e).__name__}: {e}") from e
        opt = CPUOffloadOptimizer(ps, torch.optim.AdamW, fused=True, **HYPER)
        # its default minimal_size: smaller params stay on the GPU
        info.update(clip="no*", offloaded=sum(p.numel() for p in ps if p.numel() >= 4096))

        def step(loss_fn: LossFn) -> None:
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, lambda: None
    if name == "zero":
        try:
            import deepspeed
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"deepspeed: {type(e).__name__}: {e}") from e
        if args.device == "cpu" or not torch.cuda.is_available():
            raise Unavailable("DeepSpeed's ZeRO-Offload needs CUDA")
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=ps, config={
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": MAX_NORM[0] if clip else 0.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {**HYPER, "betas": list(HYPER["betas"])}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                    "pin_memory": True}}})
        info["offloaded"] = sum(p.numel() for p in ps)

        def step(loss_fn: LossFn) -> None:  # (the loss from the module the engine wraps)
            engine.backward(loss_fn())
            engine.step()
        return step, lambda: None
    raise SystemExit(f"unknown system {name!r}")


def resident_bytes() -> int:
    """This process's resident memory (pinned pages included), bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(spec: str, args: argparse.Namespace) -> dict:
    """Build the model, run ``spec``'s warm-up and timed steps; the row of results."""
    if spec == "floor":
        shapes = host_floor.leaf_shapes(args.size, args.floor_max_numel)
        return {"system": "floor", **host_floor.measure(shapes, args.threads, args.floor_reps,
                                                        args.dram_numel)}
    device = torch.device(args.device)
    if args.side_stream and device.type == "cuda":  # the model, the system and its steps
        torch.cuda.set_stream(torch.cuda.Stream(device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = gpt.build(args.size, device, dtype)
    inputs, targets = gpt.batch(model.cfg, args.tokens, device)
    name, _, frac = spec.partition(":")
    info: dict = {"system": spec, "params": gpt.count_params(model), "leaves": gpt.count_leaves(model)}
    timeline = Timeline() if args.timeline and name in OURS else None
    rss0 = resident_bytes()
    try:
        step, flush = system(name, float(frac or 0), model, args, info, timeline)
    except Unavailable as e:
        return {"system": spec, "error": f"unavailable: {e}"}

    def loss_fn() -> torch.Tensor:
        return gpt.loss(model, inputs, targets, args.checkpoint)

    for _ in range(args.warmup):
        step(loss_fn)
        if SEARCHING:
            SEARCHING[0]()
    warm = args.warmup
    while SEARCHING and SEARCHING[0]() and warm < args.warmup + 16:  # until the share settles
        step(loss_fn)
        warm += 1
    info["warmup"] = warm
    if SEARCHING:  # each split step of the warm-up: (share, phase, GPU s, CPU s)
        info["search"] = [[round(s.share, 3), s.phase, round(s.gpu_s, 4), round(s.cpu_s, 4)]
                          for s in SPLITS]
    flush()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        stats0 = torch.cuda.memory_stats(device)
        host0 = torch.cuda.host_memory_stats()
    gc.collect()  # the building's and warm-up's garbage (a long run's first steps) goes now,
    #               not in a timed step's full collection
    pauses: list[float] = []  # the interpreter's garbage collections in the timed steps, s
    full: list[float] = []  # those of the oldest generation (each walks every object)
    began = [0.0]

    def collected(phase: str, facts: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])
            if facts["generation"] == 2:
                full.append(pauses[-1])
    gc.callbacks.append(collected)
    # Per step: until the training stream's work is done (what a loop reading the loss waits
    # for; a delayed step's host part may still run). Mean: wall time of all timed steps with the
    # final flush and a device-wide sync, so nothing in flight is left out.
    times = []
    start = time.perf_counter()
    # a delayed step's host part runs during the next step: keep both in the timeline
    kept = 2 if name.startswith(("delayed", "stale", "land")) else 1
    try:
        for i in range(args.steps):
            if timeline is not None and i == args.steps - kept:
                timeline.clear()  # keep the last step(s) only
            t0 = time.perf_counter()
            step(loss_fn)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(collected)
    info.update(gc_count=len(pauses), gc_s=round(sum(pauses), 4), gc_max_s=round(max(pauses, default=0.0), 4),
                gc_full=len(full), gc_full_s=round(sum(full), 4))
    t0 = time.perf_counter()
    flush()
    sync(device)
    info["flush_s"] = time.perf_counter() - t0
    info["mean_s"] = (time.perf_counter() - start) / args.steps
    # host memory the system took (its state, staging, pinned buffers), per param of the model
    info["host_bytes_per_param"] = (resident_bytes() - rss0) / info["params"]
    info.update(step_s=statistics.median(times), step_min_s=min(times), pinned_bytes=pinned_bytes(device),
                times_s=[round(t, 4) for t in times])
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        stats, host = torch.cuda.memory_stats(device), torch.cuda.host_memory_stats()
        grew = lambda now, then, key: now.get(key, 0) - then.get(key, 0)  # noqa: E731
        info.update(peak_gib=peak / 2**30, peak_extra_gib=(peak - gpt.model_bytes(model)) / 2**30,
                    reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                    # the caching allocator's frees of cached blocks to retry an allocation
                    # (each synchronizes the device) in the timed steps
                    alloc_retries=grew(stats, stats0, "num_alloc_retries"),
                    # the device allocations and frees (cudaMalloc, cudaFree) in the timed steps
                    # and the final flush
                    device_allocs=grew(stats, stats0, "num_device_alloc"),
                    device_frees=grew(stats, stats0, "num_device_free"),
                    # the pinned allocator's new blocks (cudaHostAlloc) and their time, ms
                    host_allocs=grew(host, host0, "num_host_alloc"),
                    host_alloc_ms=grew(host, host0, "host_alloc_time.total") / 1e3)
    if timeline is not None:
        os.makedirs(args.timeline, exist_ok=True)
        stem = os.path.join(args.timeline, "timeline_" + spec.replace(":", "-"))
        timeline.to_chrome(stem + ".json")
        try:
            timeline.plot(stem + ".png", title=f"{spec}, GPT {args.size}, {args.tokens} tokens: "
                          "last " + ("two steps" if kept == 2 else "step"))
        except ImportError as e:  # no matplotlib here: the JSON opens in Perfetto
            print(f"timeline plot skipped ({e})", file=sys.stderr)
    if name == "fwdbwd":  # forward (graph built) and backward timed apart, synced in between
        fwd, bwd = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = loss_fn()
            sync(device)
            t1 = time.perf_counter()
            loss.backward()
            sync(device)
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
            for p in model.parameters():
                p.grad = None
        info.update(fwd_s=statistics.median(fwd), bwd_s=statistics.median(bwd))
    return info


def bound(name: str, fwd: float, bwd: float, floor: float) -> float:
    if name.startswith("stream") or name == "torchao":
        return fwd + 1.1 * max(bwd, floor)
    if name.startswith(("delayed", "stale")):
        return 1.1 * max(fwd + bwd, floor)
    if name.startswith("land"):  # the host step hides behind most of the next forward
        return fwd + bwd + floor - 0.8 * fwd
    return fwd + bwd + floor  # gpu, gpu32 (floor 0), plain, hdo: the host step after backward


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    """The summary lines: the floor, fwd/bwd, then one row per system."""
    fl = next((r for r in rows if r["system"] == "floor" and "kernel_gelems" in r), None)
    fb = next((r for r in rows if r["system"] == "fwdbwd" and "fwd_s" in r), None)
    nan = float("nan")
    out = [f"\nE2E GPT {args.size}, {args.tokens} tokens"
           + (", every block checkpointed" if args.checkpoint else "") + f", device {args.device}; median of "
           f"{args.steps} steps after {args.warmup}; ratios use the mean wall time (incl. flush)"]
    if fl:
        out.append(f"host: kernel {fl['kernel_gelems']:.2f} G elem/s (bf16 moments "
                   f"{fl['kernel16_gelems']:.2f}, 8-bit {fl.get('kernel8_gelems', nan):.2f}) on "
                   f"{fl['numel']:,} elements, {fl['threads']} threads; DRAM copy "
                   f"{fl['copy_gbs']:.1f} GB/s, triad {fl['triad_gbs']:.1f} GB/s")
    if fb:
        out.append(f"forward {fb['fwd_s']:.3f} s, backward {fb['bwd_s']:.3f} s, fwd+bwd step "
                   f"{fb['step_s']:.3f} s")
    out.append(f"{'system':<12} {'clip':>4} {'step s':>7} {'2nd+ s':>7} {'mean s':>7} {'flush s':>7} {'x fb':>6} {'host s':>7} "
               f"{'x plain':>7} {'floor s':>8} {'ovh/flr':>7} {'bound s':>8} {'x bound':>7} {'peak GiB':>9} "
               f"{'extra':>6} {'pin MiB':>8} {'host B/p':>8} {'gc ms':>6}")
    # the host step: a system's mean less the fwdbwd row's; x plain: over plain:F's, same F
    host_of = {r["system"]: r["mean_s"] - fb["mean_s"] for r in rows
               if fb and "mean_s" in r and r["system"] != "floor"}
    for r in rows:
        if r["system"] == "floor":
            continue
        if "step_s" not in r:
            out.append(f"{r['system']:<12} {r.get('error', '')[-150:]}")
            continue
        name = r["system"].partition(":")[0]
        rate = (fl or {}).get("kernel16_gelems" if name == "torchao"
                              else f"kernel{moments_of(name)}_gelems")
        floor = r["offloaded"] / (rate * 1e9) if rate else nan
        fbs = fb["fwd_s"] + fb["bwd_s"] if fb else nan
        ovh = (r["mean_s"] - fbs) / floor if r["offloaded"] and floor == floor else nan
        b = bound(name, fb["fwd_s"], fb["bwd_s"], floor if r["offloaded"] else 0.0) if fb else nan
        pin = f"{r['pinned_bytes'] / 2**20:.0f}" if r.get("pinned_bytes") is not None else "-"
        host = host_of.get(r["system"], nan) if r["offloaded"] else nan
        later = r.get("times_s", [])[1:]
        plain = host_of.get("plain:" + r["system"].partition(":")[2], nan)
        out.append(f"{r['system']:<12} {r['clip']:>4} {r['step_s']:>7.3f} "
                   f"{sum(later) / len(later) if later else nan:>7.3f} {r['mean_s']:>7.3f} "
                   f"{r.get('flush_s', nan):>7.3f} {r['mean_s'] / fbs:>6.2f} {host:>7.3f} "
                   f"{host / plain if plain > 0 else nan:>7.2f} "
                   f"{floor if r['offloaded'] else nan:>8.3f} {ovh:>7.2f} "
                   f"{b:>8.3f} {r['mean_s'] / b:>7.2f} {r.get('peak_gib', nan):>9.2f} "
                   f"{r.get('peak_extra_gib', nan):>6.2f} {pin:>8} "
                   f"{r.get('host_bytes_per_param', nan):>8.2f} {r.get('gc_max_s', nan) * 1e3:>6.1f}"
                   + (f"  ahead {r['ahead']}" if name.startswith("stream") and r.get("ahead") else ""))
    out.append("step s = the median step; 2nd+ s = the mean of the timed steps after the first (a "
               "delayed system's first follows the warm-up's flush and waits for nothing); "
               "mean = (timed steps + final flush) / steps; flush s = the final flush alone; "
               "x fb = mean / (fwd+bwd); host s = mean - fwdbwd's mean; x plain = host s / plain:F's "
               "(same F, same run); ovh/flr = (mean - fwd - bwd) / floor; x bound = mean / bound; "
               "extra = peak GiB above the bf16 model; host B/p = the process's resident memory "
               "grown from before the system was built to after the flush, per param; "
               "gc ms = the longest of the interpreter's garbage collections in the timed steps; "
               "no* = cannot clip")
    return out


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.3b", help="GPT size (gpt.py): tiny, 125m, ..., 6.7b, 13b")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch x seq)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--side-stream", action="store_true",
                    help="every system builds and steps on a side CUDA stream (torch.cuda.set_stream) "
                         "instead of the default one: while a backward fills the default stream's "
                         "queue of launches, other threads' CUDA calls wait (benchmarks/call_stalls.py)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="every system recomputes each block in backward (torch.utils.checkpoint), "
                         "for token counts whose activations would not fit")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--systems", default=DEFAULT)
    ap.add_argument("--no-clip", action="store_true", help="no gradient clipping anywhere")
    ap.add_argument("--max-norm", type=float, default=1.0,
                    help="the clipping threshold (a large one never clips: the streamed step's "
                         "run-ahead is then always kept)")
    ap.add_argument("--chunk-mb", type=int, default=32, help="our executor's chunk size")
    ap.add_argument("--engine-chunk-mb", type=int, default=128,
                    help="engine:F and both:F systems: the GPU engine's chunk size (the library's "
                         "default, 128 MiB)")
    ap.add_argument("--slots", type=int, default=4, help="our executor's ring slots")
    ap.add_argument("--gpu-share", type=float, default=None,
                    help="both:F systems: the GPU engine's share (default: searched for over the first steps)")
    ap.add_argument("--threads", type=int, default=0,
                    help="host threads (ours and the floor); 0: physical cores (one fewer for delayed)")
    ap.add_argument("--floor-max-numel", type=int, default=1 << 31,
                    help="cap on the elements the floor's kernel updates (16 B/elem of host memory)")
    ap.add_argument("--floor-reps", type=int, default=3)
    ap.add_argument("--dram-numel", type=int, default=1 << 28, help="fp32 elements per DRAM array")
    ap.add_argument("--timeline", default="",
                    help="folder for a Chrome trace and a PNG of the last step of each of ours "
                         "(of the last two for delayed ones), with the forward, backward and "
                         "what the update queues on the compute stream, and the caller's "
                         "calls of them on the host clock")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model on the CPU, 1+2 steps, a small floor (sets the options above)")
    ap.add_argument("--one", help="run one system in this process and print its JSON")
    ap.add_argument("--out", help="write the rows and arguments as JSON")
    args = ap.parse_args()
    if args.smoke:
        args.size, args.tokens, args.device, args.warmup, args.steps = "tiny", 128, "cpu", 1, 2
        args.floor_reps, args.dram_numel = 1, 1 << 20
        if args.systems == DEFAULT:
            args.systems = SMOKE
    return args


def main() -> None:
    args = parse()
    MAX_NORM[0] = args.max_norm
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    rows = []
    for spec in ["floor", *args.systems.split(",")]:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--one", spec],
                              capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(line[-1][7:]) if line else {"system": spec, "error": proc.stderr[-800:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n".join(table(rows, args)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
