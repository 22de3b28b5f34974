"""DCP checkpoints of the optimizer state of FSDP2 params: saved at one world size, loaded at
another straight into the state's tensors, training continuing on the same trajectory."""

import functools
import traceback
from datetime import timedelta
from typing import NamedTuple

import optree
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import functional_offload as fo
from conftest import end_rank
from functional_offload.kernels import remainder

dcp = pytest.importorskip("torch.distributed.checkpoint")
import functional_offload.dcp  # noqa: E402,F401  (fo.dcp)
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,  # noqa: E402
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BEFORE, AFTER = 3, 3  # steps before the checkpoint, steps after it


class ToFloat(nn.Module):
    def forward(self, x):
        return x.float()


def make_model() -> nn.Module:
    """bf16 and fp32 layers (masters for the first only), shards of uneven and empty sizes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 5).to(torch.bfloat16), ToFloat(), nn.Linear(5, 3),
                         nn.Linear(3, 1))


def shard(model: nn.Module, mesh) -> nn.Module:
    fully_shard(model[0], mesh=mesh)  # FSDP2 shards one dtype per group
    return fully_shard(model, mesh=mesh)


def make_opt():
    return fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1))


def batches(width: int = 8):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, width, generator=g).to(torch.bfloat16) for _ in range(BEFORE + AFTER)]


def train(model, opt, state, xs):
    params = dict(model.named_parameters())
    for x in xs:
        (model(x).square().sum() * 10).backward()  # grad norms > 1: clipping is on
        _, state = opt.update({n: p.grad for n, p in params.items()}, state)
        for p in params.values():
            p.grad = None
    return state


def full(sd: dict) -> dict:
    """Whole tensors, copied (DTensors gathered: collective; a replicated one's is its own)."""
    return {k: _whole(v).detach().clone() for k, v in sd.items()}


def _mu_all_zero(state) -> bool:
    """Whether ``state`` has first moments (fields named ``mu``) and all of them are zero."""
    moments = [v for k, v in fo.state_dict(state).items() if "mu" in k.split(".")]
    return bool(moments) and all(not v.any() for v in moments)


def _whole(v):
    if not isinstance(v, DTensor):
        return v
    if v.dtype == torch.int16:  # (split masters' halves: gloo gathers no int16, so widened)
        wide = DTensor.from_local(v.to_local().int(), v.device_mesh, v.placements, shape=v.shape,
                                  stride=v.stride())
        return wide.full_tensor().to(torch.int16)
    return v.full_tensor()


def snapshot(model, state) -> dict:
    return {"params": full(get_model_state_dict(model)), "state": full(fo.dcp.state_dict(state))}


def start(mesh=None, make=make_opt, build=make_model):
    model = build()
    if mesh is not None:
        shard(model, mesh)
    opt = make()
    return model, opt, opt.init(dict(model.named_parameters()))


def save(model, state, path):
    dcp.save({"model": get_model_state_dict(model), "optim": fo.dcp.state_dict(state)},
             checkpoint_id=path)


def resume(path, mesh=None, make=make_opt, build=make_model):
    """A new model and state (sharded over ``mesh``, or plain), loaded from ``path``."""
    model, opt, like = start(mesh, make, build)
    sd = {"model": get_model_state_dict(model), "optim": fo.dcp.state_dict(like, loading=True)}
    dcp.load(sd, checkpoint_id=path, planner=fo.dcp.StrictLoadPlanner())
    set_model_state_dict(model, sd["model"])
    return model, opt, like


def save_and_resume(mesh, folder: str, prefix: str, width: int = 8, **kw) -> dict:
    """At this world size (``mesh``): train BEFORE steps, save ``<prefix>two``, continue; then
    resume both worlds' checkpoints (``<prefix>two``, ``<prefix>one``) and continue each.
    ``kw``: :func:`start`'s ``make`` and ``build``."""
    xs = batches(width)
    model, opt, state = start(mesh, **kw)
    state = train(model, opt, state, xs[:BEFORE])
    save(model, state, f"{folder}/{prefix}two")
    out = {"saved": snapshot(model, state)}
    out["straight"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
    for name in ("two", "one"):
        model, opt, state = resume(f"{folder}/{prefix}{name}", mesh, **kw)
        out[f"{name} loaded"] = snapshot(model, state)
        out[f"{name} resumed"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
    return out


def on_two_ranks(rank: int, folder: str, job, name: str) -> None:
    """``mp.spawn``'s target: ``job(mesh, folder, rank)`` at 2 gloo ranks, its result saved by
    rank 0 as ``<folder>/<name>``."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        out = job(init_device_mesh("cpu", (2,)), folder, rank)
        if rank == 0:
            torch.save(out, f"{folder}/{name}")
    finally:
        end_rank()


def at_two_ranks(folder, job, name: str) -> dict:
    """The result of ``job`` run at 2 ranks (:func:`on_two_ranks`)."""
    mp.spawn(on_two_ranks, args=(str(folder), job, name), nprocs=2)
    return torch.load(folder / name)


def two_ranks(mesh, folder: str, rank: int) -> dict:
    out = save_and_resume(mesh, folder, "")
    # counts that differ across ranks: rank 0 updates once more (adamw alone: no collective)
    model, _, _ = start(mesh)
    opt = fo.adamw(1e-2)
    state = opt.init(dict(model.named_parameters()))
    if rank == 0:
        _, state = opt.update({n: torch.zeros_like(p) for n, p in model.named_parameters()},
                              state)
    with pytest.raises(fo.CheckpointError, match="'count' differs across ranks") as err:
        fo.dcp.state_dict(state)
    out["count error"] = str(err.value)
    return out


def saved_at_one_rank(folder, prefix: str, width: int = 8, **kw) -> dict:
    """At one rank (plain params, no process group): train BEFORE steps, save
    ``<prefix>one``, continue."""
    xs = batches(width)
    model, opt, state = start(**kw)
    state = train(model, opt, state, xs[:BEFORE])
    save(model, state, folder / f"{prefix}one")
    one = {"saved": snapshot(model, state)}
    one["straight"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
    return one


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run at 1 rank (plain params, no process group) and one at 2 ranks (FSDP2), each
    saved after BEFORE steps and continued; the 2-rank job also resumes both checkpoints."""
    folder = tmp_path_factory.mktemp("dcp")
    one = saved_at_one_rank(folder, "")
    return {"folder": folder, "one": one, "two": at_two_ranks(folder, two_ranks, "two_ranks.pt")}


def assert_equal(a: dict, b: dict) -> None:
    for part in ("params", "state"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            x, y = a[part][k], b[part][k]
            assert x.dtype == y.dtype and torch.equal(x, y), (part, k)


def assert_close(a: dict, b: dict) -> None:
    """The same trajectory, up to the rounding of reductions in another order (FSDP2's bf16
    reduce-scatter, the clipping norm over shards); a resume that lost a moment, a master or
    the step count is off by far more."""
    assert torch.equal(a["state"]["1.count"], b["state"]["1.count"])
    for part in ("params", "state"):
        for k in a[part]:
            x, y = (remainder.join(t) if remainder.is_split(t) else t.float()  # a split master's
                    for t in (a[part][k], b[part][k]))                       # fp32 values
            torch.testing.assert_close(x, y, rtol=0, atol=1e-3, msg=f"{part} {k}")


def test_two_rank_checkpoint_loads_at_one_rank_bit_exact(runs):
    two = runs["two"]
    model, opt, state = resume(runs["folder"] / "two")
    loaded = snapshot(model, state)
    assert_equal(loaded, two["saved"])
    keys = loaded["state"].keys()
    assert "1.master.0.weight" in keys and "1.master.2.weight" not in keys  # fp32: no master
    resumed = snapshot(model, train(model, opt, state, batches()[BEFORE:]))
    assert_close(resumed, two["straight"])
    assert int(resumed["state"]["1.count"]) == BEFORE + AFTER


def test_one_rank_checkpoint_loads_at_two_ranks_and_continues(runs):
    one, two = runs["one"], runs["two"]
    assert_equal(two["one loaded"], one["saved"])
    assert_close(two["one resumed"], one["straight"])


def test_resume_at_the_same_world_size_is_bit_exact(runs):
    assert_equal(runs["two"]["two resumed"], runs["two"]["straight"])
    model, opt, state = resume(runs["folder"] / "one")
    assert_equal(snapshot(model, train(model, opt, state, batches()[BEFORE:])),
                 runs["one"]["straight"])


def test_counts_must_agree_across_ranks(runs):
    assert "rank: value {0: 1, 1: 0}" in runs["two"]["count error"]


def test_load_lands_in_the_state_tensors(runs):
    model, opt, like = start()
    before = {k: v.data_ptr() for k, v in fo.state_dict(like).items()}
    dcp.load({"optim": fo.dcp.state_dict(like, loading=True)}, checkpoint_id=runs["folder"] / "two")
    after = fo.state_dict(like)
    assert {k: v.data_ptr() for k, v in after.items()} == before
    assert all(torch.equal(after[k], v) for k, v in runs["two"]["saved"]["state"].items())


def test_strict_planner_refuses_casts_and_leftover_entries(runs):
    path = runs["folder"] / "one"

    def load_into(model, opt):
        like = opt.init(dict(model.named_parameters()))
        try:
            dcp.load({"optim": fo.dcp.state_dict(like, loading=True)}, checkpoint_id=path,
                     planner=fo.dcp.StrictLoadPlanner())
        finally:
            assert _mu_all_zero(like)  # nothing was read into them

    bf16_moments = fo.chain(fo.clip_by_global_norm(1.0),
                            fo.adamw(1e-2, weight_decay=0.1, mu_dtype=torch.bfloat16))
    with pytest.raises(dcp.CheckpointException, match="optim.1.mu.0.bias.*never cast"):
        load_into(make_model(), bf16_moments)
    fp32 = make_model().float()  # no masters: the saved ones are left over
    with pytest.raises(dcp.CheckpointException, match="lacks"):
        load_into(fp32, make_opt())
    with pytest.raises(dcp.CheckpointException, match="Missing key"):
        load_into(make_model(), fo.adamw(1e-2))  # another chain: other keys


def test_state_fields_must_mirror_the_params():
    class Odd(NamedTuple):  # a terminal state with a field that is not one tensor per param
        count: torch.Tensor
        table: torch.Tensor
        params: fo.ParamRefs

    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    state = (fo.EmptyState(), Odd(torch.zeros((), dtype=torch.int64), torch.zeros(5),
                                  fo.ParamRefs(params)))
    with pytest.raises(TypeError, match="'1.table' holds tensors but does not mirror"):
        fo.dcp.state_dict(state)


@pytest.mark.cuda
def test_load_into_host_state_allocates_no_device_memory(tmp_path):
    """bf16 DTensor params on the GPU, their state (12 MiB) in host memory: dcp.load reads into
    the host tensors and allocates no device memory."""
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/store",
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        model = shard(nn.Sequential(nn.Linear(1024, 1024, bias=False).to("cuda", torch.bfloat16)),
                      mesh)
        opt = fo.chain(fo.clip_by_global_norm(1.0),
                       fo.adamw(1e-2, weight_decay=0.1, placement=fo.placement.on_host()))
        params = dict(model.named_parameters())
        xs = [torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        state = train(model, opt, opt.init(params), xs)
        dcp.save({"optim": fo.dcp.state_dict(state)}, checkpoint_id=tmp_path / "ckpt")
        like = opt.init(params)
        assert all(v.device.type == "cpu" for v in fo.state_dict(like).values())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        peak = torch.cuda.max_memory_allocated()
        dcp.load({"optim": fo.dcp.state_dict(like, loading=True)}, checkpoint_id=tmp_path / "ckpt",
                 planner=fo.dcp.StrictLoadPlanner())
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - peak < 2**20  # a staged leaf is 4 MiB
        saved, loaded = fo.state_dict(state), fo.state_dict(like)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["host", "device"])
def test_a_gpu_params_remainder_only_master_resumes_with_the_model(where, tmp_path):
    """bf16 DTensor params on the GPU with split masters of the remainder alone (the param is
    the high half), on the host or the device: saved with the model and loaded with it into a
    fresh model and state, training goes on bit for bit."""
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/store",
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        placement = fo.placement.on_host() if where == "host" else fo.placement.on_device()

        def build():
            torch.manual_seed(0)
            model = shard(nn.Sequential(nn.Linear(512, 512).to("cuda", torch.bfloat16)), mesh)
            opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(
                1e-2, weight_decay=0.1, placement=placement, store_param_remainders=True))
            return model, opt, opt.init(dict(model.named_parameters()))

        g = torch.Generator(device="cuda").manual_seed(1)
        xs = [torch.randn(4, 512, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)]
        model, opt, state = build()
        assert remainder.is_lean(state[-1].master["0.weight"])
        state = train(model, opt, state, xs[:2])
        save(model, state, tmp_path / "ckpt")
        state = train(model, opt, state, xs[2:])
        model2, opt2, like = build()
        sd = {"model": get_model_state_dict(model2), "optim": fo.dcp.state_dict(like, loading=True)}
        dcp.load(sd, checkpoint_id=tmp_path / "ckpt", planner=fo.dcp.StrictLoadPlanner())
        set_model_state_dict(model2, sd["model"])
        like = train(model2, opt2, like, xs[2:])
        want, got = fo.state_dict(state), fo.state_dict(like)
        assert all(torch.equal(got[k].cpu(), want[k].cpu()) for k in want)
        for (n, p), q in zip(model.named_parameters(), model2.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), n
    finally:
        dist.destroy_process_group()


# ---- state made by wrappers and gradient transformations ---------------------------------
def shard_of(t):
    return t.to_local() if isinstance(t, DTensor) else t


def trace(decay: float) -> fo.GradientTransformation:
    """A user's transformation whose state holds this rank's shards as plain tensors (as
    MultiSteps' sums do): a decaying sum of the grads, passed on as the update."""
    def init(params):
        return {"trace": optree.tree_map(lambda p: torch.zeros(shard_of(p).shape), params)}

    def update(updates, state):
        def step(m, g):
            if g is None:
                return None
            m.mul_(decay).add_(shard_of(g).float())
            return m.to(g.dtype)
        return optree.tree_map(step, state["trace"], updates, none_is_leaf=True), state

    return fo.GradientTransformation(init, update)


def by_ndim(params):
    return {k: "matrices" if v.ndim > 1 else "vectors" for k, v in params.items()}


WRAPPED = {  # every optimizer here keeps state that mirrors the params outside a terminal state
    "multisteps": lambda: fo.MultiSteps(make_opt(), 2),
    "guarded-multisteps-ema": lambda: fo.apply_if_finite(
        fo.MultiSteps(fo.adamw(1e-2, ema_decay=0.9), 2)),
    "partition-of-multisteps": lambda: fo.partition(
        {"matrices": fo.MultiSteps(fo.adamw(1e-2), 2),
         "vectors": fo.inject_hyperparams(fo.adamw)(lr=1e-2)}, by_ndim),
    "multisteps-of-partition": lambda: fo.MultiSteps(
        fo.partition({"matrices": fo.adamw(1e-2), "vectors": fo.lion(1e-3)}, by_ndim), 2),
    "masked-user-transform": lambda: fo.chain(
        fo.masked(trace(0.5), lambda p: {k: v.ndim > 1 for k, v in p.items()}), fo.adamw(1e-2)),
    "partition-of-user-transforms": lambda: fo.chain(
        fo.partition({"matrices": trace(0.5), "vectors": fo.scale(1.0)}, by_ndim),
        fo.adamw(1e-2)),
}


def cycle(make, mesh, xs, folder: str, name: str) -> dict:
    """``make``'s optimizer trained BEFORE steps (mid-cycle for ``MultiSteps(.., 2)``), saved to
    ``folder/<world>-name``, continued; then both worlds' checkpoints resumed and continued."""
    world = "one" if mesh is None else "two"
    model, opt, state = start(mesh, make)
    state = train(model, opt, state, xs[:BEFORE])
    save(model, state, f"{folder}/{world}-{name}")
    sd = fo.dcp.state_dict(state)
    out = {"saved": snapshot(model, state),
           "dtensors": sorted(k for k, v in sd.items() if isinstance(v, DTensor)),
           "per param": sorted(k for k, v in sd.items() if v.is_floating_point() and v.dim())}
    out["straight"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
    for saved in (("one", "two") if mesh is not None else ()):
        model, opt, state = resume(f"{folder}/{saved}-{name}", mesh, make)
        out[f"{saved} loaded"] = snapshot(model, state)
        out[f"{saved} resumed"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
    return out


# Adafactor's factored state on params whole on every rank (replicated DTensors at 2 ranks)
ADAFACTOR = dict(lr=1e-2, weight_decay=0.1)


def adafactor_params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 8, generator=g), "t": torch.randn(2, 3, 4, generator=g),
            "b": torch.randn(6, generator=g), "s": torch.randn((), generator=g)}


def adafactor_grads() -> list:
    g = torch.Generator().manual_seed(1)
    return [{k: torch.randn(v.shape, generator=g) for k, v in adafactor_params().items()}
            for _ in range(BEFORE + AFTER)]


def adafactor_cycle(mesh, folder: str) -> dict:
    """``fo.adafactor`` (with an EMA) trained BEFORE steps, saved, continued; at 2 ranks (params
    replicated over ``mesh``) both worlds' checkpoints are resumed and continued."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    opt = fo.adafactor(**ADAFACTOR, ema_decay=0.9)
    world = "one" if mesh is None else "two"

    def place(tree):
        return tree if mesh is None else {k: distribute_tensor(v.clone(), mesh, [Replicate()])
                                          for k, v in tree.items()}

    def run(params, state, gs):
        for g in gs:
            params, state = opt.update(place(g), state)
        return params, state

    def snap(params, state):
        return {"params": full(params), "state": full(fo.dcp.state_dict(state))}

    gs = adafactor_grads()
    params = place(adafactor_params())
    params, state = run(params, opt.init(params), gs[:BEFORE])
    sd = fo.dcp.state_dict(state)
    out = {"saved": snap(params, state),
           "dtensors": sorted(k for k, v in sd.items() if isinstance(v, DTensor))}
    dcp.save({"optim": sd}, checkpoint_id=f"{folder}/{world}-adafactor")
    out["straight"] = snap(*run(params, state, gs[BEFORE:]))
    for saved in (("one", "two") if mesh is not None else ()):
        params = place(out["saved"]["params"])
        like = opt.init(params)
        dcp.load({"optim": fo.dcp.state_dict(like, loading=True)},
                 checkpoint_id=f"{folder}/{saved}-adafactor", planner=fo.dcp.StrictLoadPlanner())
        out[f"{saved} loaded"] = snap(params, like)
        out[f"{saved} resumed"] = snap(*run(params, like, gs[BEFORE:]))
    return out


def rank_local_error(mesh) -> dict:
    """What saving a leaf that holds this rank's shard but mirrors no params tree (here
    flattened) raises: saved from one rank, it would lose the other's part."""
    flat = fo.GradientTransformation(
        lambda p: {"flat": [shard_of(v).reshape(-1).float() for v in p.values()]},
        lambda u, s: (u, s))
    model, opt, state = start(mesh, lambda: fo.chain(flat, fo.adamw(1e-2)))
    try:
        fo.dcp.state_dict(state)
    except fo.CheckpointError as e:
        return {"message": str(e)}
    return {"message": None}


def two_ranks_wrapped(mesh, folder: str, rank: int) -> dict:
    xs = batches()
    runs = {name: functools.partial(cycle, make, mesh, xs, folder, name)
            for name, make in WRAPPED.items()}
    runs["adafactor"] = functools.partial(adafactor_cycle, mesh, folder)
    runs["rank-local"] = functools.partial(rank_local_error, mesh)
    out = {}
    for name, run in runs.items():  # one failing run is reported, the others go on
        try:
            out[name] = run()
        except (Exception, dcp.CheckpointException):  # noqa: BLE001 - for the test to report
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """Each of WRAPPED (and Adafactor) unsharded at 1 rank, then sharded at 2 ranks (FSDP2;
    Adafactor's params replicated), each saved mid-cycle and continued; the 2-rank job resumes
    both worlds' checkpoints."""
    folder = tmp_path_factory.mktemp("dcp-wrapped")
    xs = batches()
    one = {name: cycle(make, None, xs, str(folder), name) for name, make in WRAPPED.items()}
    one["adafactor"] = adafactor_cycle(None, str(folder))
    return {"folder": folder, "one": one,
            "two": at_two_ranks(folder, two_ranks_wrapped, "two_ranks_wrapped.pt")}


def two_rank(wrapped: dict, name: str) -> dict:
    """The 2-rank job's result for ``name``; fails with the traceback if it raised."""
    got = wrapped["two"][name]
    if "error" in got:
        pytest.fail(f"{name!r} raised at 2 ranks:\n{got['error']}")
    return got


def assert_near(a: dict, b: dict, what: str) -> None:
    """The same trajectory up to the rounding of reductions in another order (see assert_close)."""
    for part in ("params", "state"):
        assert a[part].keys() == b[part].keys(), (what, part)
        for k in a[part]:
            torch.testing.assert_close(a[part][k].double(), b[part][k].double(), rtol=0,
                                       atol=1e-3, msg=f"{what}: {part} {k}")


@pytest.mark.parametrize("name", list(WRAPPED))
def test_state_mirroring_the_params_resumes_mid_cycle_at_any_world_size(wrapped, name):
    """Every state leaf mirroring a DTensor param is a DTensor laid out like it, whichever
    transformation keeps it (MultiSteps' sums mid-cycle, an EMA, the parts of masked and
    partition, under inject_hyperparams and apply_if_finite): a checkpoint saved at 2 ranks
    resumes at 2 ranks bit for bit and at 1 rank on the unsharded run's trajectory, and one
    saved by the unsharded run resumes at 2 ranks."""
    one, two = wrapped["one"][name], two_rank(wrapped, name)
    assert two["dtensors"] == two["per param"] and two["dtensors"], two["dtensors"]
    steps = [v for k, v in two["saved"]["state"].items() if k.endswith("mini_step")]
    assert all(int(n) == 1 for n in steps)  # mid-cycle: one grad summed
    assert_near(two["straight"], one["straight"], "2 ranks against the unsharded run")
    assert_equal(two["two loaded"], two["saved"])
    assert_equal(two["two resumed"], two["straight"])
    assert_equal(two["one loaded"], one["saved"])
    assert_near(two["one resumed"], one["straight"], "unsharded checkpoint resumed at 2 ranks")
    model, opt, state = resume(wrapped["folder"] / f"two-{name}", make=WRAPPED[name])
    assert_equal(snapshot(model, state), two["saved"])
    assert_near(snapshot(model, train(model, opt, state, batches()[BEFORE:])), one["straight"],
                "2-rank checkpoint resumed at 1 rank")


def test_adafactor_factored_state_resumes_at_any_world_size(wrapped):
    """Adafactor's row and column factors (and EMA) of params replicated over 2 ranks: saved
    at 1 or 2 ranks, resumed at the other, bit for bit, and the 2-rank run is
    ``torch.optim.Adafactor``'s on the unsharded params."""
    one, two = wrapped["one"]["adafactor"], two_rank(wrapped, "adafactor")
    assert {"row_var.w", "col_var.w", "row_var.t", "col_var.t"} <= set(two["dtensors"])
    for got, want in [(two["saved"], one["saved"]), (two["straight"], one["straight"]),
                      (two["one loaded"], one["saved"]), (two["one resumed"], one["straight"]),
                      (two["two loaded"], two["saved"]), (two["two resumed"], two["straight"])]:
        assert_equal(got, want)
    opt = fo.adafactor(**ADAFACTOR, ema_decay=0.9)
    params = adafactor_params()
    like = opt.init(params)
    dcp.load({"optim": fo.dcp.state_dict(like, loading=True)},
             checkpoint_id=wrapped["folder"] / "two-adafactor", planner=fo.dcp.StrictLoadPlanner())
    with torch.no_grad():
        for k, v in params.items():
            v.copy_(two["saved"]["params"][k])
    for g in adafactor_grads()[BEFORE:]:
        params, like = opt.update(g, like)
    assert all(torch.equal(params[k], v) for k, v in one["straight"]["params"].items())
    oracle = {k: v.clone().requires_grad_() for k, v in adafactor_params().items()}
    torch_opt = torch.optim.Adafactor(list(oracle.values()), **ADAFACTOR)
    for g in adafactor_grads():
        for k, p in oracle.items():
            p.grad = g[k].clone()
        torch_opt.step()
    for k, p in oracle.items():
        torch.testing.assert_close(two["straight"]["params"][k], p.detach(), rtol=0, atol=1e-6)


def test_a_rank_local_leaf_that_mirrors_no_params_is_refused(wrapped):
    """A plain leaf that differs across ranks is saved from one rank only: refused, named."""
    message = two_rank(wrapped, "rank-local")["message"]
    assert message is not None and "'0.flat.0' differs across ranks" in message


# ---- split masters (store_param_remainders) -------------------------------------------------
SPLIT_WIDTH = 256


def make_split_model() -> nn.Module:
    """A bf16 layer above the size that keeps fp32 masters (76,800 weights: a split master,
    its shards 38,400 each), a small bf16 bias beside it (an fp32 master) and an fp32 layer."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(SPLIT_WIDTH, 300).to(torch.bfloat16), ToFloat(), nn.Linear(300, 1))


def make_split_opt():
    return fo.chain(fo.clip_by_global_norm(1.0),
                    fo.adamw(1e-2, weight_decay=0.1, store_param_remainders=True))


SPLIT = dict(make=make_split_opt, build=make_split_model)


def two_ranks_split(mesh, folder: str, rank: int) -> dict:
    """At 2 ranks: train, save ``split-two``, continue; resume both worlds' checkpoints."""
    return save_and_resume(mesh, folder, "split-", SPLIT_WIDTH, **SPLIT)


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp-split")
    one = saved_at_one_rank(folder, "split-", SPLIT_WIDTH, **SPLIT)
    return {"folder": folder, "one": one,
            "two": at_two_ranks(folder, two_ranks_split, "split_two_ranks.pt")}


def test_split_masters_checkpoint_as_their_halves_at_any_world_size(split_runs):
    """DCP saves a split master as its ``int16`` halves, ``(2, *param.shape)``, laid out like
    the param one dim further in (a view: nothing joined); loaded at another world size they are
    the saved bits, and training continues on the same trajectory (bit for bit at the same
    world size)."""
    one, two = split_runs["one"], split_runs["two"]
    saved = two["saved"]["state"]
    assert saved["1.master.0.weight"].dtype == torch.int16
    assert saved["1.master.0.weight"].shape == (2, 300, SPLIT_WIDTH)
    assert saved["1.master.0.bias"].dtype == torch.float32  # small: an fp32 master
    assert_equal(two["two loaded"], two["saved"])
    assert_equal(two["one loaded"], one["saved"])
    assert_equal(two["two resumed"], two["straight"])
    assert_close(two["one resumed"], one["straight"])
    model, opt, state = resume(split_runs["folder"] / "split-two", **SPLIT)
    assert_equal(snapshot(model, state), two["saved"])
    assert_close(snapshot(model, train(model, opt, state, batches(SPLIT_WIDTH)[BEFORE:])),
                 two["straight"])
    model, opt, state = resume(split_runs["folder"] / "split-one", **SPLIT)
    assert_equal(snapshot(model, train(model, opt, state, batches(SPLIT_WIDTH)[BEFORE:])),
                 one["straight"])


def test_a_split_master_checkpoint_does_not_load_into_fp32_masters(split_runs):
    """The formats' tensors differ (``int16`` halves, fp32 values): the strict planner refuses
    them before anything is read, naming the key and the way to switch (fo.save / fo.load
    convert between them)."""
    model, opt = make_split_model(), make_opt()
    like = opt.init(dict(model.named_parameters()))
    with pytest.raises(dcp.CheckpointException,
                       match=r"optim.1.master.0.weight.*int16 of shape \(2, 300, \d+\).*float32.*"
                             r"split master.*fo.save and fo.load"):
        dcp.load({"optim": fo.dcp.state_dict(like, loading=True)},
                 checkpoint_id=split_runs["folder"] / "split-one", planner=fo.dcp.StrictLoadPlanner())
    assert _mu_all_zero(like)  # nothing was read into them


TP_SHAPES = {"w": (304, 256), "v": (70_004,)}  # split masters, their rows over tp then dp


def tp_params() -> dict:
    torch.manual_seed(0)
    return {k: torch.randn(s).to(torch.bfloat16) for k, s in TP_SHAPES.items()}


def four_ranks_tp(rank: int, folder: str) -> None:
    """FSDP2 over tensor parallelism (a 2 x 2 mesh: each param sharded over "tp", then
    ``fully_shard`` over "dp", which makes its placements strided): 3 steps with split masters,
    saved with DCP; the fp32 masters each rank joins, gathered whole."""
    from torch.distributed.tensor import distribute_tensor
    dist.init_process_group("gloo", init_method=f"file://{folder}/store-tp", rank=rank,
                            world_size=4, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = nn.Module()
        for k, v in tp_params().items():
            model.register_parameter(k, nn.Parameter(distribute_tensor(v, mesh["tp"], [Shard(0)])))
        fully_shard(model, mesh=mesh["dp"])
        params = dict(model.named_parameters())
        opt = fo.adamw(1e-2, weight_decay=0.1, store_param_remainders=True)
        state = opt.init(params)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            grads = {k: torch.randn(p.shape, generator=g).to(torch.bfloat16) for k, p in params.items()}
            grads = {k: distribute_tensor(x, p.device_mesh, p.placements) for (k, p), x
                     in zip(params.items(), grads.values())}
            _, state = opt.update(grads, state)
        dcp.save({"optim": fo.dcp.state_dict(state)}, checkpoint_id=f"{folder}/tp")
        whole = {k: DTensor.from_local(remainder.join(state.master[k]), p.device_mesh, p.placements,
                                       shape=p.shape, stride=p.stride()).full_tensor()
                 for k, p in params.items()}
        if rank == 0:
            torch.save(whole, f"{folder}/tp_masters.pt")
    finally:
        end_rank()


def test_split_masters_of_fsdp2_over_tensor_parallel_params_load_at_one_rank(tmp_path):
    """Strided placements (FSDP2 over a tensor-parallel shard) keep their split factor one dim
    further in: the checkpoint loads at one rank as the masters the 4 ranks held (a placement
    shifted without it saved rows in another order, or chunks of the wrong sizes)."""
    mp.spawn(four_ranks_tp, args=(str(tmp_path),), nprocs=4)
    want = torch.load(tmp_path / "tp_masters.pt")
    opt = fo.adamw(1e-2, weight_decay=0.1, store_param_remainders=True)
    like = opt.init(tp_params())
    dcp.load({"optim": fo.dcp.state_dict(like, loading=True)}, checkpoint_id=tmp_path / "tp",
             planner=fo.dcp.StrictLoadPlanner())
    for k in TP_SHAPES:
        assert torch.equal(remainder.join(like.master[k]).view(torch.int32),
                           want[k].view(torch.int32)), k


def test_block_wise_8bit_moments_are_refused_naming_the_leaf():
    params = {"w": torch.zeros(100_000)}
    state = fo.adamw(1e-2, nu_dtype=torch.uint8).init(params)
    with pytest.raises(ValueError, match="8-bit moments .*nu leaf 'w'.*fo.save/fo.load per rank"):
        fo.dcp.state_dict(state)
