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
