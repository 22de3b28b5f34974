"""The native host kernels: built per CPU capability, every registered op agrees with its torch
reference (the registry's tests), and without a compiler the torch kernel takes over, loudly."""

import os
import subprocess
import sys

import pytest
import torch

from functional_offload.kernels import native
from conftest import KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_the_build_is_kept_per_cpu_capability():
    """A cache shared by machines with different CPUs never loads a build made for another
    instruction set: the build's folder is named after the capability it was compiled for."""
    folder = os.path.basename(os.path.dirname(native.module().__file__))
    assert torch.backends.cpu.get_cpu_capability() in folder.split("-")
    assert set(native.ops()) >= {"adam", "sgd", "sgd_momentum", "lion"}


def test_without_a_compiler_the_torch_kernel_runs_with_a_warning(tmp_path):
    code = (
        "import warnings, torch, functional_offload as fo\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    opt = fo.adamw(0.1, weight_decay=0.0)\n"
        "    params, state = opt.update({'w': torch.ones(3)}, opt.init({'w': torch.ones(3)}))\n"
        "print('warned', any('native CPU kernel unavailable' in str(x.message) for x in w))\n"
        "print('params', params['w'].tolist())\n")
    env = dict(os.environ, CXX="/bin/false", CC="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path),
               PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warned True" in out.stdout
    assert "params [0.9000000357627869, 0.9000000357627869, 0.9000000357627869]" in out.stdout  # as torch
