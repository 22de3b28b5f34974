"""Checkpoints: exact, strict, atomic, pickle-free; resume continues bit for bit."""

import os

import optree
import pytest
import safetensors.torch
import torch

import functional_offload as fo
from conftest import clone, grad_seq, make_params


def make_opt():
    return fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1))


def trained(steps, dtype=torch.bfloat16):
    params = make_params(dtype=dtype)
    opt = make_opt()
    state = opt.init(params)
    for g in grad_seq(params, steps):
        params, state = opt.update(g, state)
    return opt, params, state


def test_round_trip_bit_exact(tmp_path):
    opt, params, state = trained(3)
    path = tmp_path / "ckpt" / "opt.safetensors"
    fo.save(state, path)
    loaded = fo.load(path, like=opt.init(clone(params)))
    a, b = fo.state_dict(state), fo.state_dict(loaded)
    assert a.keys() == b.keys() and "1.master.layer1.weight" in a and "1.count" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert int(loaded[1].count) == 3 and loaded[1].master["scale"].dtype == torch.float32


def test_state_dict_loads_with_weights_only(tmp_path):
    _, _, state = trained(2)
    torch.save(fo.state_dict(state), tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert torch.equal(sd["1.nu.scale"], state[1].nu["scale"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_continuity_bit_for_bit(tmp_path, dtype):
    params0 = make_params(dtype=dtype)
    grads = grad_seq(params0, 10)
    opt = make_opt()
    straight = clone(params0)
    s = opt.init(straight)
    for g in grads:
        straight, s = opt.update(g, s)

    p = clone(params0)
    s = opt.init(p)
    for g in grads[:5]:
        p, s = opt.update(g, s)
    fo.save(s, tmp_path / "opt")
    p = clone(p)  # the model's params, as restored from the model's own checkpoint
    s = fo.load(tmp_path / "opt", like=opt.init(p))
    for g in grads[5:]:
        p, s = opt.update(g, s)
    for x, y in zip(optree.tree_leaves(p), optree.tree_leaves(straight)):
        assert torch.equal(x, y)


def test_mismatch_errors_name_the_leaf(tmp_path):
    opt, params, state = trained(1)
    sd = dict(fo.state_dict(state))
    like = opt.init(clone(params))
    bad = dict(sd, **{"1.master.scale": sd["1.master.scale"].to(torch.bfloat16)})
    with pytest.raises(fo.CheckpointError, match="1.master.scale.*never cast"):
        fo.load_state_dict(bad, like)
    bad = dict(sd, **{"1.mu.scale": torch.zeros(2)})
    with pytest.raises(fo.CheckpointError, match="1.mu.scale"):
        fo.load_state_dict(bad, like)
    bad = {k: v for k, v in sd.items() if k != "1.nu.layer2.bias"}
    with pytest.raises(fo.CheckpointError, match="missing.*1.nu.layer2.bias"):
        fo.load_state_dict(bad, like)
    with pytest.raises(fo.CheckpointError, match="unexpected.*extra"):
        fo.load_state_dict(dict(sd, extra=torch.zeros(1)), like)
    other = fo.adamw(1e-2).init(clone(params))  # a different chain
    with pytest.raises(fo.CheckpointError):
        fo.load_state_dict(sd, other)
    assert torch.equal(like[1].mu["scale"], torch.zeros_like(like[1].mu["scale"]))  # untouched


def test_truncated_and_corrupt_files_raise(tmp_path):
    _, params, state = trained(1)
    path = tmp_path / "opt.safetensors"
    fo.save(state, path)
    data = path.read_bytes()
    like = make_opt().init(clone(params))
    (tmp_path / "trunc").write_bytes(data[: len(data) - 100])
    with pytest.raises(fo.CheckpointError, match="truncated or corrupt"):
        fo.load(tmp_path / "trunc", like)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    (tmp_path / "flip").write_bytes(bytes(flipped))
    with pytest.raises(fo.CheckpointError, match="CRC"):
        fo.load(tmp_path / "flip", like)
    safetensors.torch.save_file({"x": torch.zeros(1)}, tmp_path / "foreign")
    with pytest.raises(fo.CheckpointError, match="not a functional_offload"):
        fo.load(tmp_path / "foreign", like)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    _, params, state = trained(1)
    path = tmp_path / "opt.safetensors"
    fo.save(state, path)
    before = path.read_bytes()

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        fo.save(state, path)
    assert path.read_bytes() == before
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []
    monkeypatch.undo()
    fo.load(path, make_opt().init(clone(params)))


def test_sgd_and_guard_states_round_trip(tmp_path):
    params = make_params()
    opt = fo.apply_if_finite(fo.sgd(0.1, momentum=0.9))
    s = opt.init(params)
    params, s = opt.update(grad_seq(params, 1)[0], s)
    fo.save(s, tmp_path / "s")
    t = fo.load(tmp_path / "s", opt.init(clone(params)))
    assert torch.equal(t.inner_state.momentum["scale"], s.inner_state.momentum["scale"])
    assert set(fo.state_dict(t)) == {"notfinite_count", "total_notfinite", "inner_state.count",
                                     *(f"inner_state.momentum.{k}" for k in
                                       ("layer1.bias", "layer1.weight", "layer2.bias",
                                        "layer2.weight", "scale"))}
