"""The examples run as the README says, and their losses go down."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return out, [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]


def test_train_mlp_trains_checkpoints_and_resumes():
    out, losses = run("train_mlp.py", "--steps", "150")
    assert "resumed into a fresh state" in out and "state bytes on host" in out
    after, before = re.search(r"full-batch loss (\d+\.\d+) \(was (\d+\.\d+)", out).groups()
    assert float(after) < float(before) < losses[0]


def test_train_both_trains():
    out, losses = run("train_both.py", "--steps", "40")
    assert losses[-1] < 0.5 * losses[0]
