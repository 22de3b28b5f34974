"""Megatron-Core's ``GPTModel`` (TransformerEngine layer spec, one GPU) trained by Megatron's own
optimizer stack and by ours from the same ``OptimizerConfig``: loss at every step, step times
and peak GPU memory, each system in a fresh process.

    python benchmarks/megatron_gpt.py --out mg              # every system, then the table
    python benchmarks/megatron_gpt.py --layers 2 --hidden 256 --heads 4 --steps 4 --out /tmp/mg

Needs a GPU, megatron-core and TransformerEngine. Systems (``--systems``):

- ``megatron:F``: Megatron's stack as its training loop builds it: the model in Megatron's
  ``DistributedDataParallel`` (distributed optimizer, world size 1),
  ``get_megatron_optimizer(OptimizerConfig(optimizer_cpu_offload=True,
  optimizer_offload_fraction=F, overlap_cpu_optimizer_d2h_h2d=True,
  use_precision_aware_optimizer=True, clip_grad=1.0, bf16=True, ...))``: its
  ``HybridDeviceOptimizer``, torch's AdamW on the host, TransformerEngine's ``FusedAdam`` on the
  device; Megatron's ``OptimizerParamScheduler`` at a constant rate applies its no-decay rule.
- ``megatron-gpu``: the same stack without offload (TransformerEngine's ``FusedAdam`` with
  master weights on the GPU): the all-on-GPU anchor.
- ``ours:F``: the bare ``GPTModel`` and ``fo.compat.optimizer_from_megatron`` of the very same
  ``OptimizerConfig`` (offload fraction F), ``loss.backward()`` then ``opt.update``.
- ``stream:F``: the same optimizer with grad streaming (``fo.stream`` around backward).
- ``oursddp:F``: ours on the model in Megatron's ``DistributedDataParallel`` (as ``megatron:F``
  holds it: params and grads in its buffers), the grads read from each param's ``.main_grad``.
- ``land:F``: ours plain, with ``delayed=fo.Delay(lookahead=False)`` and
  ``fo.land_before_forward``: the same results, the host step overlapping the next forward.

Model: ``--layers`` x ``--hidden`` (LayerNorm, biases, RoPE, 4x MLP, no dropout), bf16 params,
a byte vocabulary (256) on the Python standard library's sources (``convergence.corpus``);
``--batch`` sequences of ``--seq`` tokens a step, the same batches and init in every system.
AdamW at ``--lr`` after a linear warm-up from 0 over ``--lr-warmup`` steps, betas (0.9, 0.95),
weight decay 0.1 (none on biases and norms), clipping at 1.0. TransformerEngine's attention
runs deterministically (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``). The table: per system, the
median and mean step (after ``--warmup`` steps), the peak GPU memory over the timed steps, the
final loss, the largest |loss - reference loss| over all steps and the first step where it
passes 1e-3 (ours against ``megatron`` of the same fraction; ``megatron:F`` against
``megatron-gpu``; a system named again, run again in a fresh process as ``S#2``..., against its
first run: the run-to-run spread of one stack). Each system's JSON (``S#2``'s as
``S-run2.json``) also holds its losses, and with ``--norms`` the grads' global norm in fp32
at every step (the one Megatron's clip uses; ours: computed apart, which costs time and memory;
not for ``stream``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # before TransformerEngine loads

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ours import fo  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from train_megatron import build_model  # noqa: E402

DEFAULT = "megatron-gpu,megatron:1.0,ours:1.0,stream:1.0,megatron:0.5,ours:0.5"
VOCAB = 256


def corpus_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``args.steps + args.warmup`` (inputs, labels) pairs of [batch, seq] byte ids, drawn at
    seeded offsets of the standard library's sources."""
    from convergence import corpus
    train, _, _ = corpus(smoke=False)
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.warmup + args.steps):
        starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=g)
        rows = torch.stack([train[s:s + args.seq + 1] for s in starts.tolist()]).long().cuda()
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """World size 1, Megatron's parallel state and seeds, and the GPT model (TE layer spec), as
    the example builds them; the model's config and the model."""
    os.environ["MASTER_PORT"] = str(args.port)
    model = build_model(args.layers, args.hidden, args.heads, args.seq, VOCAB, seed=args.seed)
    return model.config, model


def optimizer_config(args: argparse.Namespace, fraction: float) -> Any:
    """The one ``OptimizerConfig`` both stacks are built from (``fraction`` 0: no offload)."""
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr, weight_decay=0.1,
                           adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0,
                           bf16=True, use_distributed_optimizer=True,
                           use_precision_aware_optimizer=True,
                           optimizer_cpu_offload=fraction > 0,
                           optimizer_offload_fraction=fraction,
                           overlap_cpu_optimizer_d2h_h2d=fraction > 0)


def megatron_ddp(cfg: Any, model: Any) -> Any:
    """The model in Megatron's ``DistributedDataParallel`` as its training loop wraps it for the
    distributed optimizer: params in one buffer, bf16 grads in another (``.main_grad``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    return DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=False, overlap_grad_reduce=False),
        model)


def megatron_system(args: argparse.Namespace, cfg: Any, model: Any, fraction: float,
                    norms: list) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    ddp = megatron_ddp(cfg, model)
    opt = get_megatron_optimizer(optimizer_config(args, fraction), [ddp])
    steps = args.warmup + args.steps
    scheduler = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=args.lr, min_lr=args.lr, lr_warmup_steps=args.lr_warmup,
        lr_decay_steps=steps, lr_decay_style="constant", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=steps, wd_incr_style="constant")  # each group's rate and decay

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = forward(ddp, inputs, labels)
        loss.backward()
        ddp.finish_grad_sync()
        ok, norm, _ = opt.step()
        if args.norms:
            norms.append(norm)  # the fp32 norm its clip used
        if not ok:
            raise RuntimeError("Megatron's optimizer skipped a step")
        scheduler.step(1)
        return loss.detach()

    return step


def ours_system(args: argparse.Namespace, cfg: Any, model: Any, fraction: float, mode: str,
                norms: list) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``mode``: ``plain``, ``stream`` or ``land`` (plain, delayed and landed before each
    module's forward) on the bare model; ``ddp``: plain, on the model in
    Megatron's DDP (its param and grad buffers), the grads read from ``.main_grad``. ``norms``
    gets each plain step's grads' global norm in fp32 (a device tensor) with ``--norms``."""
    ddp = megatron_ddp(cfg, model) if mode == "ddp" else None
    params = dict(model.named_parameters())
    warm = args.lr_warmup
    opt = fo.compat.optimizer_from_megatron(  # Megatron's warm-up from 0, then constant
        optimizer_config(args, fraction),
        lr=(lambda n: args.lr * min(n, warm) / warm) if warm else args.lr,
        delayed=fo.Delay(lookahead=False) if mode == "land" else False)
    holder = [opt.init(params)]
    if mode == "land":  # each module's forward lands its params from the step in flight
        fo.land_before_forward(model, lambda: holder[0])

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if ddp is not None:
            ddp.zero_grad_buffer()
            loss = forward(ddp, inputs, labels)
            loss.backward()
            ddp.finish_grad_sync()
            grads = {k: p.main_grad for k, p in params.items()}
            if args.norms:
                norms.append(fp32_norm(grads))
            _, holder[0] = opt.update(grads, holder[0])
            return loss.detach()
        loss = forward(model, inputs, labels)
        if mode == "stream":
            with fo.stream(opt, holder[0]) as s:
                loss.backward()
            _, holder[0] = s.finish()
        else:
            loss.backward()
            grads = {k: p.grad for k, p in params.items()}
            if args.norms:
                norms.append(fp32_norm(grads))
            _, holder[0] = opt.update(grads, holder[0])
        for p in params.values():
            p.grad = None
        return loss.detach()

    return step


def fp32_norm(grads: dict) -> torch.Tensor:
    """The global norm of ``grads`` with each leaf's norm in fp32, as Megatron's clip takes it."""
    return torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads.values()]))


def forward(model: Any, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss (``GPTModel`` returns it per token when given labels)."""
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    return model(inputs, positions, None, labels=labels).float().mean()


def run_one(spec: str, args: argparse.Namespace) -> dict:
    name, _, frac = spec.partition(":")
    fraction = float(frac or 0)
    batches = corpus_batches(args)
    cfg, model = build(args)
    params = list(model.parameters())
    info: dict = {"system": spec, "params": sum(p.numel() for p in params), "leaves": len(params),
                  "init_sum": float(sum(p.double().sum() for p in params))}
    norms: list = []
    if name.startswith("megatron"):
        step = megatron_system(args, cfg, model, fraction, norms)
    elif name in ("ours", "stream", "oursddp", "land"):
        mode = {"ours": "plain", "oursddp": "ddp"}.get(name, name)
        step = ours_system(args, cfg, model, fraction, mode, norms)
    else:
        raise ValueError(f"unknown system {spec!r}")
    losses, times = [], []
    start = None
    for i, (inputs, labels) in enumerate(batches):
        if i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        t0 = time.perf_counter()
        losses.append(step(inputs, labels))
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    info["mean_s"] = (time.perf_counter() - start) / args.steps
    info.update(step_s=statistics.median(times), peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                losses=[float(x) for x in losses], grad_norms=[float(x) for x in norms])
    torch.distributed.destroy_process_group()
    return info


def reference(spec: str) -> str:
    """The system a row's losses are compared with: a repeat's first run (``S#2``: ``S``), else
    ``megatron`` of the same fraction for ours, ``megatron-gpu`` for ``megatron:F``."""
    if "#" in spec:
        return spec.partition("#")[0]
    name, _, frac = spec.partition(":")
    return "megatron-gpu" if name == "megatron" else f"megatron:{frac}"


def table(rows: list[dict]) -> list[str]:
    by = {r["system"]: r for r in rows}
    out = ["| system | median step (s) | mean step (s) | peak GPU (GiB) | final loss | "
           "reference | max abs loss diff (step) | first step over 1e-3 |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | error: {r['error'].splitlines()[-1][:120]} ||||||")
            continue
        ref = by.get(reference(r["system"]))
        diff = over = "—"
        if ref is not None and "losses" in ref and r is not ref:
            d = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
            k = max(range(len(d)), key=d.__getitem__)
            diff = f"{d[k]:.2e} ({k})"
            over = next((str(i) for i, x in enumerate(d) if x > 1e-3), "none")
        named = reference(r["system"]) if ref else "—"
        out.append(f"| {r['system']} | {r['step_s']:.3f} | {r['mean_s']:.3f} | {r['peak_gib']:.2f} "
                   f"| {r['losses'][-1]:.4f} | {named} | {diff} | {over} |")
    return out


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=DEFAULT)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--lr-warmup", type=int, default=20,
                    help="steps of linear warm-up from 0 (Megatron's scheduler), then constant")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the clock starts")
    ap.add_argument("--steps", type=int, default=200, help="timed steps (losses of all are kept)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--norms", action="store_true",
                    help="record each step's grad norm in fp32 (ours: an extra pass)")
    ap.add_argument("--port", type=int, default=29511)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per system")
    ap.add_argument("--one", help="run one system in this process and print its JSON")
    ap.add_argument("--out", help="folder for each system's JSON and the table")
    return ap.parse_args()


def main() -> None:
    args = parse()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    rows = []
    named: dict[str, int] = {}
    for spec in args.systems.split(","):
        named[spec] = named.get(spec, 0) + 1
        label = spec if named[spec] == 1 else f"{spec}#{named[spec]}"
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                                   "--one", spec], capture_output=True, text=True,
                                  timeout=args.timeout)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = (json.loads(found[-1][7:]) if found
                   else {"system": spec, "error": (proc.stdout + proc.stderr)[-3000:]})
        except subprocess.TimeoutExpired:
            row = {"system": spec, "error": f"timed out after {args.timeout} s"}
        row["system"] = label
        rows.append(row)
        brief = {k: v for k, v in row.items() if k != "losses"}
        print(json.dumps(brief)[:3000], flush=True)
        if args.out:
            name = label.replace(":", "-").replace("#", "-run")  # megatron-1.0-run2.json
            with open(os.path.join(args.out, name + ".json"), "w") as f:
                json.dump(row, f)
    lines = table(rows)
    print("\n".join(lines))
    if args.out:
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
