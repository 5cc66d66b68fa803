"""fp8kit's CPU bf16 GEMM (fp8kit/base/cpu_bf16_gemm.py) against torch's own kernels, run in a process without it.

Thresholds: float32, float64 and int64 products bit for bit the same as torch's ``mm``; bf16 within one bf16
rounding step of torch's bf16 ``mm`` plus float32 accumulation in another order (``k 2^-24 sum |a||b|``) everywhere,
and different in fewer than 1 element in 1000 (measured: 1.2e-4 at
``[256, 1024] @ [1024, 256]``, the summation order), and gradients through it equal to float64 math within bf16's
rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kit.base import cpu_bf16_gemm

ROOT = Path(__file__).resolve().parents[1]
SITE = str(ROOT / "tests" / "site")

SHAPES = [(256, 1024, 256), (64, 688, 256), (7, 33, 5)]
NATIVE = """
import sys, torch
out = {}
g = torch.Generator().manual_seed(0)
for m, k, n in eval(sys.argv[2]):
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp64", torch.float64)):
        out[(m, k, n, name)] = (a.to(dt), b.to(dt), a.to(dt) @ b.to(dt))
    ai, bi = (a * 10).long(), (b * 10).long()
    out[(m, k, n, "int64")] = (ai, bi, ai @ bi)
torch.save(out, sys.argv[1])
"""

pytestmark = pytest.mark.skipif(not cpu_bf16_gemm.needed(), reason="this CPU has AVX-512: the suite keeps torch's mm")


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """Products computed by torch's own kernels in a fresh process whose PYTHONPATH lacks tests/site."""
    path = tmp_path_factory.mktemp("native") / "mm.pt"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE)
    code = "import sys; assert 'fp8kit.base.cpu_bf16_gemm' not in sys.modules\n" + NATIVE
    subprocess.run([sys.executable, "-c", code, str(path), repr(SHAPES)], check=True, env=env, timeout=300)
    return torch.load(path)


def test_installed_in_this_process_and_in_the_processes_tests_launch():
    assert cpu_bf16_gemm.install(), "conftest should have installed it (needed() is True here)"
    code = "from fp8kit.base import cpu_bf16_gemm; print(cpu_bf16_gemm.installed())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "True", f"sitecustomize did not install it in a child process: {out!r}"


@pytest.mark.parametrize("dtype", ["fp32", "fp64", "int64"])
def test_other_dtypes_keep_torchs_bits(native, dtype):
    for m, k, n in SHAPES:
        a, b, want = native[(m, k, n, dtype)]
        got = a @ b
        assert torch.equal(got, want), f"{dtype} {m}x{k}x{n}: max |diff| {(got - want).abs().max().item()}"


def test_bf16_within_one_ulp_of_torchs_kernel(native):
    for m, k, n in SHAPES:
        a, b, want = native[(m, k, n, "bf16")]
        got = a @ b
        assert got.dtype == torch.bfloat16
        # one bf16 rounding step of the result, plus float32 accumulation in another order (k 2^-24 sum |a||b|)
        bound = (torch.finfo(torch.bfloat16).eps * want.float().abs()
                 + k * 2.0 ** -24 * (a.float().abs() @ b.float().abs()))
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= bound).all()), f"{m}x{k}x{n}: max |diff| / bound {(diff / bound).max().item():.2f}"
        frac = (got != want).float().mean().item()
        assert frac < 1e-3, f"{m}x{k}x{n}: {frac:.2e} of the elements differ from torch's bf16 mm"


def test_gradients_through_it_match_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 96, generator=g).bfloat16().requires_grad_()
    w = torch.randn(48, 96, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(32, 48, generator=g).bfloat16()
    torch.nn.functional.linear(x, w).backward(dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    for name, got, want in (("dgrad", x.grad, dy64 @ w64), ("wgrad", w.grad, dy64.t() @ x64)):
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 2 ** -8, f"{name}: relative error {rel:.2e} above bf16's 2^-8"


def test_the_train_command_installs_it_says_so_and_records_it(cache_dir, tmp_path):
    """``fp8kit train`` in a process without the suite's sitecustomize: the run installs it itself, prints the note
    and writes ``cpu_bf16_gemm`` into run_info.json."""
    from tests.conftest import small_run_overrides

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])  # no tests/site: no sitecustomize
    sets = [a for s in small_run_overrides(cache_dir) + ["train.steps=1", "train.final_checkpoint=false",
                                                         "train.mixed_precision=bf16"] for a in ("--set", s)]
    out = subprocess.run([sys.executable, "-m", "fp8kit", "train", "--out", str(tmp_path / "run"), *sets],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["cpu_bf16_gemm"] == "float32 GEMM", info.get("cpu_bf16_gemm")
    assert "bf16 matmuls run as float32 GEMMs" in " ".join(out.stdout.split()), out.stdout[-2000:]
