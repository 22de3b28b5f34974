"""``examples/train_fsdp2.py`` under torchrun on 2 CPU processes (gloo): it trains, saves DCP
checkpoints, and a run resumed from one at another world size (1 process) continues the same
trajectory; in every mode, with any ``UserWarning`` an error (FSDP2 warns, for one, when a
sharded module returns a view)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed.fsdp")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--width", "32", "--layers", "2", "--vocab", "64", "--ctx", "16",
         "--lr", "1e-2", "--warmup", "2"]


def torchrun(nproc: int, *args: str) -> str:
    """The example's stdout under ``torchrun --standalone`` (a free port), importing this
    checkout's library, with warnings of the ``UserWarning`` kind turned into errors."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(ROOT, "examples", "train_fsdp2.py"),
           *SMALL, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path,
                               "PYTHONWARNINGS": "error::UserWarning"})
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]
    return proc.stdout


def losses(out: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"step (\d+) loss (\d+\.\d{5})", out)}


def test_train_save_and_resume_at_another_world_size(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = torchrun(2, "--steps", "6", "--save-every", "3", "--save", str(ckpt))
    assert "2 rank(s) (cpu), mode delayed" in straight
    assert (ckpt / "step-3").is_dir() and (ckpt / "step-6").is_dir()
    first = losses(straight)
    assert sorted(first) == [1, 2, 3, 4, 5, 6]
    assert first[6] < first[1] - 0.3  # it learns

    resumed = torchrun(1, "--steps", "3", "--resume", str(ckpt / "step-3"))
    assert "1 rank(s) (cpu), mode delayed" in resumed and "at step 3" in resumed
    again = losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for step, loss in again.items():  # the same trajectory, up to reductions in another order
        assert abs(loss - first[step]) <= 1e-3, (step, loss, first[step])


@pytest.mark.parametrize("mode", ["plain", "stream"])
def test_the_other_modes_train_without_warnings(mode):
    out = torchrun(2, "--steps", "3", "--mode", mode)
    assert f"2 rank(s) (cpu), mode {mode}" in out
    assert sorted(losses(out)) == [1, 2, 3]


def test_the_checkpoints_guide_shows_the_example_as_it_is():
    """docs/checkpoints.md's FSDP2 section quotes this example: its code lines are the
    example's, its commands run the example with options it has."""
    with open(os.path.join(ROOT, "docs", "checkpoints.md")) as f:
        doc = f.read()
    section = doc[doc.index("### A runnable example"):]
    with open(os.path.join(ROOT, "examples", "train_fsdp2.py")) as f:
        source = f.read()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for line in filter(str.strip, code.splitlines()):
        assert line in source, line
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()
    options = set(re.findall(r'add_argument\("(--[a-z-]+)"', source))
    for command in commands:
        words = command.split()
        assert words[:3] == ["torchrun", words[1], "examples/train_fsdp2.py"], command
        assert set(w for w in words[3:] if w.startswith("--")) <= options, command
