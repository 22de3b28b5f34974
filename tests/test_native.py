"""The native host kernels: built per CPU capability, once per machine whatever the checkout,
every registered op agrees with its torch reference (the registry's tests), and without a
compiler the torch kernel takes over, loudly."""

import os
import shutil
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


def test_the_build_key_is_the_sources_content_not_their_folder(tmp_path):
    """Two checkouts of the same sources share one build; a changed byte is another build."""
    csrc = os.path.join(ROOT, "functional_offload", "kernels", "csrc")
    a, b = shutil.copytree(csrc, tmp_path / "a" / "csrc"), shutil.copytree(csrc, tmp_path / "b")
    key = native.build_key(str(a))
    assert native.build_key(str(b)) == key == native.build_key()
    assert torch.backends.cpu.get_cpu_capability() in key.split("-")
    assert native.build_key(str(a), "AVX2") != native.build_key(str(a), "AVX512")
    math = b / "math.cpp"
    math.write_bytes(math.read_bytes().replace(b"}", b"} ", 1))
    assert native.build_key(str(b)) != key
    (a / "ops.h").write_bytes((a / "ops.h").read_bytes() + b"\n")  # headers count too
    assert native.build_key(str(a)) not in (key, native.build_key(str(b)))


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_another_checkout_loads_the_build_without_building(tmp_path):
    """A second checkout of the same sources (the package copied elsewhere) loads this
    process's build: no build line, the same module file."""
    shutil.copytree(os.path.join(ROOT, "functional_offload"), tmp_path / "functional_offload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import functional_offload.kernels.native as n\n"
            "assert n.__file__.startswith(%r), n.__file__\n"
            "print('loaded', n.module().__file__)\n" % str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"loaded {native.module().__file__}" in out.stdout
    assert "native CPU kernel" not in out.stderr, out.stderr[-2000:]


def test_a_build_says_so_before_it_starts(tmp_path):
    """The first use on a machine prints one line to stderr before the build runs (here the
    compiler fails at once, so the line is followed by the fallback's warning)."""
    env = dict(os.environ, CXX="/bin/false", CC="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path),
               PYTHONPATH=ROOT)
    code = "from functional_offload.kernels import native\nassert native.module() is None\n"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    first = next(i for i, x in enumerate(lines) if "native CPU kernel" in x)
    assert "building the native CPU kernel" in lines[first]
    assert "once per machine" in lines[first]
    assert any("unavailable" in x for x in lines[first + 1:])


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
