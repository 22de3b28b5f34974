"""The native host kernels: built per CPU capability, once per machine whatever the checkout,
every registered op agrees with its torch reference (the registry's tests), and without a
compiler the torch kernel takes over, loudly."""

import os
import shutil
import subprocess
import sys

import optree
import pytest
import torch

from functional_offload.kernels import blockwise, native
from conftest import KERNELS
from registry import OPTIMIZERS, torch_oracle

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


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
def test_adams_l2_term_rounds_once_as_torch_does():
    """Grads that nearly cancel the L2 term (g = -wd*p in bf16): torch's CPU code rounds
    g + wd*p once; rounded twice, one side got an exact 0 where the other a tiny value, which
    Adam's normalisation made a step of up to lr (on ~9% of these elements, before)."""
    e = next(x for x in OPTIMIZERS if x.name == "adam")
    wd, lr = 0.1, e.hypers["lr"]
    hypers = dict(e.hypers, weight_decay=wd, eps=1e-8)
    p = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    g = (-(wd * p.float())).bfloat16()
    opt = e.make(**hypers, cpu_kernel="native")
    state = opt.init({"w": p.clone()})
    _, state = opt.update({"w": g.clone()}, state)
    want = torch_oracle(torch.optim.Adam, **hypers)({"w": p.float()}, [{"w": g.float()}])["w"]
    assert int(((state.master["w"] - want).abs() > 0.01 * lr).sum()) == 0


@pytest.mark.skipif("native" not in KERNELS, reason="native kernel not built here")
@pytest.mark.parametrize("name", ["adamw-nowd", "sgd-momentum", "lion"])
@pytest.mark.parametrize("eight", [False, True])
def test_an_infinite_param_leaves_its_moments_as_torch_does(name, eight):
    """Without weight decay an infinite param stays infinite and its moments finite, as with
    the torch kernel (the L2 term evaluated with a zero coefficient made them NaN, and with
    8-bit moments every element of its block NaN the step after)."""
    e = next(x for x in OPTIMIZERS if x.name == name)
    hypers = dict(e.hypers, weight_decay=0.0)
    dtypes = {}
    if eight:
        dtypes = ({"mu_dtype": torch.uint8, "nu_dtype": torch.uint8} if name.startswith("adam")
                  else {"momentum_dtype": torch.uint8} if name.startswith("sgd")
                  else {"mu_dtype": torch.uint8})
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1 << 17, generator=gen)
    w[5] = float("inf")
    grads = [{"w": torch.randn(1 << 17, generator=gen)} for _ in range(3)]
    outs = []
    for kernel in ("torch", "native"):
        opt = e.make(**hypers, **dtypes, cpu_kernel=kernel)
        params = {"w": w.clone()}
        state = opt.init(params)
        for g in grads:
            params, state = opt.update(g, state)
        outs.append((params["w"], state))
    for p, state in outs:
        assert torch.isinf(p[5]) and int(p.isnan().sum()) == 0
        for m in optree.tree_leaves(state[1:-3]):  # the moments
            m = blockwise.dequantize(m, p.numel(), signed=True) if eight else m
            assert int((~m.isfinite()).sum()) == 0
