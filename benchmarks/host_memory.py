"""The host memory system, measured on this machine: the CPU kernel's DRAM traffic per state
format, the pinned copies' full-duplex PCIe traffic, and both at once.

    python benchmarks/host_memory.py --out hostmem.json                   # 2**27 params, all formats
    python benchmarks/host_memory.py --size 1.3b --threads 8,16 --out hostmem13b.json
    python benchmarks/host_memory.py --numel 4194304 --threads 1,2 --reps 3   # a quick one

Kernel: one ``fo.adamw(placement=on_host(), cpu_kernel="native", executor=HostExecutor(threads=T))``
update through the public API, on bf16 CPU params (one flat leaf of ``--numel``, or the GPT
model's leaves with ``--size``) with bf16 grads, per state format and worker-thread count T
(``--threads``; default powers of two up to the physical cores, and the physical cores): median
of ``--reps`` after one warm-up. GB/s = DRAM bytes per param the kernel moves x params/s:

    fp32              fp32 master, mu, nu           28 B (master r+w 8, mu 8, nu 8, grad 2, param 2)
    bf16m             fp32 master, bf16 mu, nu      20 B
    remainder         bf16 param + int16 remainder  26 B (param r+w 4, remainder r+w 4, moments 16, grad 2)
    remainder_bf16m   both                          18 B
    q8m               fp32 master, 8-bit mu, nu     16 B (moments 1 B r+w each, +1.6% absmax)
    remainder_q8m     split master, 8-bit moments   14 B

The remainder formats (``fo.adamw(store_param_remainders=True)``) are skipped, with a note,
where ``fo.adamw`` does not accept that option.

Copies (CUDA only): H2D from a pinned buffer and D2H into another, ``--copy-bytes`` each, as
``--copy-piece`` copies kept ``--copy-depth`` deep on one stream per direction; both directions
at once (their sum is the copies' host DRAM traffic) and each alone, median of ``--reps``.

Both at once (CUDA only): per format and T, the kernel's reps are timed while a background
thread keeps both copy streams busy; the copies' GB/s are the bytes they landed within the
reps' window. Kernel GB/s + copies' GB/s is the DRAM the two got together.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, NamedTuple, Optional

import torch

from ours import HYPER, fo  # first: it puts the library to measure on the path
from functional_offload.executor import HostExecutor, physical_cores  # noqa: E402

from host_floor import leaf_shapes  # noqa: E402

POLL_S = 2e-4  # how often the copy loop looks for landed copies


class Format(NamedTuple):
    bytes_per_param: int  # DRAM bytes the kernel reads and writes per param
    options: dict  # fo.adamw keyword arguments


FORMATS: dict[str, Format] = {
    "fp32": Format(28, {}),
    "bf16m": Format(20, dict(mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)),
    "remainder": Format(26, dict(store_param_remainders=True)),
    "remainder_bf16m": Format(18, dict(store_param_remainders=True, mu_dtype=torch.bfloat16,
                                       nu_dtype=torch.bfloat16)),
    "q8m": Format(16, dict(mu_dtype=torch.uint8, nu_dtype=torch.uint8)),  # (+0.06: the absmax)
    "remainder_q8m": Format(14, dict(store_param_remainders=True, mu_dtype=torch.uint8,
                                     nu_dtype=torch.uint8)),
}


def available_formats() -> list[str]:
    """The formats whose options ``fo.adamw`` accepts."""
    out = []
    for name, f in FORMATS.items():
        try:
            fo.adamw(cpu_kernel="native", **f.options)
        except TypeError:
            continue
        out.append(name)
    return out


def default_threads() -> list[int]:
    """Powers of two below the physical cores, then the physical cores."""
    cores = physical_cores()
    return [1 << i for i in range(cores.bit_length()) if 1 << i < cores] + [cores]


def machine() -> dict[str, Any]:
    """CPU model, physical cores, torch version and GPU name (None without CUDA)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "physical_cores": physical_cores(), "torch": torch.__version__, "gpu": gpu}


def rep_times(fn: Callable[[], None], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (no warm-up)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


class Lane:
    """One direction's copies: ``src`` into ``dst`` in ``piece``-byte copies on its own stream."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, piece: int) -> None:
        self.src, self.dst, self.piece = src, dst, piece
        self.pieces = src.numel() // piece
        self.stream = torch.cuda.Stream(src.device if src.is_cuda else dst.device)

    def issue(self, i: int) -> torch.cuda.Event:
        """Enqueue the copy of piece ``i`` (modulo the buffer); the event marks its end."""
        lo = (i % self.pieces) * self.piece
        with torch.cuda.stream(self.stream):
            self.dst[lo:lo + self.piece].copy_(self.src[lo:lo + self.piece], non_blocking=True)
            return self.stream.record_event()


def make_lanes(nbytes: int, piece: int) -> dict[str, Lane]:
    """``h2d`` (pinned to GPU) and ``d2h`` (GPU to pinned) lanes of ``nbytes`` (whole pieces)."""
    piece = min(piece, nbytes)
    nbytes -= nbytes % piece
    dev = torch.device("cuda", torch.cuda.current_device())

    def pinned() -> torch.Tensor:
        return torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)

    def gpu() -> torch.Tensor:
        return torch.ones(nbytes, dtype=torch.uint8, device=dev)

    return {"h2d": Lane(pinned(), gpu(), piece), "d2h": Lane(gpu(), pinned(), piece)}


def copy_loop(lanes: dict[str, Lane], more: Callable[[int], bool], done: dict[str, list[float]],
              depth: int) -> None:
    """Keep each lane ``depth`` copies deep while ``more(copies issued on it)``; append each
    copy's landing time (``time.perf_counter``, polled) to ``done[lane]``; return when all landed."""
    pending: dict[str, deque] = {d: deque() for d in lanes}
    issued = dict.fromkeys(lanes, 0)
    while True:
        for d, lane in lanes.items():
            while pending[d] and pending[d][0].query():
                pending[d].popleft()
                done[d].append(time.perf_counter())
            while len(pending[d]) < depth and more(issued[d]):
                pending[d].append(lane.issue(issued[d]))
                issued[d] += 1
        if not any(pending.values()):
            return
        time.sleep(POLL_S)


def copies_alone(lanes: dict[str, Lane], reps: int, depth: int) -> dict[str, float]:
    """GB/s of each lane moving its buffer once, the lanes at once; medians of ``reps`` after a
    warm-up (and ``sum_gbs`` with more than one lane)."""
    rates: dict[str, list[float]] = {d: [] for d in lanes}
    n = min(lane.pieces for lane in lanes.values())
    for rep in range(reps + 1):
        done: dict[str, list[float]] = {d: [] for d in lanes}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy_loop(lanes, lambda i: i < n, done, depth)
        for d, lane in lanes.items():
            if rep:
                rates[d].append(lane.piece * len(done[d]) / (done[d][-1] - t0) / 1e9)
    out = {f"{d}_gbs": statistics.median(r) for d, r in rates.items()}
    if len(out) > 1:
        out["sum_gbs"] = sum(out.values())
    return out


def under_copies(update: Callable[[], None], reps: int, lanes: dict[str, Lane],
                 depth: int) -> tuple[float, dict[str, float]]:
    """Median seconds of ``reps`` calls of ``update`` while the lanes copy in the background,
    and each lane's GB/s within the reps' window."""
    stop = threading.Event()
    done: dict[str, list[float]] = {d: [] for d in lanes}
    bg = threading.Thread(target=copy_loop, args=(lanes, lambda i: not stop.is_set(), done, depth),
                          daemon=True)
    bg.start()
    try:
        while bg.is_alive() and not all(done.values()):  # every lane is running
            time.sleep(1e-3)
        t0 = time.perf_counter()
        ts = rep_times(update, reps)
        t1 = time.perf_counter()
    finally:
        stop.set()
        bg.join()
    rates = {f"{d}_gbs": lane.piece * sum(t0 <= t < t1 for t in done[d]) / (t1 - t0) / 1e9
             for d, lane in lanes.items()}
    return statistics.median(ts), rates


def make_update(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], fmt: str,
                threads: int) -> Callable[[], None]:
    """One host AdamW update of ``params`` by ``grads`` in state format ``fmt``, per call."""
    opt = fo.adamw(placement=fo.placement.on_host(), cpu_kernel="native",
                   executor=HostExecutor(threads=threads), **FORMATS[fmt].options, **HYPER)
    holder = [opt.init(params)]

    def update() -> None:
        _, holder[0] = opt.update(grads, holder[0])

    return update


def measure_format(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], fmt: str,
                   threads: int, reps: int, lanes: Optional[dict[str, Lane]],
                   depth: int) -> tuple[dict, Optional[dict]]:
    """The kernel alone, and (with ``lanes``) under the copies: one row each."""
    update = make_update(params, grads, fmt, threads)
    update()  # warm-up
    n = sum(p.numel() for p in params.values())
    b = FORMATS[fmt].bytes_per_param
    s = statistics.median(rep_times(update, reps))
    alone = {"format": fmt, "threads": threads, "bytes_per_param": b, "update_s": s,
             "gparams_s": n / s / 1e9, "gbs": b * n / s / 1e9}
    if lanes is None:
        return alone, None
    s, copies = under_copies(update, reps, lanes, depth)
    over = {"format": fmt, "threads": threads, "update_s": s, "kernel_alone_gbs": alone["gbs"],
            "kernel_gbs": b * n / s / 1e9, **copies, "copies_gbs": sum(copies.values())}
    over["sum_gbs"] = over["kernel_gbs"] + over["copies_gbs"]
    return alone, over


def measure(shapes: list[tuple[int, ...]], formats: Optional[list[str]] = None,
            threads: Optional[list[int]] = None, reps: int = 5, copy_bytes: int = 1 << 30,
            copy_piece: int = 32 << 20, copy_depth: int = 8,
            on_row: Optional[Callable[[dict, Optional[dict]], None]] = None) -> dict:
    """Kernel rows per (format, threads), the copies alone and (CUDA) the kernel under the copies.

    ``formats`` default to all available; ``threads`` to :func:`default_threads`. ``on_row`` is
    called with each (kernel row, overlap row or None) as it is measured."""
    unknown = set(formats or ()) - set(FORMATS)
    if unknown:
        raise ValueError(f"unknown formats {sorted(unknown)}; known: {list(FORMATS)}")
    wanted, available = formats or list(FORMATS), available_formats()
    notes = [f"{f} skipped: fo.adamw does not accept store_param_remainders"
             for f in wanted if f not in available]
    params = {str(i): torch.empty(s, dtype=torch.bfloat16).uniform_(-1, 1) for i, s in enumerate(shapes)}
    grads = {k: torch.empty_like(p).uniform_(-1e-3, 1e-3) for k, p in params.items()}
    lanes = make_lanes(copy_bytes, copy_piece) if torch.cuda.is_available() else None
    out: dict[str, Any] = {"machine": machine(), "numel": sum(p.numel() for p in params.values()),
                           "leaves": len(shapes), "threads": threads or default_threads(),
                           "formats": [f for f in wanted if f in available], "notes": notes,
                           "copy_bytes": None, "copies": None, "kernel": [], "overlap": []}
    if lanes is None:
        notes.append("copies skipped: no CUDA device")
    else:
        out["copy_bytes"] = lanes["h2d"].pieces * lanes["h2d"].piece
        out["copies"] = {"duplex": copies_alone(lanes, reps, copy_depth),
                         **{d: copies_alone({d: lane}, reps, copy_depth) for d, lane in lanes.items()}}
    for fmt in out["formats"]:
        for t in out["threads"]:
            alone, over = measure_format(params, grads, fmt, t, reps, lanes, copy_depth)
            out["kernel"].append(alone)
            if over is not None:
                out["overlap"].append(over)
            if on_row is not None:
                on_row(alone, over)
    return out


def print_row(alone: dict, over: Optional[dict]) -> None:
    """One line of the kernel table: alone, and under the copies where measured."""
    line = (f"{alone['format']:<16} {alone['threads']:>4} {alone['bytes_per_param']:>4} "
            f"{alone['update_s']:>9.4f} {alone['gparams_s']:>8.3f} {alone['gbs']:>8.1f}")
    if over is not None:
        line += (f" | {over['update_s']:>9.4f} {over['kernel_gbs']:>8.1f} {over['h2d_gbs']:>7.1f} "
                 f"{over['d2h_gbs']:>7.1f} {over['sum_gbs']:>7.1f}")
    print(line, flush=True)


def print_header(m: dict, shapes: list[tuple[int, ...]], cuda: bool) -> None:
    """The machine, the command line and the kernel table's column names."""
    print(f"machine: {m['cpu']}, {m['physical_cores']} physical cores, torch {m['torch']}, "
          f"GPU {m['gpu'] or 'none'}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"params: {sum(torch.Size(s).numel() for s in shapes):,} in {len(shapes)} leaves (bf16)\n")
    cols = f"{'format':<16} {'T':>4} {'B/p':>4} {'update s':>9} {'G par/s':>8} {'GB/s':>8}"
    if cuda:
        cols += f" | {'w/ copies':>9} {'GB/s':>8} {'H2D':>7} {'D2H':>7} {'sum':>7}"
    print(cols, flush=True)


def print_summary(r: dict) -> None:
    """Notes, the copies alone and the DRAM split of each overlap."""
    for note in r["notes"]:
        print(f"note: {note}")
    if r["copies"] is not None:
        c, both = r["copies"], r["copies"]["duplex"]
        print(f"\ncopies alone ({r['copy_bytes']:,} B each way): duplex H2D {both['h2d_gbs']:.1f} + "
              f"D2H {both['d2h_gbs']:.1f} = {both['sum_gbs']:.1f} GB/s; "
              f"H2D only {c['h2d']['h2d_gbs']:.1f} GB/s; D2H only {c['d2h']['d2h_gbs']:.1f} GB/s")
    if r["overlap"]:
        print("\nDRAM with the duplex copies running (kernel + copies):")
    for o in r["overlap"]:
        print(f"  {o['format']:<16} T={o['threads']}: kernel alone {o['kernel_alone_gbs']:.1f} GB/s; "
              f"with copies {o['kernel_gbs']:.1f} + {o['copies_gbs']:.1f} = {o['sum_gbs']:.1f} GB/s "
              f"(copies H2D {o['h2d_gbs']:.1f}, D2H {o['d2h_gbs']:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 27, help="one flat leaf of this many params")
    ap.add_argument("--size", help="the GPT model's leaves instead (see gpt.py), e.g. 1.3b")
    ap.add_argument("--max-numel", type=int, default=1 << 31, help="cap on the params of --size")
    ap.add_argument("--threads", default="", help="comma-separated; default: powers of two, cores")
    ap.add_argument("--formats", default="", help=f"comma-separated of {', '.join(FORMATS)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copy-bytes", type=int, default=1 << 30, help="per direction")
    ap.add_argument("--copy-piece", type=int, default=32 << 20, help="bytes per copy")
    ap.add_argument("--copy-depth", type=int, default=8, help="copies in flight per direction")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = leaf_shapes(args.size, args.max_numel) if args.size else [(args.numel,)]
    threads = [int(t) for t in args.threads.split(",") if t] or None
    formats = [f for f in args.formats.split(",") if f] or None
    print_header(machine(), shapes, torch.cuda.is_available())
    r = measure(shapes, formats, threads, args.reps, args.copy_bytes, args.copy_piece,
                args.copy_depth, on_row=print_row)
    r = {"args": vars(args), "argv": sys.argv, **r}
    print_summary(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
