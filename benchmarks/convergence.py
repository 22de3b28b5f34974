"""Loss curves on real text for every mode of our optimizers against torch's, each run in a
fresh process: the same init, batches and schedule everywhere.

    python benchmarks/convergence.py --out conv                 # every run, then the table and plot
    python benchmarks/convergence.py --runs torch,plain,delayed --jobs 2 --out conv   # a subset
    python benchmarks/convergence.py --table conv --plot docs/img/convergence.png     # saved runs
    python benchmarks/convergence.py --smoke --out /tmp/conv     # a tiny model on the CPU
    python benchmarks/convergence.py --model small --steps 400 --batch 16 --device cpu \
        --runs torch,delayed,stale,warmstale --seed 1 --jobs 2 --out small   # the CPU comparison

Data: the Python standard library's own ``.py`` sources on this machine (text nobody here wrote;
no download), bytes as tokens (a vocabulary of 256, a multiple of 128); every 20th file in sorted
order is held out for validation. Model (``--model``, :data:`MODELS`): ``gpt.py``'s GPT-style
decoder with d=896, 12 layers, 14 heads, context 1,024 (116.9 M params, 148 leaves; ``small``:
d=128, 4 layers, context 128, 0.84 M params, for the CPU), bf16 params (on the CPU too).
Training: ``--batch`` sequences of the context a step (8 x 1,024 tokens), warm-up (5% of the
steps) and cosine to 10% of the peak (AdamW 6e-4, ``small`` 3e-3; betas (0.9, 0.95), weight
decay 0.1), ``clip_by_global_norm(1.0)`` (on a fresh model it scales the first steps' grads).
``--seed`` picks the init and the batches (the same in every run of one seed). Deterministic
algorithms are on, so the same run twice gives the same losses bit for bit.

Runs (``RUNS``): the references ``torch`` (``torch.optim.AdamW(fused=True)`` on fp32 masters on
the GPU, the bf16 params copied from them), ``lion_torch`` (Lion by hand on fp32 masters) and
``adafactor_torch`` (``torch.optim.Adafactor`` on fp32 masters); ours in every mode through
``ours.build_ours``. ``--jobs J`` runs J processes at once, each with cores / J host threads
(the step times are then those of a shared box). Each run writes ``OUT/NAME.json`` as it goes
(losses, validation losses, step times), so a run cut short leaves its curve so far.

The table: per run, its reference, the largest |loss - reference loss| over the steps (and at
which step), whether its losses equal another run's bit for bit where the docs say they do,
the final validation loss (after the last update landed) and its difference to the reference's,
the median and mean step. The validation losses before the last are taken at the params the next
forward reads (a delayed run's: its look-ahead's, or one update behind without one).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from typing import Callable, NamedTuple, Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA)
import torch  # noqa: E402

import gpt  # noqa: E402
from ours import HYPER, LION_BETAS, build_ours, fo  # noqa: E402
from functional_offload.executor import physical_cores  # noqa: E402

MODELS = {  # name -> (config, AdamW's peak learning rate)
    "117m": (gpt.GPTConfig(d=896, layers=12, heads=14, vocab=256, ctx=1024), 6e-4),
    "small": (gpt.GPTConfig(d=128, layers=4, heads=4, vocab=256, ctx=128), 3e-3),
    "mid": (gpt.GPTConfig(d=256, layers=6, heads=8, vocab=256, ctx=256), 1.5e-3),  # 4.9 M: CPU, longer
    "smoke": (gpt.GPTConfig(d=160, layers=1, heads=2, vocab=256, ctx=32), 6e-4),  # leaves past 2^16: 8-bit
}
CLIP = 1.0
PEAKS = {"adamw": 1.0, "lion": 0.1, "adafactor": 1e-2 / 6e-4}  # x AdamW's (Lion: ours.build_ours's lr / 10)


class Run(NamedTuple):
    what: str
    reference: Optional[str]  # the run its loss is compared with
    same_as: Optional[str] = None  # a run whose losses it must equal bit for bit


RUNS: dict[str, Run] = {
    "torch": Run("torch.optim.AdamW(fused=True), fp32 masters on the GPU", None),
    "jitter": Run("torch.optim.AdamW(fused=True) as torch, its params rounded twice: bf16(bf16(m) + "
                  "step), the double rounding of the look-ahead's landing (a diagnostic)", "torch"),
    "torch_foreach": Run("torch.optim.AdamW(foreach=True), fp32 masters on the GPU: torch's other "
                         "kernel, which rounds differently (the spread of exact runs)", "torch"),
    "device": Run("ours, all state on the GPU", "torch"),
    "plain": Run("ours, all state on the host, plain update", "torch"),
    "stream": Run("ours, host, fo.stream (runs ahead; redone when the clip scales)", "torch", "plain"),
    "partial": Run("ours, half the state on the host (offload_fraction(0.5))", "torch"),
    "delayed": Run("ours, host, delayed=True (fo.Delay(): every step delayed, with the look-ahead)",
                   "torch"),
    "stale": Run("ours, host, every step delayed, no look-ahead (fo.Delay(lookahead=False): "
                 "one-step-stale gradients)", "torch"),
    "delayedclip": Run("ours, host, the look-ahead, exact steps when the clip scales "
                       "(fo.Delay(exact_when_clipped=True))", "torch"),
    "warmstale": Run("ours, host, no look-ahead, 100 exact warm-up steps and exact steps when the "
                     "clip scales (fo.Delay(lookahead=False, warmup=100, exact_when_clipped=True))",
                     "torch"),
    "bf16": Run("ours, host, bf16 moments", "torch"),
    "r": Run("ours, host, split master (store_param_remainders=True)", "torch"),
    "r16": Run("ours, host, split master + bf16 moments", "torch"),
    "q8": Run("ours, host, block-wise 8-bit moments", "torch"),
    "r8": Run("ours, host, split master + 8-bit moments", "torch"),
    "delayedr8": Run("ours, host, delayed=True (the look-ahead), split master + 8-bit moments",
                     "torch"),
    "delayedshadow": Run("ours, host, delayed=True, with an exact AdamW beside it on the same "
                         "grads measuring how far each landing is from the exact step", "torch",
                         "delayed"),
    "lion_torch": Run("Lion by hand in torch, fp32 masters on the GPU", None),
    "lion": Run("ours, fo.lion, host", "lion_torch"),
    "adafactor_torch": Run("torch.optim.Adafactor, fp32 masters on the GPU", None),
    "adafactor": Run("ours, fo.adafactor, host", "adafactor_torch"),
}
# name -> build_ours's (mode, fraction, keywords)
OURS: dict[str, tuple[str, float, dict]] = {
    "device": ("plain", 0.0, {}),
    "plain": ("plain", 1.0, {}),
    "stream": ("stream", 1.0, {}),
    "partial": ("plain", 0.5, {}),
    "delayed": ("delayed", 1.0, {"delay": fo.Delay()}),
    "stale": ("delayed", 1.0, {"delay": fo.Delay(lookahead=False)}),
    "delayedclip": ("delayed", 1.0, {"delay": fo.Delay(exact_when_clipped=True)}),
    "warmstale": ("delayed", 1.0, {"delay": fo.Delay(lookahead=False, warmup=100, exact_when_clipped=True)}),
    "bf16": ("plain", 1.0, {"moments": torch.bfloat16}),
    "r": ("plain", 1.0, {"remainders": True}),
    "r16": ("plain", 1.0, {"moments": torch.bfloat16, "remainders": True}),
    "q8": ("plain", 1.0, {"moments": torch.uint8}),
    "r8": ("plain", 1.0, {"moments": torch.uint8, "remainders": True}),
    "delayedr8": ("delayed", 1.0, {"delay": fo.Delay(), "moments": torch.uint8, "remainders": True}),
    "delayedshadow": ("delayed", 1.0, {"delay": fo.Delay()}),
    "lion": ("plain", 1.0, {"optimizer": "lion"}),
    "adafactor": ("plain", 1.0, {"optimizer": "adafactor"}),
}


def corpus(smoke: bool) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train, validation) bytes of the standard library's ``.py`` files (every 20th file held
    out) and a digest of both, so runs on different machines can be told apart."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f)
    if smoke:
        files = files[:60]
    parts: tuple[list, list] = ([], [])
    for i, f in enumerate(files):
        with open(f, "rb") as fh:
            parts[i % 20 == 0].append(fh.read())
    train, val = (b"".join(p) for p in parts)
    digest = hashlib.sha256(train + val).hexdigest()[:12]
    as_ids = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return as_ids(train), as_ids(val), digest


def schedule(peak: float, steps: int) -> Callable[[int], float]:
    """Linear warm-up over 5% of the steps, then cosine to 10% of ``peak`` at ``steps``."""
    return fo.schedules.warmup_cosine(peak, max(1, steps // 20), steps, end=peak / 10)


class Reference(NamedTuple):
    step: Callable[[Callable[[], torch.Tensor]], torch.Tensor]
    flush: Callable[[], None]
    norms: list


def _bases(opt: torch.optim.AdamW, masters: list, rate: float) -> list:
    """The look-ahead's bases for the step about to run (``jitter``): each master decayed, less
    its momentum term over the last step's denominator (``optimizers/adam.py``'s ``ahead``)."""
    b1, b2 = HYPER["betas"]
    out = []
    for m in masters:
        st = opt.state.get(m)
        x = m * (1 - rate * HYPER["weight_decay"])
        if st:
            k = int(st["step"])  # steps taken: the next is k + 1
            d = (st["exp_avg_sq"] / (1 - b2 ** k)).sqrt() + HYPER["eps"]
            x = x - rate / (1 - b1 ** (k + 1)) * b1 * st["exp_avg"] / d
        out.append(x)
    return out


def reference(name: str, model: torch.nn.Module, lr: Callable[[int], float]) -> Reference:
    """A torch optimizer on fp32 masters beside the model's params: ``clip_grad_norm_`` on the
    params' grads (as ``fo.clip_by_global_norm`` in front of ours), the grads copied to the
    masters, the step, the params copied from the masters."""
    ps = list(model.parameters())
    masters = [p.detach().to(torch.float32, copy=True) for p in ps]
    for m in masters:
        m.grad = torch.empty_like(m)
    wd = HYPER["weight_decay"]
    if name in ("torch", "torch_foreach", "jitter"):
        kernel = {"foreach": True} if name == "torch_foreach" else {"fused": True}
        opt = torch.optim.AdamW(masters, lr=lr(0), betas=HYPER["betas"], eps=HYPER["eps"],
                                weight_decay=wd, **kernel)
    elif name == "adafactor_torch":
        opt = torch.optim.Adafactor(masters, lr=lr(0))
    else:
        opt = None
        moms = [torch.zeros_like(m) for m in masters]
    norms: list = []
    t = [0]

    def step(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        loss = loss_fn()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ps, CLIP, foreach=True))
        torch._foreach_copy_([m.grad for m in masters], [p.grad for p in ps])
        rate = lr(t[0])
        with torch.no_grad():
            if opt is None:  # Lion (Chen et al. 2023): decoupled decay, sign of the interpolation
                b1, b2 = LION_BETAS
                for m, mom in zip(masters, moms):
                    m.mul_(1 - rate * wd * 10)
                    m.add_(torch.sign(mom * b1 + m.grad * (1 - b1)), alpha=-rate)
                    mom.mul_(b2).add_(m.grad, alpha=1 - b2)
            else:
                bases = _bases(opt, masters, rate) if name == "jitter" else None
                for group in opt.param_groups:
                    group["lr"] = rate
                opt.step()
            if name == "jitter":  # rounded twice, as a look-ahead's exact landing would be
                torch._foreach_copy_(ps, [b.bfloat16().float() + (m - b) for m, b in zip(masters, bases)])
            else:
                torch._foreach_copy_(ps, masters)
        for p in ps:
            p.grad = None
        t[0] += 1
        return loss.detach()

    return Reference(step, lambda: None, norms)


def validation_loss(model: torch.nn.Module, val: torch.Tensor, cfg: gpt.GPTConfig,
                    sequences: int) -> float:
    """The mean loss over ``sequences`` windows spread evenly over the held-out bytes."""
    starts = torch.linspace(0, len(val) - cfg.ctx - 2, sequences).long().tolist()
    with torch.no_grad():
        x = torch.stack([val[s:s + cfg.ctx] for s in starts]).long()
        y = torch.stack([val[s + 1:s + cfg.ctx + 1] for s in starts]).long()
        losses = [gpt.loss(model, x[i:i + 8], y[i:i + 8]).item() for i in range(0, sequences, 8)]
    return sum(losses) / len(losses)


def run_one(name: str, args: argparse.Namespace) -> dict:
    """Train ``name`` for ``args.steps`` steps; its record (also written to ``OUT/name.json``
    every ``args.save_every`` steps and at the end). Deterministic algorithms are on meanwhile
    (the same run twice gives the same bits: embedding backward without atomics, so modes that
    are bit-identical can be checked as such), and ``args.threads`` intra-op threads."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(name, args)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(name: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    cfg, peak = MODELS[args.model]
    train, val, digest = corpus(args.model == "smoke")
    train, val = train.to(device), val.to(device)
    model = gpt.build(cfg, device, torch.bfloat16, seed=args.seed)
    kind = "lion" if name.startswith("lion") else "adafactor" if name.startswith("adafactor") else "adamw"
    lr = schedule(PEAKS[kind] * peak, args.steps)
    params = dict(model.named_parameters())
    record: dict = {"run": name, "what": RUNS[name].what, "model": args.model, "seed": args.seed,
                    "params": gpt.count_params(model),
                    "leaves": gpt.count_leaves(model), "data": digest, "steps": args.steps,
                    "tokens_per_step": args.batch * cfg.ctx, "threads": args.threads}
    ahead = shadow = None
    if name in OURS:
        mode, fraction, kw = OURS[name]
        norms: list = []
        shadow = [] if name == "delayedshadow" else None
        ours = build_ours(mode, params, fraction, clip=CLIP, lr=lr, threads=args.threads,
                          norms=norms, shadow=shadow, **kw)
        step, flush, ahead = ours.step, ours.flush, ours.ahead
        record.update(offloaded=ours.offloaded, host_state_bytes=ours.host_state_bytes)
        delay = kw.get("delay", fo.Delay() if mode == "delayed" else None)
    else:
        step, flush, norms = reference(name, model, lr)
        delay = None
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    starts = torch.randint(len(train) - cfg.ctx - 1, (args.steps, args.batch), generator=g).to(device)
    offsets = torch.arange(cfg.ctx, device=device)
    losses: list = []
    vals: list = []
    times: list = []
    start = time.perf_counter()

    def save(final: bool) -> None:
        record["loss"] = torch.stack(losses).float().tolist() if losses else []
        record["val"] = vals
        if times:
            record.update(step_median_s=statistics.median(times), step_mean_s=statistics.mean(times))
        if norms:
            n = torch.stack(norms).float().tolist()
            clipped = [x + 1e-6 > CLIP for x in n]  # clip_grad_norm_'s factor below 1
            record["clipped_steps"] = sum(clipped)
            if delay is not None:  # the policy's exact steps (fo.Delay's rules)
                record["exact_steps"] = sum(t < delay.warmup or (delay.exact_when_clipped and c)
                                            for t, c in enumerate(clipped))
        if ahead is not None:
            record["ahead"] = dict(ahead)
        if shadow:
            record["shadow"] = torch.stack(shadow).tolist()  # per step: see ours.build_ours
        record["done"] = final
        if args.out:
            with open(os.path.join(args.out, name + ".json"), "w") as f:
                json.dump(record, f)

    for t in range(args.steps):
        x = starts[t][:, None] + offsets

        def loss_fn(x: torch.Tensor = x) -> torch.Tensor:
            return gpt.loss(model, train[x].long(), train[x + 1].long())

        t0 = time.perf_counter()
        losses.append(step(loss_fn))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        times.append(time.perf_counter() - t0)
        if (t + 1) % args.eval_every == 0 and t + 1 < args.steps:
            vals.append([t + 1, validation_loss(model, val, cfg, args.val_sequences)])
        if (t + 1) % args.save_every == 0:
            save(False)
    flush()
    record["wall_s"] = time.perf_counter() - start
    vals.append([args.steps, validation_loss(model, val, cfg, args.val_sequences)])
    record["final_val"] = vals[-1][1]
    save(True)
    return record


def launch(names: list[str], args: argparse.Namespace) -> None:
    """Each run in a fresh process, ``args.jobs`` at once, the longest (host) runs first."""
    order = sorted(names, key=lambda n: n not in OURS)
    script = os.path.abspath(__file__)
    running: list = []
    forwarded = ["--steps", str(args.steps), "--batch", str(args.batch), "--device", args.device,
                 "--threads", str(args.threads), "--out", args.out, "--eval-every",
                 str(args.eval_every), "--val-sequences", str(args.val_sequences), "--model",
                 args.model, "--seed", str(args.seed)]
    while order or running:
        while order and len(running) < args.jobs:
            n = order.pop(0)
            log = open(os.path.join(args.out, n + ".log"), "w")
            running.append((n, subprocess.Popen([sys.executable, script, "--one", n, *forwarded],
                                                 stdout=log, stderr=subprocess.STDOUT), log))
            print(f"started {n}", flush=True)
        time.sleep(1)
        for item in list(running):
            n, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                print(f"{n}: exit {proc.returncode}", flush=True)


def load(folder: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            r = json.load(f)
        out[r["run"]] = r
    return out


def table(records: dict[str, dict]) -> list[str]:
    """The comparison table (markdown) of the saved runs."""
    lines = ["| run | what | steps | max abs(loss - ref) (at step) | bit-identical | final val loss "
             "| - ref's | exact steps | median step s | mean step s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        r = records.get(name)
        if r is None:
            continue
        ref = records.get(RUNS[name].reference or "")
        loss = r["loss"]
        dev = "-"
        if ref is not None:
            n = min(len(loss), len(ref["loss"]))
            diffs = [abs(a - b) for a, b in zip(loss[:n], ref["loss"][:n])]
            if diffs:
                i = max(range(n), key=diffs.__getitem__)
                dev = f"{diffs[i]:.2e} ({i})"
        same = RUNS[name].same_as
        ident = "-"
        if same in records:
            other = records[same]["loss"]
            n = min(len(loss), len(other))
            ident = f"{'yes' if loss[:n] == other[:n] else 'no'} (= {same})"
        final = r.get("final_val")
        gap = (f"{final - ref['final_val']:+.4f}" if final is not None and ref is not None
               and ref.get("final_val") is not None else "-")
        exact = r.get("exact_steps", "-")
        steps = f"{len(loss)}" + ("" if r.get("done") else " (cut)")
        fin = f"{final:.4f}" if final is not None else "-"
        lines.append(f"| {name} | {r['what']} | {steps} | {dev} | {ident} | {fin} | {gap} | {exact} "
                     f"| {r.get('step_median_s', math.nan):.4f} | {r.get('step_mean_s', math.nan):.4f} |")
    return lines


def plot(records: dict[str, dict], path: str) -> None:
    """Training loss (a 50-step running mean) of every run, and its difference to the
    reference's, into ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs: list[float], k: int = 50) -> list[float]:
        out, acc = [], 0.0
        for i, x in enumerate(xs):
            acc += x - (xs[i - k] if i >= k else 0.0)
            out.append(acc / min(i + 1, k))
        return out

    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5.5))
    for name, r in records.items():
        if name not in RUNS:
            continue
        style = "-" if RUNS[name].reference is None else "--" if name in ("stale", "warmstale", "delayed", "delayedclip", "delayedr8") else ":"
        a.plot(smooth(r["loss"]), style, label=name, lw=1)
        ref = records.get(RUNS[name].reference or "")
        if ref is not None:
            n = min(len(r["loss"]), len(ref["loss"]))
            b.plot(smooth([x - y for x, y in zip(r["loss"][:n], ref["loss"][:n])]), style, label=name, lw=1)
    a.set(xlabel="step", ylabel="training loss (50-step mean)", ylim=(None, 3.0))
    b.set(xlabel="step", ylabel="loss - its reference's (50-step mean)")
    b.axhline(0.0, color="k", lw=0.5)
    a.legend(fontsize=7, ncol=2)
    b.legend(fontsize=7, ncol=2)
    some = next(iter(records.values()))
    fig.suptitle(f"GPT-style decoder, {some['params'] / 1e6:.1f} M params, {some['tokens_per_step']} "
                 f"byte tokens a step, the Python standard library's sources; clip 1.0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of RUNS")
    ap.add_argument("--one", help="run this one in this process (what --runs launches)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8, help="sequences of 1,024 bytes a step")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="host threads a run (default cores / jobs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--val-sequences", type=int, default=64)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--out", help="folder for the runs' records")
    ap.add_argument("--table", help="print the table of the records in this folder")
    ap.add_argument("--plot", help="with --table: draw the curves into this file")
    ap.add_argument("--model", default="117m", choices=list(MODELS))
    ap.add_argument("--seed", type=int, default=0, help="the init's; the batches' is seed + 1")
    ap.add_argument("--smoke", action="store_true", help="the smoke model, 30 steps, on the CPU")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.device = "smoke", "cpu"
        if args.steps == 2000:
            args.steps = 30
        args.eval_every, args.val_sequences, args.batch = 10, 8, 4
    args.threads = args.threads or max(1, physical_cores() // args.jobs)
    for n in ([args.one] if args.one else args.runs.split(",")) if not args.table else []:
        if n not in RUNS:
            raise SystemExit(f"unknown run {n!r}; choose from {', '.join(RUNS)}")
    return args


def main() -> None:
    args = parse()
    if args.table:
        records = load(args.table)
        print("\n".join(table(records)))
        if args.plot:
            plot(records, args.plot)
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.one:
        r = run_one(args.one, args)
        print(f"{args.one}: final val {r['final_val']:.4f}, median step {r['step_median_s']:.4f} s")
        return
    if not args.out:
        raise SystemExit("--out is needed to run several runs (each writes its record there)")
    launch(args.runs.split(","), args)
    print("\n".join(table(load(args.out))))


if __name__ == "__main__":
    main()
