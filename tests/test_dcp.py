"""DCP checkpoints of the optimizer state of FSDP2 params: saved at one world size, loaded at
another straight into the state's tensors, training continuing on the same trajectory."""

from datetime import timedelta
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import functional_offload as fo

dcp = pytest.importorskip("torch.distributed.checkpoint")
import functional_offload.dcp  # noqa: E402,F401  (fo.dcp)
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,  # noqa: E402
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

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


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g).to(torch.bfloat16) for _ in range(BEFORE + AFTER)]


def train(model, opt, state, xs):
    params = dict(model.named_parameters())
    for x in xs:
        (model(x).square().sum() * 10).backward()  # grad norms > 1: clipping is on
        _, state = opt.update({n: p.grad for n, p in params.items()}, state)
        for p in params.values():
            p.grad = None
    return state


def full(sd: dict) -> dict:
    """Whole tensors (DTensors gathered: collective)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
            for k, v in sd.items()}


def snapshot(model, state) -> dict:
    return {"params": full(get_model_state_dict(model)), "state": full(fo.dcp.state_dict(state))}


def start(mesh=None):
    model = make_model()
    if mesh is not None:
        shard(model, mesh)
    opt = make_opt()
    return model, opt, opt.init(dict(model.named_parameters()))


def save(model, state, path):
    dcp.save({"model": get_model_state_dict(model), "optim": fo.dcp.state_dict(state)},
             checkpoint_id=path)


def resume(path, mesh=None):
    """A new model and state (sharded over ``mesh``, or plain), loaded from ``path``."""
    model, opt, like = start(mesh)
    sd = {"model": get_model_state_dict(model), "optim": fo.dcp.state_dict(like, loading=True)}
    dcp.load(sd, checkpoint_id=path, planner=fo.dcp.StrictLoadPlanner())
    set_model_state_dict(model, sd["model"])
    return model, opt, like


def two_ranks(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2,))
        xs = batches()
        model, opt, state = start(mesh)
        state = train(model, opt, state, xs[:BEFORE])
        save(model, state, f"{folder}/two")
        out = {"saved": snapshot(model, state)}
        out["straight"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
        for name in ("two", "one"):  # resume both checkpoints at 2 ranks
            model, opt, state = resume(f"{folder}/{name}", mesh)
            out[f"{name} loaded"] = snapshot(model, state)
            out[f"{name} resumed"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
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
        if rank == 0:
            torch.save(out, f"{folder}/two_ranks.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run at 1 rank (plain params, no process group) and one at 2 ranks (FSDP2), each
    saved after BEFORE steps and continued; the 2-rank job also resumes both checkpoints."""
    folder = tmp_path_factory.mktemp("dcp")
    xs = batches()
    model, opt, state = start()
    state = train(model, opt, state, xs[:BEFORE])
    save(model, state, folder / "one")
    one = {"saved": snapshot(model, state)}
    one["straight"] = snapshot(model, train(model, opt, state, xs[BEFORE:]))
    mp.spawn(two_ranks, args=(str(folder),), nprocs=2)
    return {"folder": folder, "one": one, "two": torch.load(folder / "two_ranks.pt")}


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
            torch.testing.assert_close(a[part][k].float(), b[part][k].float(), rtol=0, atol=1e-3,
                                       msg=f"{part} {k}")


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
            assert all(not v.any() for k, v in fo.state_dict(like).items() if ".mu." in k)

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
