"""Checkpoints: exact, strict, atomic, pickle-free; resume continues bit for bit."""

import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import zlib

import optree
import pytest
import safetensors.torch
import torch

import functional_offload as fo
from conftest import AHEAD, STALE, clone, grad_seq, make_params


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
    # values that do not exist (torch.load(map_location="meta")), after real ones in the order
    # the leaves are copied: refused before any is (the copy failed part-way, the state usable)
    bad = {k: v if k in ("1.count", "1.mu.scale") else v.to("meta") for k, v in sd.items()}
    with pytest.raises(fo.CheckpointError, match="a meta tensor"):
        fo.load_state_dict(bad, like)
    assert torch.equal(like[1].mu["scale"], torch.zeros_like(like[1].mu["scale"]))  # untouched
    assert int(like[1].count) == 0


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

    def crash(fd):  # the new file is written, not yet renamed over the old one
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        fo.save(state, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["opt.safetensors"]  # no temporary file left
    fo.load(path, make_opt().init(clone(params)))


def test_files_are_plain_safetensors(tmp_path):
    """Other safetensors readers read the files; files safetensors writes (with the same
    metadata, as earlier versions did) load."""
    opt, params, state = trained(2)
    sd = fo.state_dict(state)
    fo.save(state, tmp_path / "ours")
    theirs = safetensors.torch.load_file(tmp_path / "ours")
    assert theirs.keys() == sd.keys() and all(torch.equal(theirs[k], sd[k]) for k in sd)
    meta = split((tmp_path / "ours").read_bytes())[0]["__metadata__"]
    safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "theirs",
                                metadata=meta)
    loaded = fo.state_dict(fo.load(tmp_path / "theirs", opt.init(clone(params))))
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)


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


# ---- damaged files ---------------------------------------------------------------------------
def split(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file as (header, tensor bytes): 8-byte little-endian length, JSON, data."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8: 8 + n]), data[8 + n:]


def pack(header, body: bytes, length=None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + body


def with_meta(header: dict, **meta) -> dict:
    return dict(header, __metadata__={**header["__metadata__"], **meta})


def with_crcs(header: dict, edit) -> dict:
    crcs = json.loads(header["__metadata__"]["crc32"])
    return with_meta(header, crc32=json.dumps(edit(crcs)))


def damaged(data: bytes) -> dict[str, tuple[bytes, str]]:
    """Every way a file can be wrong: {case: (bytes, what the error must say)}."""
    h, body = split(data)
    raw = json.dumps(h).encode()
    first = next(k for k in h if k != "__metadata__")
    meta = h["__metadata__"]
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    return {
        "empty": (b"", "header length"),
        "shorter than the length field": (data[:5], "header length"),
        "header length past the end": (pack(h, body, length=2 ** 40), "header length"),
        "header length too short": (pack(raw, body, length=len(raw) - 3), "header"),
        "header garbage": (pack(b"\xff\xfe" * (len(raw) // 2), body), "header"),
        "header not an object": (pack(b"[1, 2]", body), "header"),
        "truncated data": (data[:-100], "truncated"),
        "trailing bytes": (data + b"\0" * 16, "bytes"),
        "tensor entry ill-typed": (pack(dict(h, **{first: "x"}), body), first),
        "unknown dtype": (pack(dict(h, **{first: dict(h[first], dtype="Q7")}), body), "Q7"),
        "offsets disagree with the shape":
            (pack(dict(h, **{first: dict(h[first], shape=[10 ** 6])}), body), first),
        "metadata missing":
            (pack({k: v for k, v in h.items() if k != "__metadata__"}, body), "metadata"),
        "metadata ill-typed": (pack(dict(h, __metadata__=["format"]), body), "metadata"),
        "format missing": (pack(dict(h, __metadata__={"crc32": meta["crc32"]}), body),
                           "not a functional_offload"),
        "crc32 missing": (pack(dict(h, __metadata__={"format": meta["format"]}), body), "crc32"),
        "crc32 not JSON": (pack(with_meta(h, crc32="{nope"), body), "crc32"),
        "crc32 not a dict": (pack(with_meta(h, crc32="[1, 2]"), body), "crc32"),
        "crc32 value not an int":
            (pack(with_crcs(h, lambda c: {k: str(v) for k, v in c.items()}), body), "crc32"),
        "crc32 value a bool": (pack(with_crcs(h, lambda c: {k: True for k in c}), body), "crc32"),
        "crc32 key missing":
            (pack(with_crcs(h, lambda c: {k: v for k, v in c.items() if k != first}), body), first),
        "crc32 key extra": (pack(with_crcs(h, lambda c: dict(c, ghost=0)), body), "ghost"),
        "tensor bytes flipped": (bytes(flipped), "CRC"),
    }


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    _, params, state = trained(1)
    path = tmp_path_factory.mktemp("good") / "opt.safetensors"
    fo.save(state, path)
    assert set(damaged(path.read_bytes())) == set(CASES)
    return path.read_bytes(), params


CASES = ["empty", "shorter than the length field", "header length past the end",
         "header length too short", "header garbage", "header not an object", "truncated data",
         "trailing bytes", "tensor entry ill-typed", "unknown dtype",
         "offsets disagree with the shape", "metadata missing", "metadata ill-typed",
         "format missing", "crc32 missing", "crc32 not JSON", "crc32 not a dict",
         "crc32 value not an int", "crc32 value a bool", "crc32 key missing", "crc32 key extra",
         "tensor bytes flipped"]


@pytest.mark.parametrize("case", CASES)
def test_every_damaged_file_raises_checkpoint_error(tmp_path, good_file, case):
    data, params = good_file
    bad, what = damaged(data)[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(bad)
    like = make_opt().init(clone(params))
    with pytest.raises(fo.CheckpointError) as err:
        fo.load(path, like)
    assert str(path) in str(err.value) and what in str(err.value), str(err.value)
    untouched = all(torch.equal(x, torch.zeros_like(x)) for x in optree.tree_leaves(like[1].mu))
    assert untouched


def test_extra_tensor_in_file_names_file_and_key(tmp_path):
    _, params, state = trained(1)
    sd = {k: v.contiguous() for k, v in fo.state_dict(state).items()}
    sd["extra"] = torch.zeros(2)
    path = tmp_path / "extra.safetensors"
    good = tmp_path / "good.safetensors"
    fo.save(state, good)
    meta = split(good.read_bytes())[0]["__metadata__"]
    crcs = json.loads(meta["crc32"])
    crcs["extra"] = zlib.crc32(bytes(8))  # two fp32 zeros
    safetensors.torch.save_file(sd, path, metadata=dict(meta, crc32=json.dumps(crcs)))
    with pytest.raises(fo.CheckpointError, match=re.escape(str(path)) + ".*unexpected.*extra"):
        fo.load(path, make_opt().init(clone(params)))


def test_missing_file_raises_file_not_found(tmp_path):
    _, params, _ = trained(1)
    with pytest.raises(FileNotFoundError):
        fo.load(tmp_path / "absent.safetensors", make_opt().init(clone(params)))


# ---- concurrency ------------------------------------------------------------------------------
RACING_SAVER = """
import sys, time
import torch
import functional_offload as fo

opt = fo.adamw(1e-2)
a = opt.init({"w": torch.zeros(1000)})
_, b = opt.update({"w": torch.ones(1000)}, opt.init({"w": torch.zeros(1000)}))
fo.save(a, sys.argv[1])
print("saving", flush=True)
stop = time.monotonic() + float(sys.argv[2])
while time.monotonic() < stop:
    fo.save(b, sys.argv[1])
    fo.save(a, sys.argv[1])
"""


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def test_load_racing_saves_reads_whole_files(tmp_path):
    """Another process renames new files over the path while loads read it: each load sees
    one whole file, the old or the new, never a mix reported as corrupt."""
    path = tmp_path / "opt.safetensors"
    saver = subprocess.Popen([sys.executable, "-c", RACING_SAVER, str(path), "2"],
                             stdout=subprocess.PIPE, env=child_env(), text=True)
    try:
        assert saver.stdout.readline() == "saving\n"
        counts = set()
        while saver.poll() is None:
            counts.add(int(fo.load(path, fo.adamw(1e-2).init({"w": torch.zeros(1000)})).count))
    finally:
        saver.kill()
        saver.wait()
    assert counts <= {0, 1} and counts


SLOW_SAVE = """
import os, sys, time
import torch
import functional_offload as fo

def stalled(fd):  # the temporary file is written, not yet renamed
    print("writing", flush=True)
    time.sleep(600)

os.fsync = stalled
fo.save({"w": torch.zeros(3)}, sys.argv[1])
"""


def test_killed_save_leaves_no_temp_file_behind_the_next_save(tmp_path):
    """A save killed mid-write leaves its temporary file; the next save of that path removes
    it, but never the file of a save still running."""
    path = tmp_path / "opt.safetensors"
    fo.save({"w": torch.ones(3)}, path)
    child = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path)], stdout=subprocess.PIPE,
                             env=child_env(), text=True)
    try:
        assert child.stdout.readline() == "writing\n"
        fo.save({"w": torch.ones(3)}, path)  # the child is alive: its file stays
        assert len(os.listdir(tmp_path)) == 2
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    fo.save({"w": torch.full((3,), 2.0)}, path)
    assert os.listdir(tmp_path) == ["opt.safetensors"]
    assert torch.equal(fo.load(path, {"w": torch.zeros(3)})["w"], torch.full((3,), 2.0))


def test_saves_work_on_file_systems_without_locks(tmp_path, monkeypatch):
    """Where flock fails (Lustre without flock), saves and loads work; nothing that might be a
    live save's file is removed."""
    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / "opt.safetensors"
    (tmp_path / ".opt.safetensors.tmp-0123456789abcdef").write_bytes(b"partial")
    fo.save({"w": torch.ones(3)}, path)
    fo.save({"w": torch.full((3,), 2.0)}, path)
    assert torch.equal(fo.load(path, {"w": torch.zeros(3)})["w"], torch.full((3,), 2.0))
    assert len(os.listdir(tmp_path)) == 2


# ---- errors say what was given and what to do ------------------------------------------------
def untouched(like) -> bool:
    return all(torch.equal(x, torch.zeros_like(x)) for x in optree.tree_leaves(like[1].mu))


def test_foreign_files_are_named_for_what_they_are_not_called_corrupt(tmp_path):
    import gzip
    import pickle

    import numpy as np
    _, params, state = trained(1)
    sd = fo.state_dict(state)
    torch.save(sd, tmp_path / "zip.pt")
    torch.save(sd, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "dump.pkl").write_bytes(pickle.dumps({"a": 1}))
    np.save(tmp_path / "a.npy", np.zeros(3))
    fo.save(state, tmp_path / "good")
    (tmp_path / "good.gz").write_bytes(gzip.compress((tmp_path / "good").read_bytes()))
    for name, what in [("zip.pt", "a zip archive, as torch.save writes"),
                       ("legacy.pt", "a pickle"), ("dump.pkl", "a pickle"),
                       ("a.npy", "a NumPy .npy file"), ("good.gz", "gzip-compressed")]:
        like = make_opt().init(clone(params))
        with pytest.raises(fo.CheckpointError) as e:
            fo.load(tmp_path / name, like)
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / name}: not a functional_offload checkpoint"), msg
        assert what in msg and "corrupt" not in msg, msg
        assert untouched(like)
    # what the torch.save message says to do works
    like = make_opt().init(clone(params))
    fo.load_state_dict(torch.load(tmp_path / "zip.pt", weights_only=True), like)
    assert all(torch.equal(a, b) for a, b in zip(fo.state_dict(like).values(), sd.values()))


def test_a_directory_is_not_a_checkpoint_file(tmp_path):
    _, params, _ = trained(1)
    with pytest.raises(fo.CheckpointError, match="is a directory.*fo.dcp.state_dict"):
        fo.load(tmp_path, make_opt().init(clone(params)))


def test_an_optimizer_given_for_a_state_is_refused_naming_the_fix(tmp_path):
    opt, params, state = trained(1)
    fo.save(state, tmp_path / "ckpt")
    sd = fo.state_dict(state)
    torch_opt = fo.TorchOptimizer([torch.nn.Parameter(torch.zeros(2))], fo.adamw, lr=1e-3)
    path = tmp_path / "ckpt"
    cases = [
        (lambda: fo.load(path, like=opt),
         r"like is an Optimizer, not a state: .*opt\.init\(params\)"),
        (lambda: fo.load(path, like=opt.init), r"like is a function .*opt\.init\(params\)"),
        (lambda: fo.load(path, like=torch_opt), r"like is a TorchOptimizer .*fo_states"),
        (lambda: fo.load(path, like=fo.clip_by_global_norm(1.0)),
         "like is a GradientTransformation"),
        (lambda: fo.load_state_dict(sd, opt), "like is an Optimizer, not a state"),
        (lambda: fo.save(opt, tmp_path / "x"), "state is an Optimizer, not a state"),
        (lambda: fo.state_dict(opt), "state is an Optimizer, not a state"),
        (lambda: fo.placement_report(opt), "state is an Optimizer, not a state"),
        (lambda: fo.state_dict((state, opt)),
         r"state leaf '1.init' is a function .*not optimizers"),
    ]
    for call, match in cases:
        with pytest.raises(TypeError, match=match):
            call()
    assert not (tmp_path / "x").exists()


def test_key_mismatches_give_the_totals(tmp_path):
    opt, params, state = trained(1)
    sd = fo.state_dict(state)
    like = make_opt().init(clone(params))
    n = len(sd)
    fewer = {k: v for k, v in sd.items() if ".mu." not in k and ".nu." not in k}  # 10 gone
    extra = dict(sd, **{f"extra.{i}": torch.zeros(1) for i in range(11)})
    ghost = {**fewer, "ghost": torch.zeros(1)}
    for bad, says in [(fewer, ["missing 10 keys, the first 8 ['1.mu."]),
                      (extra, ["unexpected 11 keys, the first 8 ['extra."]),
                      (ghost, ["missing 10 keys, the first 8 [", "; unexpected 1 key ['ghost']"])]:
        with pytest.raises(fo.CheckpointError) as e:
            fo.load_state_dict(bad, like)
        msg = str(e.value)
        assert f"(the state has {n} keys, the checkpoint {len(bad)}): " in msg, msg
        assert all(x in msg for x in says), msg
    assert untouched(like)
    fo.save(state, tmp_path / "good")
    h, body = split((tmp_path / "good").read_bytes())
    keys = sorted(k for k in h if k != "__metadata__")
    for edit, says in [(lambda c: {k: v for k, v in c.items() if k not in keys[:9]},
                        f"lacks 9 keys, the first 8 {keys[:8]!r} of the file's {len(keys)}"),
                       (lambda c: dict(c, **{f"ghost{i}": 0 for i in range(9)}),
                        "lists 9 keys, the first 8 ['ghost0'")]:
        (tmp_path / "bad").write_bytes(pack(with_crcs(h, edit), body))
        with pytest.raises(fo.CheckpointError) as e:
            fo.load(tmp_path / "bad", like)
        assert says in str(e.value), str(e.value)


def test_saving_a_failed_state_says_it_is_failed_and_how_to_recover(tmp_path):
    from functional_offload.testing import fail_host_kernel
    from conftest import small_executor
    params = make_params(big=True)
    opt = fo.adamw(1e-2, executor=small_executor())
    state = opt.init(params)
    fo.save(state, tmp_path / "good")
    with fail_host_kernel(after=1):
        with pytest.raises(fo.HostStepError):
            opt.update(grad_seq(params, 1)[0], state)
    with pytest.raises(fo.StateError, match=r"^cannot save: this AdamState is failed .*"
                       r"Load the last checkpoint into it \(fo.load\(path, like=state\)\)"):
        fo.save(state, tmp_path / "next")
    assert not (tmp_path / "next").exists()
    with pytest.raises(fo.StateError, match="^cannot take a state_dict: this AdamState is failed"):
        fo.state_dict(state)


MODES = {  # the same optimizer in each mode; on the CPU only the delayed one keeps fp32 masters
    "plain": dict(),
    "delayed": dict(delayed=STALE),
    "remainders": dict(store_param_remainders=True),
    "delayed_remainders": dict(delayed=STALE, store_param_remainders=True),
    "ahead": dict(delayed=AHEAD),
    "ahead_remainders": dict(delayed=AHEAD, store_param_remainders=True),
}


def _mode_opt(mode):
    return fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1, **MODES[mode]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("before, after", [(a, b) for a in MODES for b in MODES if a != b])
def test_a_checkpoint_of_one_mode_continues_in_any_other_exactly(tmp_path, before, after, dtype):
    """Switching modes through a checkpoint (exact warm-up, then delayed; delayed, then exact)
    continues the trajectory bit for bit: grads that do not depend on the params make every
    mode apply the same updates, so the switched run equals one mode's run throughout."""
    params0 = make_params(dtype=dtype)
    grads = grad_seq(params0, 6)
    straight = clone(params0)
    opt = _mode_opt("plain")
    s = opt.init(straight)
    for g in grads:
        straight, s = opt.update(g, s)
    switched = clone(params0)
    first = _mode_opt(before)
    s1 = first.init(switched)
    for g in grads[:3]:
        switched, s1 = first.update(g, s1)
    fo.save(s1, tmp_path / "a.safetensors")
    switched = clone(fo.params_of(s1))  # the model's checkpoint, loaded after the optimizer's
    second = _mode_opt(after)
    fresh = {k: torch.zeros_like(v) if torch.is_tensor(v) else optree.tree_map(torch.zeros_like, v)
             for k, v in switched.items()}
    s2 = fo.load(tmp_path / "a.safetensors", like=second.init(fresh))
    with torch.no_grad():
        optree.tree_map(lambda dst, src: dst.copy_(src), fresh, switched)
    for g in grads[3:]:
        fresh, s2 = second.update(g, s2)
    fo.flush(s2)
    for a, b in zip(optree.tree_leaves(fresh), optree.tree_leaves(straight)):
        assert torch.equal(a, b)
    want, got = fo.state_dict(s), fo.state_dict(s2)
    for k in want.keys() & got.keys():
        assert torch.equal(want[k], got[k]), k
    assert int(s2[1].count) == 6


def test_a_mirror_master_of_another_shape_is_refused_naming_it(tmp_path):
    opt = _mode_opt("delayed")
    params = make_params()
    s = opt.init(params)
    params, s = opt.update(grad_seq(params, 1)[0], s)
    sd = dict(fo.state_dict(s))
    sd["1.master.scale"] = torch.zeros(2)
    with pytest.raises(fo.CheckpointError, match=r"1\.master\.scale"):
        fo.load_state_dict(sd, _mode_opt("plain").init(make_params()))


@pytest.mark.parametrize("wrap", ["multi_steps", "apply_if_finite"])
def test_a_load_into_a_consumed_wrapper_state_is_refused(tmp_path, wrap):
    """A wrapper's state consumed by an update (a MultiSteps micro-step, a skipped non-finite
    step), whose inner optimizer state was not: the newer state shares its buffers, so a load
    into it is refused and the newer state is left as it was."""
    if wrap == "multi_steps":
        opt, bad = fo.MultiSteps(fo.sgd(1.0), every_k=2), torch.ones(2)
    else:
        opt, bad = fo.apply_if_finite(fo.adamw(1e-2)), torch.tensor([float("nan"), 0.0])
    params = {"w": torch.zeros(2)}
    s0 = opt.init(params)
    fo.save(s0, tmp_path / "s")
    params, s1 = opt.update({"w": bad}, s0)  # consumes s0; its inner state goes on in s1
    before = {k: v.clone() for k, v in fo.state_dict(s1).items()}
    for load in (lambda: fo.load(tmp_path / "s", like=s0),
                 lambda: fo.load_state_dict(before, like=s0)):
        with pytest.raises(fo.StateError, match="consumed"):
            load()
    after = fo.state_dict(s1)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("n", [37, 70_000], ids=["packed", "alone"])
def test_a_master_saved_beside_a_narrower_param_loads_exactly_into_a_wider_one(tmp_path, n):
    """A bf16 param's fp32 master saved, the param made fp32, the checkpoint loaded into a
    fresh state (which keeps no master of an fp32 param): the param takes the master's exact
    value, and the next steps are those of the run that was not reloaded."""
    gen = torch.Generator().manual_seed(0)
    start = {k: torch.randn(n, generator=gen).bfloat16() for k in "ab"}
    grads = [{k: torch.randn(n, generator=gen) for k in "ab"} for _ in range(3)]

    def run(reload: bool) -> torch.Tensor:
        params = {k: v.clone() for k, v in start.items()}
        opt = fo.adamw(1e-2)
        state = opt.init(params)
        for i, g in enumerate(grads):
            if i == 2:
                fo.save(state, tmp_path / "ck")
                params["b"].data = params["b"].data.float()
                if reload:
                    state = fo.load(tmp_path / "ck", like=opt.init(params))
            params, state = opt.update({k: g[k].to(p.dtype) for k, p in params.items()}, state)
        return params["b"]

    assert torch.equal(run(True), run(False))
