"""The GPU engine's math on one chunk of host state, phase by phase: a chunk of the split master
with block-wise 8-bit moments (AdamW), as the engine steps it on the device, each phase timed
by CUDA events (the least of five), and pinned copies of the chunk's bytes each way.

    python benchmarks/engine_math.py                  # 22 M elements: a 128 MiB chunk
    python benchmarks/engine_math.py --numel 5500000  # a 32 MiB one
    python benchmarks/engine_math.py --beside-gemm    # also beside bf16 matmuls on another stream

Where the checkout has it, the same step by the one-pass kernel (``kernels/adam_cuda.py``) is
timed after the phases, alone, on a remainder-only master (the param its high half, written in
place).

``--beside-gemm`` times the phases again while a train of bf16 matmuls of the 6.7 B model's MLP
shape (8,192 tokens, d=4,096) runs on a second stream, as the engine's math of a delayed step
runs beside the next forward and backward.

``--beside-train N`` asks what the engine's math costs the training stream when they run at
once: a train of 60 such matmuls alone, the one-pass kernel ``N`` times in a row on another
stream alone, and both at once (each the least of five, CUDA events, wall from the first start
to the last end). The matmuls' time together less alone, over the kernel's time alone, is the
share of the engine's math that the training stream pays for (1: none of it hides).
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from ours import fo  # noqa: F401 - the library from this checkout (or FUNCTIONAL_OFFLOAD_PATH)
from functional_offload.kernels import blockwise
from functional_offload.kernels.remainder import join, split_
from functional_offload.optimizers.adam import AdamHyper, fused

PHASES = ["join the split master", "dequantize both moments", "cast the grads",
          "fused AdamW", "quantize both moments", "split the master, write the param"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=22_000_000)
    ap.add_argument("--beside-gemm", action="store_true",
                    help="also time the phases beside matmuls on a second stream")
    ap.add_argument("--beside-train", type=int, default=0, metavar="N",
                    help="the cost to a train of matmuls of N one-pass kernels beside it")
    args = ap.parse_args()
    n = args.numel
    dev = "cuda"
    g = torch.randn(n, device=dev).bfloat16()
    p = torch.randn(n, device=dev).bfloat16()
    master = torch.empty(2, n, dtype=torch.int16, device=dev)
    master[0].copy_(p.view(torch.int16))
    master[1].random_(-30000, 30000)
    mu = blockwise.quantize(torch.randn(n, device=dev) * 1e-3, True)
    nu = blockwise.quantize(torch.rand(n, device=dev) * 1e-6, False)
    h = AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 10, True)

    a = torch.randn(8192, 4096, device=dev).bfloat16()
    b = torch.randn(4096, 16384, device=dev).bfloat16()
    c = torch.empty(8192, 16384, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def once(beside: bool = False) -> list[float]:
        if beside:  # ~20 ms of matmuls queued first on the other stream: they cover the phases
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(20):
                    torch.mm(a, b, out=c)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(7)]
        ev[0].record()
        v = join(master)
        ev[1].record()
        m, s = blockwise.dequantize(mu, n, True), blockwise.dequantize(nu, n, False)
        ev[2].record()
        gf = g.float()
        ev[3].record()
        fused([v], [gf], [[m], [s]], h)
        ev[4].record()
        blockwise.quantize_into(m, mu, True)
        blockwise.quantize_into(s, nu, False)
        ev[5].record()
        split_(master, v)
        p.copy_(master[0].view(torch.bfloat16))
        ev[6].record()
        torch.cuda.synchronize()
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(6)]

    def one_pass_step() -> Optional[Callable[[], None]]:
        """The same step by the one-pass kernel (where the checkout has it and Triton runs), on
        a remainder-only master: the param its high half."""
        try:
            from functional_offload.kernels import adam_cuda
        except ImportError:
            return None
        if not adam_cuda.available(p, master, g, mu, nu):
            return None
        return lambda: adam_cuda.adamw_split_q8(p.view(torch.int16), master[1], g, mu, nu, h.lr,
                                                h.beta1, h.beta2, h.eps, h.weight_decay, h.step)

    step = one_pass_step()

    def one_pass() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)

    for beside in (False, True) if args.beside_gemm else (False,):
        for _ in range(3):
            once(beside)
        runs = [once(beside) for _ in range(5)]
        print("beside matmuls on another stream:" if beside else "alone:")
        for k, name in enumerate(PHASES):
            print(f"  {name:<36} {min(r[k] for r in runs):7.3f} ms")
        print(f"  {'total':<36} {min(sum(r) for r in runs):7.3f} ms for {n / 1e6:.1f} M elements")
        if not beside and step is not None:
            times = [one_pass() for _ in range(8)]
            print(f"  {'one pass (kernels/adam_cuda.py)':<36} {min(times[3:]):7.3f} ms")
    if args.beside_train and step is None:
        print("--beside-train not measured: the one-pass kernel does not run here")
    elif args.beside_train:
        train(args.beside_train, a, b, c, side, step, n)
    nbytes = master.numel() * 2 + mu.numel() + nu.numel()
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for name, copy in (("up", lambda: device.copy_(host, non_blocking=True)),
                       ("down", lambda: host.copy_(device, non_blocking=True))):
        copy()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            copy()
        b.record()
        torch.cuda.synchronize()
        print(f"{'copy the chunk ' + name + ' (pinned)':<36} {a.elapsed_time(b) / 10:7.3f} ms "
              f"({nbytes / 2**20:.0f} MiB)")


def train(calls: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
          side: "torch.cuda.Stream", kernel: Callable[[], None], n: int) -> None:
    """Print the cost to 60 matmuls ``a @ b`` on the current stream of ``calls`` of ``kernel``
    (one engine chunk's math of ``n`` elements) on ``side`` at once."""
    home = torch.cuda.current_stream()

    def once(mm: bool, math: bool) -> tuple[float, float]:
        """(the matmuls' ms, the kernels' ms), each from a common start to its stream's end."""
        torch.cuda.synchronize()
        t0, e_mm, e_math = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        t0.record()
        side.wait_stream(home)
        with torch.cuda.stream(side):
            for _ in range(calls if math else 0):
                kernel()
            e_math.record()
        for _ in range(60 if mm else 0):
            torch.mm(a, b, out=c)
        e_mm.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(e_mm), t0.elapsed_time(e_math)

    for _ in range(2):
        once(True, True)
    mm = min(once(True, False)[0] for _ in range(5))
    math = min(once(False, True)[1] for _ in range(5))
    both = [once(True, True) for _ in range(5)]
    mm2, math2 = min(x[0] for x in both), min(x[1] for x in both)
    print(f"beside a train of 60 matmuls ({a.shape[0]}x{a.shape[1]} @ {b.shape[0]}x{b.shape[1]}, "
          f"bf16), {calls} one-pass kernels of {n / 1e6:.1f} M elements "
          f"({calls * n / 1e9:.2f} G elements):")
    print(f"  matmuls alone {mm:8.2f} ms, kernels alone {math:8.2f} ms")
    print(f"  at once: matmuls {mm2:8.2f} ms, kernels {math2:8.2f} ms; "
          f"the matmuls paid {(mm2 - mm) / math:5.2f} of the kernels' time")


if __name__ == "__main__":
    main()
