"""The activation benchmark's CPU smoke mode runs, and every system's grads match no offload."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_smoke(tmp_path):
    out, png = tmp_path / "act.json", tmp_path / "act.png"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "activation_offload.py"),
                    "--device", "cpu", "--d", "32", "--blocks", "3", "--tokens", "64", "--seq",
                    "16", "--vocab", "64", "--heads", "2", "--steps", "1", "--warmup", "0",
                    "--systems", "none,checkpoint,ours:2,budget:0.5", "--out", str(out),
                    "--plot", str(png)], check=True, capture_output=True, text=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["none", "checkpoint", "ours:2", "budget:0.5"]
    assert all(r["grads"] == rows[0]["grads"] for r in rows)
    assert rows[-1]["budget_bytes"] > 0 and rows[-1]["decisions"] and png.stat().st_size > 0
