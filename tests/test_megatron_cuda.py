"""``examples/train_megatron.py`` on a small Megatron-Core ``GPTModel`` (TransformerEngine
layers): it trains and its optimizer state saves and loads. Needs a GPU, megatron-core and
TransformerEngine; skipped where any is missing (``import transformer_engine`` raises
RuntimeError, not ImportError, on machines without a GPU)."""

import os
import re
import subprocess
import sys

import pytest
import torch

try:
    import megatron.core  # noqa: F401
    import transformer_engine.pytorch  # noqa: F401
    READY = torch.cuda.is_available()
except Exception:
    READY = False

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not READY, reason="needs a GPU, megatron-core and TransformerEngine")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode,offload", [("stream", "1.0"), ("plain", "0.5")])
def test_megatron_example_trains_and_checkpoints(mode, offload, tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_megatron.py"), "--layers", "2",
         "--hidden", "256", "--heads", "4", "--seq", "128", "--steps", "11", "--mode", mode,
         "--offload", offload, "--save", str(tmp_path / "opt.safetensors")],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "MASTER_PORT": "29517"}).stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0]
    assert "saved and loaded the optimizer state" in out
