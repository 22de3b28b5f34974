"""Our optimizer and training step, built in one place for every benchmark script.

:func:`build_ours` is the only code in ``benchmarks/`` that constructs a functional_offload
optimizer for a training loop and runs its step (``offload_step.py`` and ``fsdp2_step.py`` use
it); when the streaming or step API changes, this is the function to adapt. Imported, not run.

Modes: ``plain`` (``loss.backward()``, then ``opt.update({path: p.grad}, state)``), ``stream``
(``with fo.stream(opt, state) as s: loss.backward()``, then ``s.finish()``), ``delayed``
(``fo.adamw(..., delayed=True)``: every step in flight, with the look-ahead; :attr:`Ours.flush`
lands the last step). With ``clip`` the optimizer is ``fo.chain(fo.clip_by_global_norm(1.0),
adamw)``.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, NamedTuple, Optional

import torch

# FUNCTIONAL_OFFLOAD_PATH: run "ours" from another checkout of the library (an A/B of versions)
sys.path.insert(0, os.environ.get("FUNCTIONAL_OFFLOAD_PATH")
                or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import functional_offload as fo  # noqa: E402

if os.path.dirname(os.path.dirname(os.path.abspath(fo.__file__))) != os.path.abspath(sys.path[0]):
    raise ImportError(f"ours.py must be imported before functional_offload: {fo.__file__} was "
                      f"imported, not the library in {sys.path[0]}")
from functional_offload.executor import HostExecutor, Timeline, physical_cores  # noqa: E402

__all__ = ["HYPER", "LION_BETAS", "MODES", "Ours", "Timeline", "build_ours", "fo"]

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MODES = ("plain", "stream", "delayed")
LION_BETAS = (0.9, 0.99)
MOMENTS = {"": torch.float32, "16": torch.bfloat16, "8": torch.uint8}  # a system name's suffix


def moments_of(name: str) -> str:
    """The suffix of a system's name that picks its moments' dtype (a key of :data:`MOMENTS`)."""
    return next((m for m in MOMENTS if m and name.endswith(m)), "")


class Ours(NamedTuple):
    step: Callable[[Callable[[], torch.Tensor]], torch.Tensor]  # step(loss_fn): forward, backward,
    # update; the loss, detached
    flush: Callable[[], None]  # land a delayed update still in flight (a no-op otherwise)
    executor: HostExecutor
    offloaded: int  # elements whose state lives in host memory (this rank's shards)
    host_state_bytes: int  # bytes of state (masters, moments) in host memory
    ahead: dict  # streamed steps with clipping: {"kept": n, "redone": n, "held": n}
    state: Callable[[], Any]  # the optimizer's current state


def _elements(row: dict, params: dict, field: str) -> int:
    """The elements of the leaf a report row's state ``field`` belongs to (an 8-bit moment's
    shape is its bytes)."""
    parts = row["path"].split(".")
    leaf = params.get(".".join(parts[parts.index(field) + 1:]))
    return leaf.numel() if leaf is not None else math.prod(row["shape"])


def build_ours(mode: str, params: dict[str, torch.Tensor], fraction: float, *,
               clip: Optional[float] = 1.0, lr: Any = None, delay: Optional[fo.Delay] = None,
               moments: torch.dtype = torch.float32, remainders: bool = False, optimizer: str = "adamw",
               threads: Optional[int] = None, chunk_mb: int = 32,
               slots: int = 4, engine: str = "cpu", gpu_share: Optional[float] = None,
               engine_chunk_mb: Optional[int] = None,
               timeline: Optional[Timeline] = None,
               norms: Optional[list] = None, shadow: Optional[list] = None) -> Ours:
    """Our AdamW (:data:`HYPER`) over the live ``params`` (e.g. ``dict(model.named_parameters())``:
    tensors that require grad), with ``fraction`` of the elements' state in host memory.

    ``threads`` defaults to the library's choice (physical cores; one fewer for ``delayed``, whose
    host step runs beside the training loop). ``moments``: the moments' dtype (``torch.bfloat16``;
    ``torch.uint8``: block-wise 8-bit; fp32 masters kept either way); ``remainders``:
    ``store_param_remainders=True``; ``optimizer``: ``"adamw"``, ``"lion"`` or ``"adafactor"``
    (torch's defaults, no moments); ``lr``: a float or schedule in place of the optimizer's
    default here; ``delay``: the policy of mode ``delayed`` (default ``fo.Delay()``: every step
    delayed, with the look-ahead); ``engine``, ``gpu_share``: the executor's (``"gpu"``: plain
    steps run the host-resident state's math on the GPU; ``"both"``: divided between the GPU and
    the CPU kernel), ``engine_chunk_mb`` the GPU engine's chunks (default: the executor's, 128 MiB);
    ``norms``: a list that plain and delayed steps append their grads' global norm to (a device
    tensor; no sync). ``shadow`` (a diagnostic of mode ``delayed``): a list that each step appends
    a device tensor to, ``[sum |p - m|, sum |bf16(m) - m|, sum |m - m_before|, count(p != bf16(m))]``
    over all elements, where ``p`` are the params the next forward reads and ``m`` the fp32
    params of an exact AdamW (``torch.optim.AdamW(fused=True)`` on fp32 copies on the device,
    the same hyperparameters and schedule) fed the same clipped grads (scaled in the grads'
    dtype, as our clip scales them): how far the look-ahead lands from the exact step, against
    the rounding every bf16 param has and the step itself."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    delayed = mode == "delayed"
    delay = (delay or fo.Delay()) if delayed else False
    threads = threads or (max(1, physical_cores() - 1) if delayed else physical_cores())
    ex = HostExecutor(chunk_bytes=chunk_mb << 20, slots=slots, threads=threads, timeline=timeline,
                      engine=engine, gpu_share=gpu_share,
                      engine_chunk_bytes=None if engine_chunk_mb is None else engine_chunk_mb << 20)
    fields = {"adamw": ("mu", "nu"), "lion": ("mu",)}.get(optimizer, ())
    formats = {} if moments == torch.float32 else {f"{f}_dtype": moments for f in fields}
    formats["store_param_remainders"] = remainders
    where = fo.placement.offload_fraction(fraction)
    if optimizer == "lion":  # Lion's usual settings: lr 10x smaller, decay 10x larger than AdamW's
        opt = fo.lion(lr or HYPER["lr"] / 10, betas=LION_BETAS, weight_decay=HYPER["weight_decay"] * 10,
                      placement=where, executor=ex, delayed=delay, **formats)
    elif optimizer == "adafactor":
        if delayed or formats != {"store_param_remainders": False}:
            raise ValueError("adafactor has no delayed mode, moments or remainders")
        opt = fo.adafactor(**({"lr": lr} if lr else {}), placement=where, executor=ex)
    else:
        opt = fo.adamw(placement=where, executor=ex, delayed=delay, **formats,
                       **{**HYPER, **({"lr": lr} if lr else {})})
    if clip:
        opt = fo.chain(fo.clip_by_global_norm(clip), opt)
    holder = [opt.init(params)]
    report = fo.placement_report(holder[0])
    field = fields[0] if fields else "master"  # one row per leaf (adafactor: bf16 params)
    offloaded = sum(_elements(r, params, field) for r in report.rows
                    if r["device"] == "cpu" and field in r["path"].split("."))

    ahead = {"kept": 0, "redone": 0, "held": 0}
    device = next(iter(params.values())).device
    if shadow is not None:
        if mode != "delayed" or optimizer != "adamw":
            raise ValueError("shadow measures the delayed AdamW's landing")
        exact = [p.detach().float().clone() for p in params.values()]
        hyper = {**HYPER, **({"lr": lr} if lr else {})}
        rate = hyper.pop("lr")
        shadow_opt = torch.optim.AdamW(exact, lr=0.0, fused=True, **hyper)

    def mark() -> Any:  # a point on the compute stream, for the timeline's forward/backward lane
        return timeline.stamp(device) if timeline is not None else None

    def now() -> Any:  # a point on the host clock, for the timeline's lane of the calls
        return timeline.stamp(torch.device("cpu")) if timeline is not None else None

    def step(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        h0, t0 = now(), mark()
        loss = loss_fn()
        h1, t1 = now(), mark()
        if mode == "stream":
            with fo.stream(opt, holder[0]) as s:
                loss.backward()
                t2 = mark()
            _, holder[0] = s.finish()
            ahead[{True: "kept", False: "redone", None: "held"}[s.committed]] += 1
        else:
            loss.backward()
            h2, t2 = now(), mark()
            grads = {k: p.grad for k, p in params.items()}
            norm = fo.global_norm(grads) if norms is not None or shadow is not None else None
            if norms is not None:
                norms.append(norm)
            if shadow is not None:
                before = [x.clone() for x in exact]
                factor = torch.clamp(clip / (norm + 1e-6), max=1.0) if clip else 1.0
                for x, g in zip(exact, grads.values()):  # scaled in the grads' dtype, as ours
                    x.grad = (g * factor).float()
                shadow_opt.param_groups[0]["lr"] = rate(len(shadow)) if callable(rate) else rate
                shadow_opt.step()
            _, holder[0] = opt.update(grads, holder[0])
            h3, t3 = now(), mark()
            if shadow is not None:
                ps = [p.detach().float() for p in params.values()]
                rounded = [x.bfloat16().float() for x in exact]
                shadow.append(torch.stack([
                    sum(torch._foreach_norm(torch._foreach_sub(ps, exact), 1)),
                    sum(torch._foreach_norm(torch._foreach_sub(rounded, exact), 1)),
                    sum(torch._foreach_norm(torch._foreach_sub(exact, before), 1)),
                    sum((p != r).sum() for p, r in zip(ps, rounded)).float()]))
        if timeline is not None:
            timeline.span("GPU fwd/bwd", "forward", t0, t1)
            timeline.span("GPU fwd/bwd", "backward", t1, t2)
            if mode != "stream":  # what the update queued on the compute stream, and the calls
                timeline.span("GPU fwd/bwd", "update", t2, t3)
                for name, a, b in (("forward", h0, h1), ("backward", h1, h2), ("update", h2, h3)):
                    timeline.span("calls (host)", name, a, b)
        for p in params.values():
            p.grad = None
        return loss.detach()

    def flush() -> None:
        fo.flush(holder[0])

    return Ours(step, flush, ex, offloaded, report.host_bytes, ahead, lambda: holder[0])
