"""How long a side thread's CUDA calls take while the training loop's launches fill the GPU's queue.

    python benchmarks/call_stalls.py                  # needs a GPU
    python benchmarks/call_stalls.py --out stalls.json

The host step's threads issue copies and record events (the executor's driver, the GPU engine's
thread) while the caller's thread runs the next forward and backward. This measures one such
thread, as the executor's driver calls them: ``Event()`` (create), an 8 MiB device-to-host
``copy_`` into pinned memory on a side stream, ``Event.record`` on it, ``Stream.wait_event``
on an event already done, ``Event.query`` and ``Event.synchronize`` (the copy's own time),
each call timed alone; then the same bytes as 16 ``copy_`` calls (``copy_ x16``, timed
together) and as one replay of a CUDA graph of those 16 copies (``graph x16``), each followed
by a synchronize (untimed): whether a graph's launch waits like one call or like its copies. In a
loop for as long as the load below runs:

    idle              nothing else runs
    flood default     the main thread queues 3,000 bf16 matmuls (8192x4096 @ 4096x4096, ~0.4 ms
                      each on an H100) on the default stream: more than the GPU's queue holds,
                      so it stays full (as during a backward whose kernels the host outruns)
    flood side        the same on a side stream (``torch.cuda.stream(s)``)
    flood long        1,500 larger matmuls (8192x8192 @ 8192x8192, ~1.6 ms) on the default stream
    short default     800 matmuls on the default stream: the queue never fills

Reported per call: median / 90th percentile / max in ms, and the copies' GB/s over the load.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Callable, NamedTuple, Optional

import torch

CALLS = ("create", "copy_", "record", "wait_event", "query", "synchronize", "copy_ x16",
         "graph x16")
PARTS = 16  # the copies of ``copy_ x16`` and of the graph


class Copies(NamedTuple):
    """A device buffer, its pinned copy, and a CUDA graph of the copy in :data:`PARTS` parts."""

    src: torch.Tensor
    dst: torch.Tensor
    graph: Optional[torch.cuda.CUDAGraph]  # None where this torch cannot capture the copies


def copies_of(nbytes: int) -> Copies:
    dev = torch.device("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    graph: Optional[torch.cuda.CUDAGraph] = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for d, s in zip(dst.view(PARTS, -1), src.view(PARTS, -1)):
                d.copy_(s, non_blocking=True)
    except RuntimeError as e:
        print(f"graph x16 not measured: the copies could not be captured ({e})")
        graph = None
    torch.cuda.synchronize()
    return Copies(src, dst, graph)


def probe(stop: threading.Event, out: list[tuple[float, ...]], c: Copies) -> None:
    """The side thread: the calls above in a loop until ``stop``; per iteration their times."""
    src, dst = c.src, c.dst
    copies, other = torch.cuda.Stream(), torch.cuda.Stream()
    done = torch.cuda.Event()
    done.record(other)
    done.synchronize()
    events = [torch.cuda.Event(blocking=True) for _ in range(64)]
    i = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        torch.cuda.Event(blocking=True)
        t1 = time.perf_counter()
        with torch.cuda.stream(copies):
            dst.copy_(src, non_blocking=True)
        t2 = time.perf_counter()
        ev = events[i % len(events)]
        i += 1
        ev.record(copies)
        t3 = time.perf_counter()
        other.wait_event(done)
        t4 = time.perf_counter()
        ev.query()
        t5 = time.perf_counter()
        ev.synchronize()
        t6 = time.perf_counter()
        with torch.cuda.stream(copies):
            for d, s in zip(dst.view(PARTS, -1), src.view(PARTS, -1)):
                d.copy_(s, non_blocking=True)
            t7 = time.perf_counter()
            copies.synchronize()
            t8 = time.perf_counter()
            if c.graph is not None:
                c.graph.replay()
            t9 = time.perf_counter()
            copies.synchronize()
        out.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6,
                    t9 - t8 if c.graph is not None else float("nan")))


def measure(load: Callable[[], None], stream: Optional[torch.cuda.Stream], c: Copies) -> dict:
    stop, times = threading.Event(), []
    side = threading.Thread(target=probe, args=(stop, times, c))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    side.start()
    with torch.cuda.stream(stream):  # (None: the current stream)
        load()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - t0
    stop.set()
    side.join()
    row = {"host_s": host_s, "gpu_s": gpu_s, "probes": len(times),
           "copy_gbs": len(times) * (2 + (c.graph is not None)) * c.src.numel() / gpu_s / 1e9}
    for name, col in zip(CALLS, zip(*times) if times else [()] * len(CALLS)):
        ts = sorted(col)
        row[name] = ([1e3 * ts[len(ts) // 2], 1e3 * ts[int(len(ts) * 0.9)], 1e3 * ts[-1]]
                     if ts else None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copy-bytes", type=int, default=8 << 20, help="bytes of each copy the side thread makes")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("call_stalls.py needs a CUDA GPU")
    dev = torch.device("cuda")
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def mm(n: int, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
        def load() -> None:
            for _ in range(n):
                torch.mm(x, y)
        return load

    mm(200, a, b)()
    mm(20, big, big)()
    torch.cuda.synchronize()
    pair = copies_of(args.copy_bytes)
    side = torch.cuda.Stream()
    loads = [("idle", lambda: time.sleep(0.5), None), ("flood default", mm(3000, a, b), None),
             ("flood side", mm(3000, a, b), side), ("flood long", mm(1500, big, big), None),
             ("short default", mm(800, a, b), None)]
    rows = {}
    print(f"{torch.cuda.get_device_name()}; per call: median/p90/max ms")
    print(f"{'load':14s} {'host s':>6s} {'gpu s':>6s} {'GB/s':>5s}  " + "  ".join(f"{c:>20s}" for c in CALLS))
    for name, load, stream in loads:
        row = rows[name] = measure(load, stream, pair)
        cells = ["-" if row[c] is None else "/".join(f"{x:.2f}" for x in row[c]) for c in CALLS]
        print(f"{name:14s} {row['host_s']:6.2f} {row['gpu_s']:6.2f} {row['copy_gbs']:5.1f}  "
              + "  ".join(f"{x:>20s}" for x in cells), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes": args.copy_bytes,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
