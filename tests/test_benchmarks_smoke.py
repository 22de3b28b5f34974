"""The benchmark scripts run on the CPU (tiny sizes, in this process; no timings are checked)."""

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import convergence  # noqa: E402
import cpu_loop  # noqa: E402
import fixed_costs  # noqa: E402
import gpt  # noqa: E402
import host_floor  # noqa: E402
import offload_step  # noqa: E402


@pytest.mark.parametrize("size, leaves, params", [("1.3b", 292, 1_315_819_520), ("2.7b", 388, 2_651_673_600),
                                                  ("13b", 496, 13_168_266_240)])
def test_gpt_counts(size, leaves, params):
    model = gpt.build(size, "meta")
    assert (gpt.count_leaves(model), gpt.count_params(model)) == (leaves, params)


def test_gpt_tiny_is_seeded_and_every_leaf_gets_a_grad():
    a, b = gpt.build("tiny", "cpu", torch.float32), gpt.build("tiny", "cpu", torch.float32)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    gpt.loss(a, *gpt.batch(a.cfg, 128, "cpu")).backward()
    assert all(p.grad is not None for p in a.parameters())


def test_offload_step_systems_and_table(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["offload_step.py", "--smoke", "--steps", "1"])
    args = offload_step.parse()
    rows = [offload_step.run_one(s, args) for s in ("fwdbwd", "gpu32", "plain:1", "stream:1", "delayed:1")]
    for r in rows:
        assert r["step_s"] > 0 and r["mean_s"] > 0, r
    assert rows[2]["offloaded"] == rows[2]["params"] == gpt.count_params(gpt.build("tiny", "meta"))
    rows.append({"system": "floor", "kernel_gelems": 1.0, "kernel16_gelems": 1.0, "numel": 1,
                 "threads": 1, "copy_gbs": 1.0, "triad_gbs": 1.0})
    assert any(line.startswith("delayed:1") for line in offload_step.table(rows, args))


def test_host_floor_measures():
    r = host_floor.measure([(4096,), (100,)], threads=1, reps=1, dram_numel=1 << 16)
    assert r["numel"] == 4196 and r["kernel_gelems"] > 0 and r["triad_gbs"] > 0


def test_cpu_loop_ours_matches_torch():
    args = argparse.Namespace(steps=1, warmup=1)
    rows = cpu_loop.run("flat", cpu_loop.flat_shapes(40_000), args, threads=1)
    assert {r["system"] for r in rows} == {"torch fused", "torch foreach", "ours", "ours native"}
    assert all(r["allclose"] for r in rows), rows


@pytest.mark.parametrize("clip, layout", [(False, "flat"), (True, "flat"), (False, "gpt")])
def test_fixed_costs_runs(clip, layout):
    args = argparse.Namespace(device="cpu", dtype="float32", numel=256, warmup=1, updates=2,
                              clip=clip, layout=layout, width=32)
    for system in fixed_costs.SYSTEMS:
        if system in ("devicete", "fusedadam"):  # TransformerEngine's: CUDA only
            continue
        assert fixed_costs.run_one(system, 4, args)["mean_ms"] > 0


def test_fsdp2_check_and_a_system_on_one_gloo_rank(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2_step

    monkeypatch.setattr(sys, "argv", ["fsdp2_step.py", "--smoke", "--steps", "1", "--threads", "1"])
    args = fsdp2_step.parse()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        out = fsdp2_step.check(args, torch.device("cpu"), mesh)
        for m in out["modes"].values():
            assert m["max_param_diff"] < fsdp2_step.PARAM_TOL
            assert all(abs(n["fo"] - n["torch"]) <= fsdp2_step.NORM_TOL * n["torch"] for n in m["norms"])
        assert fsdp2_step.run_system("delayed:1", args, torch.device("cpu"), mesh)["mean_s"] > 0
    finally:
        dist.destroy_process_group()


def test_host_memory_measures():
    import host_memory

    r = host_memory.measure([(1 << 16,)], threads=[1], reps=1, copy_bytes=1 << 22, copy_piece=1 << 20)
    assert {"fp32", "bf16m"} <= set(r["formats"]) and r["formats"] == host_memory.available_formats()
    assert [(k["format"], k["threads"]) for k in r["kernel"]] == [(f, 1) for f in r["formats"]]
    for k in r["kernel"]:
        assert k["gparams_s"] > 0 and k["gbs"] == pytest.approx(k["bytes_per_param"] * k["gparams_s"])
    if torch.cuda.is_available():
        assert all(v > 0 for c in r["copies"].values() for v in c.values())
        assert [(o["format"], o["threads"]) for o in r["overlap"]] == [(f, 1) for f in r["formats"]]
        assert all(o["kernel_gbs"] > 0 and o["copies_gbs"] > 0 for o in r["overlap"])
    else:
        assert r["copies"] is None and r["overlap"] == [] and "copies skipped: no CUDA device" in r["notes"]


def test_adamw_parity_counts():
    import adamw_parity

    total, pairs = adamw_parity.differences(2)
    assert total == sum(torch.Size(s).numel() for s in adamw_parity.SHAPES)
    assert pairs[("torch for-loop", "ours, torch kernel")] == [0, 0]  # bit for bit
    assert all(len(c) == 2 and all(0 <= n <= total for n in c) for c in pairs.values())


def test_convergence_runs_save_and_tabulate(tmp_path):
    args = argparse.Namespace(device="cpu", model="smoke", seed=0, steps=4, batch=2, threads=1, eval_every=2,
                              val_sequences=8, save_every=2, out=str(tmp_path))
    for run in ("torch", "stream", "plain", "stale", "delayed"):
        convergence.run_one(run, args)
    records = convergence.load(str(tmp_path))
    assert records["stale"]["exact_steps"] == 0 and len(records["stale"]["val"]) == 2
    lines = "\n".join(convergence.table(records))
    assert "| stream |" in lines and "yes (= plain)" in lines
