"""Activation offload on FSDP2 modules: two CPU processes (gloo), grads identical to FSDP2 alone.

Each block is ``fully_shard``-ed and then wrapped (``off.wrap``), so a recomputed block runs its
forward in backward between FSDP2's pre-backward all-gather and post-backward reduce-scatter.
The ranks may choose different plans (their timings differ); that is safe here because a
recompute runs the block's forward without its module hooks, so it issues no collectives.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import end_rank

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

D, N, WORLD = 32, 4, 2


def build(mesh):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.LayerNorm(D), torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D))
        for _ in range(N)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model, x, off=None):
    model.zero_grad(set_to_none=True)
    with off.record(exclude=model) if off is not None else torch.enable_grad():
        h = x
        for block in model:
            h = h + block(h)
        loss = h.square().mean()
    loss.backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


def rank_main(rank, store):
    import functional_offload as fo
    from functional_offload.activations.testing import copy_on_cpu
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(1 + rank)
        x = torch.randn(64, D)
        want = step(build(mesh), x)
        with copy_on_cpu():
            offs = [fo.ActivationOffload(N, 2, recompute_groups=[2], min_bytes=1024),
                    fo.ActivationOffload(N, budget_bytes=160 << 10, min_bytes=1024)]
        for off in offs:
            model = build(mesh)
            off.wrap(list(model))
            for _ in range(3):  # profiling and planned steps, in budget mode
                got = step(model, x, off)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), off.plan
            assert off.held_bytes == 0 and off.stats["offloaded_bytes"] > 0
            assert off.stats["recomputed_groups"] > 0
        dist.barrier()  # both done before either tears the group down: gloo aborts a peer still
        #                 in a collective ("terminate called without an active exception")
    finally:
        end_rank()


def test_fsdp2_two_ranks_gloo(tmp_path):
    mp.spawn(rank_main, args=(os.path.join(tmp_path, "store"),), nprocs=WORLD, join=True)
