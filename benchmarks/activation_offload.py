"""Activation memory on a GPT-style decoder: what each system costs in step time and peak memory.

    python benchmarks/activation_offload.py --out act.json --plot act.png      # 1.34 B, 16k tokens
    python benchmarks/activation_offload.py --device cpu --d 64 --blocks 4 --tokens 128 --seq 32 \\
        --vocab 256 --heads 4 --plot /tmp/act.png                              # a smoke run

The model: token and position embeddings, ``--blocks`` pre-norm decoder blocks (LayerNorm, QKV
and output projections with biases, causal ``scaled_dot_product_attention``, a GELU MLP of 4d),
a final LayerNorm, an untied head and an fp32 cross-entropy; bf16; ``--tokens`` per step as
``tokens / seq`` sequences. One group per block. Systems (each in a fresh process):

* ``none``; ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``);
  ``checkpoint`` (``torch.utils.checkpoint`` on every block, non-reentrant);
* ``ours:K``: ``ActivationOffload(blocks, offload=K)`` with its defaults;
* ``te:K``: TransformerEngine's ``get_cpu_offload_context(enabled=True, num_layers=K,
  model_layers=blocks)`` around each block, its sync function after it (needs TE; it offloads
  the activations of K blocks, asynchronously, for any module);
* ``budget:B``: ``ActivationOffload(blocks, budget_bytes=...)``, where B is ``ckpt`` (the
  checkpoint system's peak), a fraction of the ``none`` peak (``0.25``) or bytes (``8GiB``).

Per system: the median step (forward + backward, after warm-up steps that include the planner's
profiling and checking), the peak device memory above what was allocated before the step (the
model and the batch): activations, the loss head, grads, workspace; digests of the grads
compared bit for bit with ``none``. Prints a table and the targets, writes JSON (``--out``) and
a plot of step time against peak memory (``--plot``). Grads are bit-identical only with
deterministic kernels: ``torch.use_deterministic_algorithms(True)`` is on unless
``--nondeterministic``. On the CPU the offload systems copy through deferred CPU copies
(``functional_offload.activations.testing.copy_on_cpu``) and memory is not measured (budgets
then refer to the bytes the ``none`` and ``checkpoint`` forwards save).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from functional_offload.activations import ActivationOffload  # noqa: E402
from functional_offload.activations.testing import copy_on_cpu  # noqa: E402

GiB = 2 ** 30


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int, **kw):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, **kw), torch.nn.LayerNorm(d, **kw)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d, **kw), torch.nn.Linear(d, d, **kw)
        self.fc, self.out = torch.nn.Linear(d, 4 * d, **kw), torch.nn.Linear(4 * d, d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, blocks: int, heads: int, seq: int, **kw):
        super().__init__()
        self.tok_emb, self.pos_emb = torch.nn.Embedding(vocab, d, **kw), torch.nn.Embedding(seq, d, **kw)
        self.blocks = torch.nn.ModuleList(Block(d, heads, **kw) for _ in range(blocks))
        self.ln_f, self.head = torch.nn.LayerNorm(d, **kw), torch.nn.Linear(d, vocab, bias=False, **kw)

    def forward(self, tokens: torch.Tensor, block_fn=None) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok_emb(inputs) + self.pos_emb.weight[: inputs.shape[1]]
        for b in self.blocks:
            x = block_fn(b, x) if block_fn else b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def saved_bytes(fn) -> int:
    """Bytes of the storages a forward saves for backward, each once (the CPU's memory proxy)."""
    seen = {}

    def pack(t):
        if not (isinstance(t, torch.nn.Parameter) or t.is_leaf and t.requires_grad):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def run_system(args: argparse.Namespace) -> dict:
    """One system, in this (fresh) process."""
    device = torch.device(args.device)
    if not args.nondeterministic:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # no extra writes to time
    torch.manual_seed(0)
    kw = dict(device=device, dtype=torch.bfloat16)
    model = GPT(args.vocab, args.d, args.blocks, args.heads, args.seq, **kw)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(args.vocab, (args.tokens // args.seq, args.seq + 1), generator=g).to(device)
    name, off, kind = args.system, None, args.system.split(":")[0]
    if kind in ("ours", "budget"):
        with copy_on_cpu() if device.type == "cpu" else contextlib.nullcontext():  # smoke runs
            off = ActivationOffload(args.blocks, int(name.split(":")[1]), min_bytes=1 << 20) \
                if kind == "ours" else ActivationOffload(args.blocks, budget_bytes=args.budget,
                                                         min_bytes=1 << 20)
        off.wrap(model.blocks)
    elif kind == "te":  # TransformerEngine's own: the first K blocks' activations offloaded
        try:
            from transformer_engine.pytorch import get_cpu_offload_context
        except Exception as e:  # no TE (on a CPU-only machine its import raises RuntimeError)
            raise SystemExit(f"{name} needs TransformerEngine: {type(e).__name__}: {e}") from e
        te_context, te_sync = get_cpu_offload_context(
            enabled=True, num_layers=int(name.split(":")[1]), model_layers=args.blocks)

        def te_block(b: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            with te_context:
                x = b(x)
            return te_sync(x)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if kind == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
                loss = model(tokens)
        elif kind == "checkpoint":
            loss = model(tokens, lambda b, x: torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False))
        elif kind == "te":
            loss = model(tokens, te_block)
        elif off is not None:
            with off.record(exclude=model):
                loss = model(tokens)
        else:
            loss = model(tokens)
        loss.backward()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup + (5 if kind == "budget" else 0)):  # profile, check the peak
        step()
    model.zero_grad(set_to_none=True)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    moved0 = off.stats["offloaded_bytes"] if off else 0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    row = {"system": name, "step_s": statistics.median(times), "times": times,
           "peak_bytes": torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None,
           "model_bytes": base, "budget_bytes": args.budget or None,
           "grads": {n: hashlib.blake2b(p.grad.view(torch.uint8).cpu().numpy().tobytes(),
                                        digest_size=16).hexdigest()
                     for n, p in model.named_parameters()}}
    if off is not None:
        row["moved_bytes"] = (off.stats["offloaded_bytes"] - moved0) / args.steps
        row["stats"] = off.stats
        if off.plan is not None:
            row["plan"], row["decisions"] = str(off.plan), list(off.plan.decisions)
            row["predicted_peak"], row["predicted_step_s"] = off.plan.peak_bytes, off.plan.step_s
    if device.type == "cpu" and kind in ("none", "checkpoint"):
        fwd = (lambda: model(tokens)) if kind == "none" else (lambda: model(
            tokens, lambda b, x: torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)))
        row["peak_proxy"] = saved_bytes(fwd)
    return row


def parse_budget(spec: str, rows: dict) -> int:
    def peak(system: str) -> int:
        r = rows[system]
        return r["peak_bytes"] if r["peak_bytes"] is not None else r["peak_proxy"]
    if spec == "ckpt":
        return peak("checkpoint")
    for unit, mult in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 1024)):
        if spec.endswith(unit):
            return int(float(spec[:-len(unit)]) * mult)
    return int(float(spec) * peak("none"))


def d2h_rate(nbytes: int = 1 << 30) -> float:
    """Pinned device-to-host copy rate in GB/s (median of 5 copies of ``nbytes``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def report(rows: list[dict], args: argparse.Namespace, pcie: float | None) -> None:
    none = rows[0]
    gib = lambda b: f"{b / GiB:.2f}" if b is not None else "n/a"  # noqa: E731
    print(f"\nGPT decoder: d={args.d}, {args.blocks} blocks, {args.heads} heads, vocab {args.vocab}, "
          f"{args.tokens} tokens ({args.tokens // args.seq} x {args.seq}), bf16, {args.device}; "
          f"median of {args.steps} steps" + (f"; pinned D2H {pcie:.1f} GB/s" if pcie else ""))
    print(f"{'system':<16} {'step s':>8} {'pred s':>7} {'x none':>7} {'peak GiB':>9} "
          f"{'pred GiB':>9} {'% none':>7} {'budget':>7} {'GB moved':>9} {'waits':>6} {'grads':>6}"
          "  plan")
    for r in rows:
        same = r["grads"] == none["grads"]
        pct = f"{100 * r['peak_bytes'] / none['peak_bytes']:.0f}" if r["peak_bytes"] else "n/a"
        dec = r.get("decisions") or []
        summary = " ".join(f"{d}={dec.count(d)}" for d in dict.fromkeys(dec))
        waits = r["stats"]["waits"] if "stats" in r else "-"
        moved = f"{r['moved_bytes'] / 1e9:.2f}" if "moved_bytes" in r else "-"
        pred = f"{r['predicted_step_s']:.3f}" if "predicted_step_s" in r else "-"
        print(f"{r['system']:<16} {r['step_s']:>8.3f} {pred:>7} {r['step_s'] / none['step_s']:>7.2f} "
              f"{gib(r['peak_bytes']):>9} {gib(r.get('predicted_peak')):>9} {pct:>7} "
              f"{gib(r['budget_bytes']):>7} {moved:>9} {waits:>6} {'same' if same else 'DIFF':>6}"
              f"  {summary}")
    by = {r["system"]: r for r in rows}
    if none["peak_bytes"] is None:
        return
    print("\ntargets:")
    for r in rows:
        name, ok = r["system"], lambda c: "met" if c else "NOT met"  # noqa: E731
        if name.startswith("ours:") and r.get("moved_bytes"):
            cut = none["peak_bytes"] - r["peak_bytes"]
            print(f"  {name}: peak cut {cut / GiB:.2f} GiB >= 80% of {r['moved_bytes'] / GiB:.2f} "
                  f"GiB offloaded: {ok(cut >= 0.8 * r['moved_bytes'])}")
        if name.startswith("budget:"):
            within = r["peak_bytes"] <= 1.05 * r["budget_bytes"]
            if name == "budget:ckpt" and "checkpoint" in by:
                fast = r["step_s"] <= 0.9 * by["checkpoint"]["step_s"]
                print(f"  {name}: peak <= budget + 5%: {ok(within)}; step <= 0.9x checkpoint "
                      f"({r['step_s'] / by['checkpoint']['step_s']:.2f}x): {ok(fast)}")
            else:
                fast = r["step_s"] <= 1.3 * none["step_s"]
                print(f"  {name}: peak <= budget + 5%: {ok(within)}; step <= 1.3x none "
                      f"({r['step_s'] / none['step_s']:.2f}x): {ok(fast)}")
    print(f"  grads bit-identical to none: {ok(all(r['grads'] == none['grads'] for r in rows))}")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    placed: list[tuple[float, float]] = []  # labelled points, to stack labels of close ones
    for r in rows:
        x = r["peak_bytes"] if r["peak_bytes"] is not None else r.get(
            "peak_proxy", r.get("predicted_peak"))
        if x is None:
            continue
        pt = (x / GiB, r["step_s"])
        near = sum(abs(pt[0] - a) < 1.5 and abs(pt[1] - b) < 0.05 for a, b in placed)
        placed.append(pt)
        ax.scatter(*pt, s=30)
        ax.annotate(r["system"], pt, textcoords="offset points", xytext=(6, 4 - 11 * near),
                    fontsize=8)
    ax.set_xlabel("peak memory above the model, GiB" if rows[0]["peak_bytes"] is not None
                  else "saved bytes (none, checkpoint) or the plan's predicted peak, GiB "
                  "(CPU: memory not measured)")
    ax.set_ylabel("step time (forward + backward), s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--counts", default=None, help="ours:K systems, e.g. '12,23' (default: half, all but one)")
    ap.add_argument("--budgets", default="ckpt,0.5,0.25", help="budget:B systems")
    ap.add_argument("--systems", default=None, help="a comma list to run instead of all")
    ap.add_argument("--nondeterministic", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("--system", help=argparse.SUPPRESS)  # a child process runs one system
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.system:
        with open(args.result, "w") as f:
            json.dump(run_system(args), f)
        return
    counts = args.counts or f"{args.blocks // 2},{args.blocks - 1}"
    systems = args.systems.split(",") if args.systems else (
        ["none", "checkpoint", "save_on_cpu"] + [f"ours:{k}" for k in counts.split(",")]
        + [f"budget:{b}" for b in args.budgets.split(",")])
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    rows: dict[str, dict] = {}
    child = [f"--{k}={getattr(args, k)}" for k in ("device", "d", "blocks", "heads", "vocab", "seq",
                                                     "tokens", "steps", "warmup")]
    child += ["--nondeterministic"] if args.nondeterministic else []
    with tempfile.TemporaryDirectory() as tmp:
        for name in systems:
            try:
                budget = parse_budget(name.split(":", 1)[1], rows) if ":" in name and \
                    name.startswith("budget:") else 0
            except KeyError as e:
                print(f"[{name}] skipped: its budget refers to {e}, which did not run")
                continue
            result = os.path.join(tmp, "row.json")
            cmd = [sys.executable, os.path.abspath(__file__), *child, "--system", name,
                   "--budget", str(budget), "--result", result]
            print(f"[{name}] ...", flush=True)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"[{name}] failed:\n{proc.stderr[-4000:]}", flush=True)
                continue
            with open(result) as f:
                rows[name] = json.load(f)
            print(f"[{name}] step {rows[name]['step_s']:.3f} s" + (
                f"\n{rows[name]['plan']}" if "plan" in rows[name] else ""), flush=True)
    ordered = list(rows.values())
    if not ordered or ordered[0]["system"] != "none":
        sys.exit("the none system is the reference: run it first (--systems none,...)")
    pcie = None
    if args.device == "cuda":
        pcie = d2h_rate()
    report(ordered, args, pcie)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "pcie_gbs": pcie, "rows": ordered}, f, indent=1)
    if args.plot:
        plot(ordered, args.plot, f"GPT d={args.d}, {args.blocks} blocks, {args.tokens} tokens")


if __name__ == "__main__":
    main()
