"""Every mode on FSDP2 (``fully_shard``, DTensor params), 2 ranks: plain update, clipped chains,
grad streaming, the delayed update, ``fo.TorchOptimizer``, partial placement, bf16 params with
fp32 masters, fp32 params under FSDP2's mixed precision and ``apply_if_finite`` — each against
``torch.optim.AdamW`` (with ``clip_grad_norm_``) on the same FSDP2 model; the compact state
formats on shards (fixed grads: the split master against the fp32 master and the whole params,
8-bit moments in every form against their plain update); and the node-aware default executor.

One spawned 2-process job (``fsdp2_job.py``) runs all modes; each rank saves its shards and the
tests compare them rank by rank (both models are sharded alike, so this compares whole params).

Exactness. On the CPU, ours with ``cpu_kernel="torch"`` runs the ops of ``torch.optim.AdamW``
(single-tensor) in the same order, so the params are compared bit for bit; the clip norm is too,
as both sum the leaves' norms in the model's order (``dict(model.named_parameters())``).
The native kernel is held to ``atol=1e-6``. On GPUs (the ``cuda`` variant) the oracle's CUDA
kernels round differently, so comparisons with torch are ``atol=1e-5`` (a step that updated
nothing is off by about lr = 1e-2); ours against ours (streamed == plain) stays bit for bit.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("torch.distributed.fsdp")
import fsdp2_job as job  # noqa: E402
from fsdp2_job import CLIPS, NO_CLIP, STEPS, WORLD  # noqa: E402

import functional_offload as fo  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="module",
                params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, TWO_GPUS])])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Each rank's ``{mode: result}`` from one 2-process job (gloo on CPUs, NCCL on GPUs)."""
    folder = tmp_path_factory.mktemp(f"fsdp2-{request.param}")
    mp.spawn(job.job, args=(str(folder), request.param), nprocs=WORLD)
    out = [torch.load(folder / f"results-{r}.pt") for r in range(WORLD)]
    for r in out:
        r["device"] = request.param
    return out


def results(ranks: list[dict], mode: str) -> list[dict]:
    """``mode``'s result on every rank; fails with the traceback if it raised."""
    for r, res in enumerate(ranks):
        if "error" in res[mode]:
            pytest.fail(f"mode {mode!r} raised on rank {r}:\n{res[mode]['error']}")
    return [res[mode] for res in ranks]


def assert_same(got: dict, want: dict, atol: Optional[float], what: str) -> None:
    """Tensors under the same keys, equal bit for bit (``atol=None``) or within ``atol``."""
    assert got.keys() == want.keys(), what
    for k in got:
        a, b = got[k], want[k]
        if atol is None:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {k} differs by " \
                f"{(a.double() - b.double()).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=atol,
                                       msg=f"{what}: {k}")


def exact_on(ranks: list[dict]) -> bool:
    """Ours with the torch CPU kernel against torch's CPU ops: the same ops in the same order."""
    return ranks[0]["device"] == "cpu"


def oracle_atol(ranks: list[dict]) -> Optional[float]:
    """How close ours must be to torch: bit for bit on the CPU, ``1e-5`` on GPUs."""
    return None if exact_on(ranks) else 1e-5


def assert_every_param_moved(res: dict, what: str) -> None:
    """A mode that silently updated nothing (or some leaves only) fails here."""
    still = [k for k in res["params"] if res["params"][k].numel()
             and torch.equal(res["params"][k], res["start"][k])]
    assert not still, f"{what}: params not updated: {still}"


def test_plain_update_equals_torch_adamw(ranks):
    """``opt.update({name: p.grad}, state)`` after backward: each rank updates its shards."""
    for r, (ours, ref) in enumerate(zip(results(ranks, "plain"), results(ranks, "torch"))):
        assert_every_param_moved(ours, f"rank {r}")
        assert_same(ours["params"], ref["params"], oracle_atol(ranks), f"rank {r}")
        assert int(ours["state"]["count"]) == STEPS


def test_native_kernel_with_the_node_aware_default_executor(ranks):
    """The defaults under torchrun: the native CPU kernel, the default executor (pinned to this
    local rank's cores)."""
    for r, (ours, ref) in enumerate(zip(results(ranks, "plain native"), results(ranks, "torch"))):
        assert_every_param_moved(ours, f"rank {r}")
        assert_same(ours["params"], ref["params"], 1e-6 if exact_on(ranks) else 1e-5, f"rank {r}")


@pytest.mark.parametrize("mode,clip", [("clip", CLIPS), ("no clip", NO_CLIP)])
def test_clip_factor_is_global_and_equals_clip_grad_norm(ranks, mode, clip):
    """The norm spans every rank's shards: equal on all ranks and to ``clip_grad_norm_``'s."""
    ours = results(ranks, mode)
    ref = results(ranks, "torch clip" if mode == "clip" else "torch no clip")
    for r in range(WORLD):
        norms, factors = ours[r]["norms"], ours[r]["factors"]
        assert len(norms) == len(factors) == STEPS
        for i, (n, f, tn) in enumerate(zip(norms, factors, ref[r]["norms"])):
            assert torch.equal(n, ours[0]["norms"][i]) and torch.equal(f, ours[0]["factors"][i])
            if exact_on(ranks):
                assert torch.equal(n, tn), (r, i, n, tn)
                assert torch.equal(f, torch.clamp(clip / (tn + 1e-6), max=1.0)), (r, i, f)
            else:
                assert math.isclose(n.item(), tn.item(), rel_tol=1e-6), (r, i, n, tn)
        if mode == "clip":
            assert all(f < 1 for f in factors)
        else:
            assert all(f == 1 for f in factors)


def test_an_fp32_clip_norm_spans_every_shard_of_bf16_grads(ranks):
    """``clip_by_global_norm(norm_dtype=torch.float32)`` on bf16 DTensor grads: one factor on
    every rank, from the fp32 norm over all ranks' shards (summed by hand here); the default
    (torch's bf16 norm) differs from it."""
    ours = results(ranks, "bf16 clip")
    differs = False
    for r in range(WORLD):
        for i, (f, n, f16) in enumerate(zip(ours[r]["fp32_factors"], ours[r]["fp32_norms"],
                                            ours[r]["factors"])):
            assert f.dtype == torch.float32 and torch.equal(f, ours[0]["fp32_factors"][i])
            want = min(1.0, CLIPS / (n.item() + 1e-6))
            assert math.isclose(f.item(), want, rel_tol=1e-5), (r, i, f, want)
            differs = differs or f.item() != f16.float().item()
    assert differs


@pytest.mark.parametrize("mode,oracle", [("clip", "torch clip"), ("no clip", "torch")])
def test_clipped_chain_equals_torch(ranks, mode, oracle):
    """``fo.chain(fo.clip_by_global_norm(c), fo.adamw(...))``, with a ``c`` that clips and one
    that does not, against ``clip_grad_norm_`` and ``AdamW``."""
    for r, (ours, ref) in enumerate(zip(results(ranks, mode), results(ranks, oracle))):
        assert_every_param_moved(ours, f"rank {r}")
        assert_same(ours["params"], ref["params"], oracle_atol(ranks), f"{mode}, rank {r}")


@pytest.mark.parametrize("mode,committed", [("", None), (" clip", False), (" no clip", True)])
def test_stream_equals_plain_and_streams_every_leaf(ranks, mode, committed):
    """FSDP2 calls the hooks on the sharded params after its reduce-scatter: every leaf is
    handed over during backward, and the result is the plain update's, bit for bit. With
    clipping in front, the step that ran ahead is kept when the factor is 1, redone otherwise
    (after a redo, the next steps hold their grads until a factor of 1 is seen)."""
    plain = "plain" if mode == "" else mode.strip()
    for r, (s, p) in enumerate(zip(results(ranks, "stream" + mode), results(ranks, plain))):
        assert s["arrived"] == [list(range(s["leaves"]))] * STEPS, f"rank {r}: not streamed"
        assert s["committed"] == ([committed] * STEPS if committed is not False
                                  else [False] + [None] * (STEPS - 1))
        assert_every_param_moved(s, f"rank {r}")
        assert_same(s["params"], p["params"], None, f"stream{mode}, rank {r}")
        assert_same(s["state"], p["state"], None, f"stream{mode} state, rank {r}")


def test_delayed_update_is_torch_adamw_one_step_late(ranks):
    """``delayed`` without the look-ahead (every step in flight; clipped): before ``fo.flush``
    the params are torch's delayed recursion one step behind; after it, the recursion's last
    params."""
    for r, (ours, ref) in enumerate(zip(results(ranks, "delayed clip"),
                                        results(ranks, "torch delayed clip"))):
        assert_every_param_moved(ours, f"rank {r}")
        assert_same(ours["unflushed"], ref["lagging"], oracle_atol(ranks), f"unflushed, rank {r}")
        assert_same(ours["params"], ref["params"], oracle_atol(ranks), f"flushed, rank {r}")



def test_the_lookahead_lands_the_next_steps_params_on_shards(ranks):
    """``delayed=True`` (the look-ahead; clipped) on local shards: before ``fo.flush`` each
    shard holds the look-ahead of the last step — within a fraction of a step of the params the
    flush then lands, where the params without it are that whole step behind."""
    for r, (ours, stale) in enumerate(zip(results(ranks, "ahead clip"), results(ranks, "delayed clip"))):
        assert_every_param_moved(ours, f"rank {r}")
        off = lambda run: sum(float((run["unflushed"][k] - run["params"][k]).norm()) ** 2  # noqa: E731
                              for k in run["params"]) ** 0.5
        assert off(ours) < 0.35 * off(stale), (r, off(ours), off(stale))  # 0.22 measured (3rd step)

@pytest.mark.parametrize("ahead", ["", " ahead"])
def test_a_delayed_step_keeps_the_clip_s_new_shards(ranks, ahead):
    """A delayed step behind ``clip_by_global_norm`` on bf16 shards writes its new params into
    the clip's new local shards rather than copying them first, as on whole tensors: the
    params of the same clip whose shards are copied."""
    for r, (kept, copied) in enumerate(zip(results(ranks, "kept" + ahead),
                                           results(ranks, "copied" + ahead))):
        assert all(kept["written"].values()), f"rank {r}: {kept['written']}"
        assert not any(copied["written"].values()), f"rank {r}: {copied['written']}"
        assert_same(kept["params"], copied["params"], None, f"rank {r}")


@pytest.mark.parametrize("front", list(job.REWRAPS))
def test_a_fresh_front_s_shards_made_anew_over_given_or_shared_ones_are_copied(ranks, front):
    """A ``fresh_updates`` front whose new DTensors hold the caller's shards (made anew over
    them) or one shard for two leaves is copied by the landing, not kept: the params of the
    same front without ``fresh_updates``, and the caller's grads untouched."""
    for r, (fresh, plain) in enumerate(zip(results(ranks, f"{front} True"),
                                           results(ranks, f"{front} False"))):
        assert not fresh["written"] and not plain["written"], f"rank {r}"
        assert_same(fresh["params"], plain["params"], None, f"rank {r}")


def test_torch_optimizer_s_clip_hands_its_new_shards_to_a_delayed_step(ranks):
    """``TorchOptimizer(max_grad_norm=..., delayed=...)`` on shards: the params of the chain
    whose landing keeps the clip's new shards."""
    for r, (ours, chain) in enumerate(zip(results(ranks, "kept torch optimizer"),
                                          results(ranks, "kept"))):
        assert_same(ours["params"], chain["params"], None, f"rank {r}")


def test_torch_optimizer_equals_torch_and_resumes_from_dcp(ranks):
    """``fo.TorchOptimizer(model.named_parameters(), fo.adamw, max_grad_norm=...)`` in a module
    loop (backward, ``step``, ``zero_grad``); its states saved with DCP and loaded into a fresh
    one continue bit for bit."""
    for r, (ours, ref) in enumerate(zip(results(ranks, "torch optimizer"),
                                        results(ranks, "torch clip"))):
        assert_every_param_moved(ours, f"rank {r}")
        assert_same(ours["params"], ref["params"], oracle_atol(ranks), f"rank {r}")
        assert_same(ours["resumed"], ours["params"], None, f"resumed, rank {r}")


def test_partial_placement_equals_torch(ranks):
    """``offload_fraction(0.5)`` decides per rank, on its local shards. CPU params keep all their
    state in host memory whatever the policy; on GPUs both parts are used."""
    for r, (ours, ref) in enumerate(zip(results(ranks, "half offloaded"), results(ranks, "torch"))):
        assert_every_param_moved(ours, f"rank {r}")
        assert_same(ours["params"], ref["params"], oracle_atol(ranks), f"rank {r}")
        assert ours["host_bytes"] > 0
        assert (ours["device_bytes"] == 0) == (ranks[0]["device"] == "cpu")


def test_bf16_params_with_fp32_masters_equal_torch_on_fp32_params(ranks):
    """bf16 params (fp32 masters) against torch AdamW on fp32 params that FSDP2 casts to bf16
    for compute and reduces in bf16 (``MixedPrecisionPolicy``): the same grads, so the masters
    are torch's params and our params their bf16 rounding. Streamed, the same bits."""
    ours, ref, streamed = (results(ranks, m) for m in ("bf16", "torch bf16 compute", "bf16 stream"))
    for r in range(WORLD):
        masters = {k.removeprefix("master."): v for k, v in ours[r]["state"].items()
                   if k.startswith("master.")}
        assert all(v.dtype == torch.float32 for v in masters.values())
        assert all(v.dtype == torch.bfloat16 for v in ours[r]["params"].values())
        assert_every_param_moved(ours[r], f"rank {r}")
        assert_same(masters, ref[r]["params"], oracle_atol(ranks), f"masters, rank {r}")
        assert_same(ours[r]["params"], {k: v.to(torch.bfloat16) for k, v in masters.items()},
                    None, f"params, rank {r}")
        assert_same(streamed[r]["params"], ours[r]["params"], None, f"streamed, rank {r}")
        assert_same(streamed[r]["state"], ours[r]["state"], None, f"streamed state, rank {r}")


def test_fp32_params_with_fsdp2_mixed_precision_equal_torch(ranks):
    """fp32 params, bf16 compute and fp32 grad reduction (``MixedPrecisionPolicy``), clipped: the
    params are the masters (on GPUs the host state gets an fp32 copy)."""
    for r, (ours, ref) in enumerate(zip(results(ranks, "mixed"), results(ranks, "torch mixed"))):
        assert_every_param_moved(ours, f"rank {r}")
        assert all(v.dtype == torch.float32 for v in ours["params"].values())
        assert_same(ours["params"], ref["params"], oracle_atol(ranks), f"rank {r}")


@pytest.mark.parametrize("streamed", [False, True], ids=["update", "stream"])
def test_apply_if_finite_skips_on_every_rank_when_one_rank_has_a_nan(ranks, streamed):
    """A NaN in one rank's shard of one grad: every rank must skip the step (else the shards
    diverge), whichever rank holds it (each rank counts its non-finite shards; the counts are
    summed over the mesh)."""
    seen = {}
    for nan_rank in range(WORLD):
        mode = f"nan on rank {nan_rank}" + (" stream" if streamed else "")
        seen[nan_rank] = results(ranks, mode)
    for nan_rank, per_rank in seen.items():
        for r, res in enumerate(per_rank):
            assert res == {"skipped": 1, "unchanged": True, "finite": True}, \
                f"NaN on rank {nan_rank} only: rank {r} got {res}"


def test_apply_if_finite_accepts_an_empty_shard():
    """A rank whose shard of a param is empty (a (1, d) head on 2 ranks): its local grad is
    empty, and the step must go on (single process here: the same local computation)."""
    opt = fo.apply_if_finite(fo.adamw(1e-2))
    params = {"head": torch.zeros(0, 4), "w": torch.zeros(3)}
    params, state = opt.update({"head": torch.zeros(0, 4), "w": torch.ones(3)}, opt.init(params))
    assert int(state.total_notfinite) == 0 and not params["w"].eq(0).any()


def test_adafactor_refuses_sharded_params_naming_one(ranks):
    """Adafactor's column means, step size and update clipping span the whole param: computed
    on a rank's shard they would depend on the world size, so ``init`` refuses sharded params
    (on every rank alike) with an error naming the param and the way out."""
    for r, res in enumerate(results(ranks, "adafactor")):
        assert res["refused"] is not None, f"rank {r}: sharded params were accepted"
        assert "param 'blocks.0.fc.bias' is sharded across ranks" in res["refused"]
        assert "fo.partition" in res["refused"]


def test_a_sharded_params_format_follows_the_whole_param_on_every_rank(ranks):
    """8-bit moments and the split master are kept for params above a size and not below: a
    param whose shards fall either side of it gets the same format on both ranks (each rank's
    shard decided alone: one rank 8-bit, the other fp32, silently; and fo.dcp refused on one
    rank while the other waited in its collective)."""
    res = results(ranks, "formats")
    assert sorted(r["rows"] for r in res) == [546, 547]
    assert all(r["mu"] == torch.uint8 and r["master"] == torch.int16 for r in res), res


def _rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a whole tensor, as FSDP2 shards dim 0."""
    return torch.chunk(x, WORLD, dim=0)[rank]


def _masters(res: dict) -> dict[str, torch.Tensor]:
    return {k.removeprefix("1.master."): v for k, v in res["state"].items()
            if k.startswith("1.master.")}


def test_split_masters_on_shards_are_the_fp32_masters_and_the_whole_params(ranks):
    """The split master (bf16 params, fp32 moments) on FSDP2 shards, clipped: each rank's masters
    and moments are the fp32 master's bits, its params those masters rounded (but where a master
    lies halfway between two bf16 values: ties away from zero); unclipped, each rank's masters are
    its rows of the same format stepped on the whole params in one process."""
    fp32, split, unclipped = (results(ranks, m) for m in ("fmt fp32", "fmt split", "fmt split no clip"))
    model = job.formats_model(torch.device("cpu"))
    params = {n: p.detach() for n, p in model.named_parameters()}
    opt = fo.adamw(**job.HYPER, cpu_kernel="torch", store_param_remainders=True)
    state = opt.init(params)
    for grads in job.format_grads(params, None):
        params, state = opt.update(grads, state)
    whole = {k.removeprefix("master."): v for k, v in fo.state_dict(state).items()
             if k.startswith("master.")}
    for r in range(WORLD):
        assert split[r]["dtypes"]["1.master.0.weight"] == "int16"
        assert fp32[r]["dtypes"]["1.master.0.weight"] == "float32"
        assert_same(split[r]["state"], fp32[r]["state"], None, f"state, rank {r}")
        for n, p in split[r]["params"].items():
            bits = _masters(fp32[r])[n].view(torch.int32)
            tie = (bits & 0xFFFF) == 0x8000
            differ = p != fp32[r]["params"][n]
            assert not (differ & ~tie).any(), f"{n}, rank {r}"
            assert not torch.equal(p, _rows(model.get_parameter(n).detach(), r)), f"{n} did not move"
        assert_same(_masters(unclipped[r]), {n: _rows(v, r) for n, v in whole.items()}, None,
                    f"unclipped masters against the whole params, rank {r}")


def test_8bit_moments_on_shards_step_alike_in_every_form(ranks):
    """The split master with block-wise 8-bit moments on FSDP2 shards (each rank's bytes quantize
    its own shard; the format follows the whole param), clipped: streamed, delayed (flushed) and
    saved then loaded (``fo.save``/``fo.load`` per rank) after the first step, the plain update's
    bits: params, masters, codes and scales."""
    plain = results(ranks, "fmt split8")
    for r, res in enumerate(plain):
        assert res["dtypes"]["1.mu.0.weight"] == res["dtypes"]["1.nu.2.weight"] == "uint8", r
        assert res["dtypes"]["1.master.2.weight"] == "int16" and res["dtypes"]["1.mu.0.bias"] == "float32"
    for mode in ("stream", "delayed", "resumed"):
        for r, res in enumerate(results(ranks, f"fmt split8 {mode}")):
            assert_same(res["params"], plain[r]["params"], None, f"{mode}, rank {r}")
            assert_same(res["state"], plain[r]["state"], None, f"{mode} state, rank {r}")


def test_node_aware_executors_split_the_cores(ranks):
    """With ``LOCAL_WORLD_SIZE=2`` (as torchrun sets it), the two ranks' default executors get
    disjoint CPU sets, thread counts summing to at most the physical cores, and their worker
    threads are pinned inside their own set."""
    node = results(ranks, "node")
    cores = node[0]["physical_cores"]
    if cores < WORLD:
        pytest.skip(f"{cores} physical core(s): {WORLD} local ranks cannot get disjoint cores")
    for r, n in enumerate(node):
        assert n["share"] == (r, WORLD, n["cpus"])
        assert n["threads"] == len(n["cpus"]) >= 1
        assert n["pinned_threads"] and set(n["pinned_threads"]) <= set(n["cpus"]), n
    assert not set(node[0]["cpus"]) & set(node[1]["cpus"])
    assert sum(n["threads"] for n in node) <= cores
