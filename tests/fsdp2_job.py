"""The 2-rank FSDP2 job behind ``test_fsdp2.py``: every mode of functional_offload trained next
to ``torch.optim`` on the same FSDP2 model, in one process group; each rank saves its results.

Imported by the test (``mp.spawn`` pickles :func:`job` by reference) and run in each spawned
rank. Each mode is an independent run on fresh models built from one seed; a mode that raises
is recorded with its traceback and the job goes on with the next one. Results are this rank's
shards (ours and torch's models are sharded alike), so no collective is spent gathering them.
"""

from __future__ import annotations

import os
import traceback
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import functional_offload as fo
from functional_offload.executor import HostExecutor, default_executor, node_share, physical_cores

WORLD = 2
STEPS = 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIPS = 0.05  # below every step's grad norm (about 1): clipping scales the grads
NO_CLIP = 1e3  # above it: the factor is exactly 1
VOCAB, CTX, D, HEADS, LAYERS = 33, 8, 16, 2, 2  # 33: uneven shards (17 and 16 rows)


class Block(nn.Module):
    """Pre-LN transformer block: SDPA causal attention and a GELU MLP, with biases except on
    ``qkv``: a key bias's grad is pure rounding noise (softmax ignores it), and Adam's normalized
    step turns noise-level differences between two kernels into differences of order lr."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``blocks.N``, a final LayerNorm and a head (every dim 0
    is at least 2, so no rank's shard is empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(mesh: DeviceMesh, device: torch.device, dtype: torch.dtype = torch.float32,
          mp: Optional[MixedPrecisionPolicy] = None) -> TinyGPT:
    """The model from seed 0 (the same values on every rank and in every mode), sharded with
    ``fully_shard`` per block, then the root."""
    torch.manual_seed(0)
    model = TinyGPT().to(device, dtype)
    if mp is not None and mp.param_dtype is not None:  # values the low-precision copy holds exactly
        model.to(mp.param_dtype).to(dtype)
    kw: dict[str, Any] = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def batches(rank: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``(inputs, targets)`` token ids per step (each rank its own data)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = [torch.randint(VOCAB, (2, 4, CTX), generator=g) for _ in range(STEPS)]
    return [(x[0].to(device), x[1].to(device)) for x in ids]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())


def shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every param, copied to the CPU (the oracle's model is sharded the
    same way, so comparing shards rank by rank compares the whole params)."""
    return {n: p.detach().to_local().cpu().clone() for n, p in model.named_parameters()}


def value(t: torch.Tensor) -> torch.Tensor:
    """A 0-d result (norm, factor) as a plain CPU tensor; replicated DTensors hold it whole."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()


# ---- the oracle: torch.optim on the same FSDP2 model ---------------------------------------
def torch_run(mesh: DeviceMesh, device: torch.device, xs: list, clip: Optional[float] = None,
              delayed: bool = False, mp: Optional[MixedPrecisionPolicy] = None) -> dict:
    """torch ``AdamW`` (and ``clip_grad_norm_``): this rank's shards after the steps, the norms.

    ``delayed``: the recursion of the delayed update, p[t+1] = AdamW(p[t], grad at p[t-1]) (and
    the first two grads at p[0]): the grads come from a second model ``lag`` that holds the
    params one step behind."""
    model = build(mesh, device, mp=mp)
    lag = build(mesh, device, mp=mp) if delayed else model
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    norms = []
    for batch in xs:
        loss_of(lag, batch).backward()
        if clip is not None:  # (fo's global norm sums the leaves' norms in the model's order too)
            norms.append(value(torch.nn.utils.clip_grad_norm_(lag.parameters(), clip,
                                                              foreach=True)))
        if delayed:
            with torch.no_grad():
                for p, q in zip(model.parameters(), lag.parameters()):
                    p.grad = q.grad
                    q.grad = None
                    q.copy_(p)  # lag moves to p[t]; model steps to p[t+1]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": shards(model), "lagging": shards(lag), "norms": norms}


# ---- ours ------------------------------------------------------------------------------------
_EXECUTOR: list[HostExecutor] = []


def small_executor() -> HostExecutor:
    """One unpinned worker thread, shared by this rank's runs (the modes that test the default,
    node-aware executor pass ``executor=None``)."""
    if not _EXECUTOR:
        _EXECUTOR.append(HostExecutor(threads=1))
    return _EXECUTOR[0]


def adamw_chain(clip: Optional[float] = None, **options: Any) -> fo.Optimizer:
    """``fo.adamw`` with :data:`HYPER` (torch's CPU kernel unless ``cpu_kernel`` is given: the
    same ops as ``torch.optim.AdamW``, so results can be bit-exact), behind
    ``clip_by_global_norm(clip)`` when ``clip`` is given."""
    options.setdefault("cpu_kernel", "torch")
    options.setdefault("executor", small_executor())
    opt = fo.adamw(**HYPER, **options)
    return opt if clip is None else fo.chain(fo.clip_by_global_norm(clip), opt)


def ours_run(mesh: DeviceMesh, device: torch.device, xs: list, clip: Optional[float] = None, *,
             streamed: bool = False, dtype: torch.dtype = torch.float32,
             mp: Optional[MixedPrecisionPolicy] = None, **options: Any) -> dict:
    """Ours (:func:`adamw_chain`) on the FSDP2 model: this rank's shards before the steps and
    after them (before and after ``fo.flush``) and its state; per step the global grad norm and
    clip factor (plain) or the leaves handed over during backward (streamed); the state bytes
    in host and device memory."""
    model = build(mesh, device, dtype, mp)
    params = dict(model.named_parameters())  # DTensor nn.Parameters: this rank's shards
    start = shards(model)
    opt = adamw_chain(clip, **options)
    state = opt.init(params)
    out: dict[str, Any] = {"arrived": [], "committed": [], "norms": [], "factors": [],
                           "fp32_factors": [], "fp32_norms": []}
    for batch in xs:
        loss = loss_of(model, batch)
        if streamed:
            with fo.stream(opt, state) as s:
                loss.backward()
            _, state = s.finish()
            out["arrived"].append(sorted(s.arrived))
            out["committed"].append(s.committed)
        else:
            loss.backward()
            grads = {n: p.grad for n, p in params.items()}
            if clip is not None:
                out["norms"].append(value(fo.global_norm(grads)))
                out["factors"].append(value(fo.clip_by_global_norm(clip).global_scale(grads, None)))
                fp32 = fo.clip_by_global_norm(clip, norm_dtype=torch.float32)
                out["fp32_factors"].append(value(fp32.global_scale(grads, None)))
                squares = sum(g.to_local().float().square().sum() for g in grads.values())
                torch.distributed.all_reduce(squares)  # the fp32 norm by hand, over every shard
                out["fp32_norms"].append(squares.sqrt().cpu())
            _, state = opt.update(grads, state)
        model.zero_grad(set_to_none=True)
    out["unflushed"] = shards(model)
    fo.flush(state)
    report = fo.placement_report(state)
    out.update(start=start, params=shards(model), leaves=len(params), state=state_values(state),
               host_bytes=report.host_bytes, device_bytes=report.device_bytes)
    return out


def recording(clip: fo.GradientTransformation, fresh: bool, last: dict) -> fo.GradientTransformation:
    """``clip`` with ``fresh_updates=fresh``, keeping in ``last`` the local shards of the new
    grads of its last update (``"made"``) and copies of their values as made (``"values"``)."""
    def update(updates: Any, state: Any) -> tuple[Any, Any]:
        out, state = clip.update(updates, state)
        with torch.no_grad():
            last["made"] = {k: g.to_local() for k, g in out.items()}
        last["values"] = {k: g.clone() for k, g in last["made"].items()}
        return out, state
    return fo.GradientTransformation(clip.init, update, clip.global_scale, fresh_updates=fresh)


def kept_model(mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """A bf16 ``Linear(256, 600)`` from seed 0, sharded (weight shards of 76,800 elements)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 600).to(device, torch.bfloat16)
    fully_shard(model, mesh=mesh)
    return model


def fixed_steps(opt: fo.Optimizer, model: nn.Module, given: list[dict]) -> None:
    """``opt`` (a fresh state) on ``model``'s params, an update for each of ``given``'s grads,
    then ``fo.flush``."""
    state = opt.init(dict(model.named_parameters()))
    for grads in given:
        _, state = opt.update(grads, state)
    fo.flush(state)


def kept_run(mesh: DeviceMesh, device: torch.device, fresh: bool, delayed: fo.Delay) -> dict:
    """A delayed step behind :func:`recording` ``clip_by_global_norm(CLIPS)`` on
    :func:`kept_model` (fp32 masters), :data:`STEPS` steps of fixed grads: this rank's shards
    after the flush, and which of the clip's last new shards were written after it made them
    (by a landing that kept them)."""
    model = kept_model(mesh, device)
    last: dict[str, dict[str, torch.Tensor]] = {}
    fixed_steps(fo.chain(recording(fo.clip_by_global_norm(CLIPS), fresh, last),
                         adamw_chain(placement=fo.placement.on_host(), delayed=delayed)),
                model, format_grads(dict(model.named_parameters()), mesh))
    return {"params": shards(model),
            "written": {k: not torch.equal(g, last["values"][k]) for k, g in last["made"].items()}}


def rewrap(g: DTensor, t: torch.Tensor) -> DTensor:
    """``t`` as the local shard of a new DTensor laid out as ``g``."""
    return DTensor.from_local(t, g.device_mesh, g.placements, run_check=False, shape=g.shape,
                              stride=g.stride())


def tied(u: dict, s: torch.Tensor) -> dict:
    """Each leaf of ``u`` a new DTensor over the one shard ``s``."""
    return {k: rewrap(g, s) for k, g in u.items()}


# fronts whose new DTensors hold shards they did not make for one leaf alone
REWRAPS: dict[str, Callable[[dict], dict]] = {
    "rewrapped": lambda u: {k: rewrap(g, g.to_local()) for k, g in u.items()},  # the caller's
    "tied": lambda u: tied(u, (u["a.weight"] + u["b.weight"]).to_local()),  # one for both
}


def rewrap_run(mesh: DeviceMesh, device: torch.device, front: str, fresh: bool) -> dict:
    """A delayed step behind ``REWRAPS[front]`` with ``fresh_updates=fresh``, on two bf16
    ``Linear(256, 600)`` weights (``a``, ``b``) sharded, :data:`STEPS` steps of fixed grads:
    this rank's shards after the flush and whether a caller's grad shard was written."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict((k, nn.Linear(256, 600, bias=False)) for k in "ab"))
    fully_shard(model.to(device, torch.bfloat16), mesh=mesh)
    t = fo.GradientTransformation(lambda p: fo.EmptyState(),
                                  lambda u, s: (REWRAPS[front](u), s), fresh_updates=fresh)
    given = format_grads(dict(model.named_parameters()), mesh)
    kept = [{k: g.to_local().clone() for k, g in grads.items()} for grads in given]
    fixed_steps(fo.chain(t, adamw_chain(placement=fo.placement.on_host(),
                                        delayed=fo.Delay(lookahead=False))), model, given)
    return {"params": shards(model),
            "written": any(not torch.equal(g.to_local(), k[n])
                           for grads, k in zip(given, kept) for n, g in grads.items())}


def kept_torch_optimizer_run(mesh: DeviceMesh, device: torch.device) -> dict:
    """:func:`kept_run`'s steps without a look-ahead by ``fo.TorchOptimizer(max_grad_norm=CLIPS,
    delayed=...)`` (its clip's new shards go to the landing as a chain's): this rank's shards
    after ``flush``."""
    model = kept_model(mesh, device)
    params = dict(model.named_parameters())
    opt = fo.TorchOptimizer(list(params.values()), fo.adamw, max_grad_norm=CLIPS,
                            cpu_kernel="torch", executor=small_executor(),
                            placement=fo.placement.on_host(), delayed=fo.Delay(lookahead=False),
                            **HYPER)
    for grads in format_grads(params, mesh):
        for n, p in params.items():
            p.grad = grads[n]
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.flush()
    return {"params": shards(model)}


def state_values(state: Any) -> dict[str, torch.Tensor]:
    """This rank's state tensors (its shards' moments and masters, the step count)."""
    return {k: v.detach().cpu().clone() for k, v in fo.state_dict(state).items()}


def torch_optimizer_run(mesh: DeviceMesh, device: torch.device, xs: list, folder: str) -> dict:
    """``fo.TorchOptimizer`` in a module loop (backward, ``step``, ``zero_grad``), checkpointed
    with DCP after the first step (``fo.dcp.state_dict(tuple(opt.fo_states))``); a fresh model
    and optimizer loaded from it run the other steps again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import functional_offload.dcp  # noqa: F401  (fo.dcp)

    def make() -> tuple[nn.Module, fo.TorchOptimizer]:
        model = build(mesh, device)
        return model, fo.TorchOptimizer(model.named_parameters(), fo.adamw, max_grad_norm=CLIPS,
                                        cpu_kernel="torch", executor=small_executor(), **HYPER)

    def train(model: nn.Module, opt: fo.TorchOptimizer, xs: list) -> None:
        for batch in xs:
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model, opt = make()
    start = shards(model)
    train(model, opt, xs[:1])
    dcp.save({"model": get_model_state_dict(model),
              "optim": fo.dcp.state_dict(tuple(opt.fo_states))},
             checkpoint_id=f"{folder}/torch-optimizer")
    train(model, opt, xs[1:])
    model2, opt2 = make()
    sd = {"model": get_model_state_dict(model2),
          "optim": fo.dcp.state_dict(tuple(opt2.fo_states), loading=True)}
    dcp.load(sd, checkpoint_id=f"{folder}/torch-optimizer", planner=fo.dcp.StrictLoadPlanner())
    set_model_state_dict(model2, sd["model"])
    train(model2, opt2, xs[1:])
    return {"start": start, "params": shards(model), "resumed": shards(model2)}


def guarded_run(mesh: DeviceMesh, device: torch.device, xs: list, nan_rank: int,
                streamed: bool) -> dict:
    """``apply_if_finite(chain(clip, adamw))``; the last step's grads hold a NaN on ``nan_rank``
    only. Every rank reports whether it skipped that step and whether its params stayed finite."""
    rank = dist.get_rank()
    last = len(xs) - 1

    def poison(step: int, p: torch.Tensor) -> None:
        if step == last and rank == nan_rank:
            with torch.no_grad():
                p.grad.to_local()[0, 0] = float("nan")  # this rank's shard only

    opt = fo.apply_if_finite(adamw_chain(CLIPS))
    model = build(mesh, device)
    params = dict(model.named_parameters())
    target = params["blocks.0.fc.weight"]
    state = opt.init(params)
    before_last: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(xs):
        if i == last:
            before_last = {n: p.detach().to_local().clone() for n, p in params.items()}
        loss = loss_of(model, batch)
        if streamed:
            handle = target.register_post_accumulate_grad_hook(lambda p, i=i: poison(i, p))
            with fo.stream(opt, state) as s:
                loss.backward()
            handle.remove()
            _, state = s.finish()
        else:
            loss.backward()
            poison(i, target)
            _, state = opt.update({n: p.grad for n, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
    return {"skipped": int(state.total_notfinite),
            "unchanged": all(torch.equal(before_last[n], p.detach().to_local())
                             for n, p in params.items()),
            "finite": all(bool(torch.isfinite(p.detach().to_local()).all())
                          for p in params.values())}


def adafactor_run(mesh: DeviceMesh, device: torch.device) -> dict:
    """``fo.adafactor`` on the sharded params: refused at ``init`` (what it says), since each
    rank's step would compute Adafactor's whole-param terms from its shard alone."""
    params = dict(build(mesh, device).named_parameters())
    try:
        fo.adafactor(1e-2).init(params)
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def formats_run(mesh: DeviceMesh, device: torch.device) -> dict:
    """A bf16 param of 1,093 x 120 (131,160 elements) sharded on 2 ranks: 547 rows (65,640
    elements) on rank 0, 546 (65,520) on rank 1, either side of the size below which a leaf
    keeps fp32 moments and an fp32 master. The format follows the whole param: this rank's
    moment and master dtypes under 8-bit moments and the split master."""
    model = nn.Linear(120, 1093, bias=False, dtype=torch.bfloat16, device=device)
    fully_shard(model, mesh=mesh)
    opt = fo.adamw(1e-2, mu_dtype=torch.uint8, nu_dtype=torch.uint8, store_param_remainders=True)
    state = opt.init(dict(model.named_parameters()))
    return {"rows": model.weight.to_local().shape[0], "mu": state.mu["weight"].dtype,
            "master": state.master["weight"].dtype}


FORMATS = {"fp32": {}, "split": dict(store_param_remainders=True),
           "split8": dict(store_param_remainders=True, mu_dtype=torch.uint8, nu_dtype=torch.uint8)}


def formats_model(device: torch.device) -> nn.Module:
    """bf16 ``Linear(120, 1093)``, GELU, ``Linear(1093, 80)`` from seed 0: both weights above
    the size that keeps fp32 state (131,160 and 87,440 elements), their shards on either side
    of it (65,640 / 65,520 and 43,720 each); the biases below it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(120, 1093), nn.GELU(), nn.Linear(1093, 80)).to(device, torch.bfloat16)


def format_grads(params: dict[str, Any], mesh: Optional[DeviceMesh]) -> list[dict[str, torch.Tensor]]:
    """:data:`STEPS` sets of whole grads from one seed (the same on every rank and in the
    single-process oracle), sharded like ``params`` where ``mesh`` is given."""
    g = torch.Generator().manual_seed(2000)
    out = []
    for _ in range(STEPS):
        step = {}
        for n, p in params.items():
            x = torch.randn(p.shape, generator=g).to(p.device, torch.bfloat16)
            step[n] = distribute_tensor(x, mesh, p.placements) if mesh is not None else x
        out.append(step)
    return out


def formats_steps_run(mesh: DeviceMesh, device: torch.device, fmt: str, mode: str = "plain",
                      clip: float = CLIPS, folder: Optional[str] = None) -> dict:
    """``chain(clip, adamw)`` in format ``fmt`` on :func:`formats_model` sharded by FSDP2,
    :data:`STEPS` steps of fixed grads (:func:`format_grads`): ``mode`` "plain", "stream" (each
    grad handed over during a backward), "delayed" (every step in flight, no look-ahead) or
    "resumed" (``fo.save``/``fo.load`` of this rank's state after the first step, into a fresh
    state of a fresh model). This rank's shards, state and the state's dtypes."""
    def make() -> tuple[dict[str, Any], fo.Optimizer, Any]:
        model = formats_model(device)
        fully_shard(model, mesh=mesh)
        params = dict(model.named_parameters())
        opt = fo.chain(fo.clip_by_global_norm(clip), fo.adamw(
            **HYPER, cpu_kernel="torch", executor=small_executor(), **FORMATS[fmt],
            delayed=fo.Delay(lookahead=False) if mode == "delayed" else False))
        return params, opt, opt.init(params)

    params, opt, state = make()
    for i, grads in enumerate(format_grads(params, mesh)):
        if mode == "resumed" and i == 1:
            path = f"{folder}/formats-{dist.get_rank()}.fo"
            fo.save(state, path)
            params2, opt, like = make()
            with torch.no_grad():  # the model's own checkpoint, restored first
                for n, p in params2.items():
                    p.to_local().copy_(params[n].to_local())
            params, state = params2, fo.load(path, like=like)
        if mode == "stream":
            with fo.stream(opt, state) as s:
                sum((p.float() * grads[n].float()).sum() for n, p in params.items()).backward()
            _, state = s.finish()
            for p in params.values():
                p.grad = None
        else:
            _, state = opt.update(grads, state)
    fo.flush(state)
    dtypes = {r["path"]: r["dtype"] for r in fo.placement_report(state).rows}
    return {"params": {n: p.detach().to_local().cpu().clone() for n, p in params.items()},
            "state": state_values(state), "dtypes": dtypes}


def node_run() -> dict:
    """This rank's default executor and the CPUs its threads are pinned to (after host steps)."""
    ex = default_executor()
    pinned = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
        if len(cpus) == 1:
            pinned[int(tid)] = next(iter(cpus))
    return {"share": node_share(), "threads": ex.threads, "cpus": ex.cpus,
            "physical_cores": physical_cores(), "pinned_threads": sorted(pinned.values())}


def job(rank: int, folder: str, device_type: str) -> None:
    """One rank: every mode, then ``{mode: this rank's result}`` to ``folder/results-<rank>.pt``."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))  # as torchrun sets them
    torch.set_num_threads(1)  # two ranks share the cores
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh(device_type, (WORLD,))
        xs = batches(rank, device)
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        modes: dict[str, Callable[[], Any]] = {
            "torch": lambda: torch_run(mesh, device, xs),
            "torch clip": lambda: torch_run(mesh, device, xs, clip=CLIPS),
            "torch no clip": lambda: torch_run(mesh, device, xs, clip=NO_CLIP),
            "torch delayed clip": lambda: torch_run(mesh, device, xs, clip=CLIPS, delayed=True),
            "torch bf16 compute": lambda: torch_run(mesh, device, xs, mp=bf16),
            "torch mixed": lambda: torch_run(mesh, device, xs, clip=CLIPS, mp=mixed),
            "plain": lambda: ours_run(mesh, device, xs),
            "plain native": lambda: ours_run(mesh, device, xs, cpu_kernel="auto", executor=None),
            "clip": lambda: ours_run(mesh, device, xs, CLIPS),
            "no clip": lambda: ours_run(mesh, device, xs, NO_CLIP),
            "stream": lambda: ours_run(mesh, device, xs, streamed=True),
            "stream clip": lambda: ours_run(mesh, device, xs, CLIPS, streamed=True),
            "stream no clip": lambda: ours_run(mesh, device, xs, NO_CLIP, streamed=True),
            "delayed clip": lambda: ours_run(mesh, device, xs, CLIPS, delayed=fo.Delay(lookahead=False)),
            "ahead clip": lambda: ours_run(mesh, device, xs, CLIPS, delayed=True),
            "kept": lambda: kept_run(mesh, device, True, fo.Delay(lookahead=False)),
            "copied": lambda: kept_run(mesh, device, False, fo.Delay(lookahead=False)),
            "kept ahead": lambda: kept_run(mesh, device, True, fo.Delay()),
            "copied ahead": lambda: kept_run(mesh, device, False, fo.Delay()),
            "kept torch optimizer": lambda: kept_torch_optimizer_run(mesh, device),
            **{f"{front} {fresh}": (lambda f=front, x=fresh: rewrap_run(mesh, device, f, x))
               for front in REWRAPS for fresh in (True, False)},
            "torch optimizer": lambda: torch_optimizer_run(mesh, device, xs, folder),
            "half offloaded": lambda: ours_run(mesh, device, xs,
                                               placement=fo.placement.offload_fraction(0.5)),
            "bf16": lambda: ours_run(mesh, device, xs, dtype=torch.bfloat16),
            "bf16 clip": lambda: ours_run(mesh, device, xs, CLIPS, dtype=torch.bfloat16),
            "bf16 stream": lambda: ours_run(mesh, device, xs, streamed=True, dtype=torch.bfloat16),
            "mixed": lambda: ours_run(mesh, device, xs, CLIPS, mp=mixed),
            "node": node_run,
            "adafactor": lambda: adafactor_run(mesh, device),
            "formats": lambda: formats_run(mesh, device),
            "fmt fp32": lambda: formats_steps_run(mesh, device, "fp32"),
            "fmt split": lambda: formats_steps_run(mesh, device, "split"),
            "fmt split no clip": lambda: formats_steps_run(mesh, device, "split", clip=NO_CLIP),
            "fmt split8": lambda: formats_steps_run(mesh, device, "split8"),
            "fmt split8 stream": lambda: formats_steps_run(mesh, device, "split8", "stream"),
            "fmt split8 delayed": lambda: formats_steps_run(mesh, device, "split8", "delayed"),
            "fmt split8 resumed": lambda: formats_steps_run(mesh, device, "split8", "resumed",
                                                            folder=folder),
        }
        for nan_rank in range(WORLD):
            for streamed in (False, True):
                modes[f"nan on rank {nan_rank}" + (" stream" if streamed else "")] = (
                    lambda r=nan_rank, s=streamed: guarded_run(mesh, device, xs, r, s))
        results: dict[str, Any] = {}
        for name, run in modes.items():
            try:
                results[name] = run()
            except Exception:  # noqa: BLE001 - recorded for the test to report
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
        torch.save(results, f"{folder}/results-{rank}.pt")
    finally:
        dist.destroy_process_group()
