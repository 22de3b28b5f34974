"""DTensor params (FSDP2's sharded leaves): each rank's state and update use its local shard."""

import optree
import pytest
import torch
import torch.distributed as dist

import functional_offload as fo
from conftest import clone, grad_seq, make_params

tensor_api = pytest.importorskip("torch.distributed.tensor")


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_dtensor_params_match_plain_tensors(mesh, tmp_path):
    shard = [tensor_api.Shard(0)]
    params = make_params(dtype=torch.bfloat16)
    grads = grad_seq(params, 5)
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1))

    plain = clone(params)
    s = opt.init(plain)
    for g in grads:
        plain, s = opt.update(g, s)

    dparams = optree.tree_map(lambda t: tensor_api.distribute_tensor(t.clone(), mesh, shard), params)
    ds = opt.init(dparams)
    for g in grads:
        dg = optree.tree_map(lambda t: tensor_api.distribute_tensor(t, mesh, shard), g)
        dparams, ds = opt.update(dg, ds)
    for a, b in zip(optree.tree_leaves(dparams), optree.tree_leaves(plain)):
        assert isinstance(a, tensor_api.DTensor) and torch.equal(a.to_local(), b)
    assert all(type(m) is torch.Tensor for m in optree.tree_leaves(ds[1].master))  # local shards
    fo.save(ds, tmp_path / "rank0.safetensors")  # per-rank state checkpoint
    assert int(fo.load(tmp_path / "rank0.safetensors", opt.init(dparams))[1].count) == 5


def test_adafactor_factored_state_is_saved_like_its_params(mesh, tmp_path):
    """Adafactor on DTensor params (a mesh of one rank): DCP sees each factor laid out like its
    param (sharded along the dims it keeps, replicated along the one it reduces), so a
    checkpoint of the DTensor run loads into the plain one and back, bit for bit."""
    import torch.distributed.checkpoint as dcp

    import functional_offload.dcp  # noqa: F401  (fo.dcp)

    shard, whole = [tensor_api.Shard(0)], [tensor_api.Replicate()]
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 8, generator=g), "t": torch.randn(2, 3, 4, generator=g),
              "b": torch.randn(6, generator=g), "s": torch.randn((), generator=g)}
    grads = grad_seq(params, 4)
    opt = fo.adafactor(1e-2, weight_decay=0.1, ema_decay=0.9)

    def dtensors(tree):
        return {k: tensor_api.distribute_tensor(v.clone(), mesh, shard if v.dim() else whole)
                for k, v in tree.items()}

    def train(params, state, gs, sharded):
        for g in gs:
            params, state = opt.update(dtensors(g) if sharded else g, state)
        return params, state

    def values(tree):
        return {k: v.to_local() if isinstance(v, tensor_api.DTensor) else v
                for k, v in tree.items()}

    plain, ps = train(clone(params), opt.init(clone(params)), grads[:2], False)
    dparams = dtensors(params)
    dparams, ds = train(dparams, opt.init(dparams), grads[:2], True)
    assert all(torch.equal(v, plain[k]) for k, v in values(dparams).items())
    sd = fo.dcp.state_dict(ds)
    layout = {k: (tuple(v.shape), tuple(v.placements)) for k, v in sd.items()
              if k.split(".")[0] in ("row_var", "col_var")}
    assert layout == {"row_var.w": ((6, 1), tuple(shard)), "col_var.w": ((1, 8), tuple(whole)),
                      "row_var.t": ((2, 3, 1), tuple(shard)),
                      "col_var.t": ((2, 1, 4), tuple(shard))}
    dcp.save({"optim": fo.dcp.state_dict(ps)}, checkpoint_id=tmp_path / "plain")
    dcp.save({"optim": sd}, checkpoint_id=tmp_path / "sharded")

    saved = clone(plain)  # the params the checkpoints go with

    def resume(path, sharded):
        live = dtensors(saved) if sharded else clone(saved)
        like = opt.init(live)
        dcp.load({"optim": fo.dcp.state_dict(like, loading=True)}, checkpoint_id=path,
                 planner=fo.dcp.StrictLoadPlanner())
        return train(live, like, grads[2:], sharded)

    want_params, want = train(plain, ps, grads[2:], False)
    want = fo.state_dict(want)
    for path, sharded in [("sharded", False), ("plain", True), ("sharded", True)]:
        got_params, got = resume(tmp_path / path, sharded)
        got = fo.state_dict(got)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), (path, sharded)
        assert all(torch.equal(v, want_params[k]) for k, v in values(got_params).items())
