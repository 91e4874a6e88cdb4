"""The C measuring tools in benchmarks/scripts/ that docs/kernels-cpu.md cites still build against the current
kernel sources and run: the forward A/B harness (benchmarks/scripts/kernel_forward_ab.c) agrees bit for bit
with itself, plain and fused, and the normalize-pass floor (benchmarks/scripts/kernel_apply_floor.c) computes
y = x · 0.7 · w, each value rounded once (checked through ctypes against torch), and so differs from
the norm in the harness."""

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

import torch

from normfold.ops import cpu

ROOT = Path(__file__).resolve().parents[2]
CSRC = Path(cpu.__file__).with_name("csrc")
LINE = re.compile(r"^\s*(\d+)x(\d+)\s+A\s+([\d.]+)\s+B\s+([\d.]+)\s+copy\s+([\d.]+)\s+stats\s+([\d.]+).*\s(same|DIFFERENT)$")


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    cc = cpu._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    isa = cpu._chain(cpu.detect_isa())[0]
    flags = {"avx512": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"]}.get(isa, [])
    d = tmp_path_factory.mktemp("kernel_scripts")

    def build(*args):
        subprocess.run([cc, "-O2", *args], check=True, capture_output=True, text=True, timeout=300)

    build("-shared", "-fPIC", *flags, f"-I{CSRC}", str(CSRC / "rmsnorm_cpu.c"), "-o", str(d / "A.so"), "-lm")
    build("-shared", "-fPIC", *flags, f"-I{CSRC}", str(ROOT / "benchmarks" / "scripts" / "kernel_apply_floor.c"), "-o",
          str(d / "floor.so"))
    build(str(ROOT / "benchmarks" / "scripts" / "kernel_forward_ab.c"), "-o", str(d / "fwd_ab"), "-ldl")
    return d


def _run(tools, b, dtype, fused):
    out = subprocess.run([str(tools / "fwd_ab"), str(tools / "A.so"), str(tools / b), "1", str(dtype), "1",
                          str(fused)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [m.groups() for m in map(LINE.match, out.stdout.splitlines()) if m]
    assert len(rows) == 5, out.stdout
    for row in rows:
        assert all(float(t) > 0 for t in row[2:6]), out.stdout
    return [row[-1] for row in rows]


@pytest.mark.parametrize("dtype", [0, 1, 2])
@pytest.mark.parametrize("fused", [0, 1])
def test_forward_ab_agrees_with_itself(tools, dtype, fused):
    assert _run(tools, "A.so", dtype, fused) == ["same"] * 5


@pytest.mark.parametrize("dtype", [0, 1, 2])
def test_apply_floor_runs_and_is_not_the_norm(tools, dtype):
    assert _run(tools, "floor.so", dtype, 0) == ["DIFFERENT"] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [768, 1023, 37])
def test_apply_floor_computes_x_times_constant_times_w(tools, dtype, n):
    lib = ctypes.CDLL(str(tools / "floor.so"))
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    y = torch.empty_like(x)
    i64, p = ctypes.c_int64, ctypes.c_void_p
    rc = lib.nf_forward(code, p(x.data_ptr()), i64(n), None, i64(0), p(w.data_ptr()), code, None, 0,
                        p(y.data_ptr()), None, None, i64(5), i64(n), ctypes.c_float(1e-5), 0, 1)
    assert rc == 0
    c = torch.tensor(0.7, dtype=torch.float32)
    torch.testing.assert_close(y, (x.float() * c * w.float()).to(dtype), rtol=0, atol=0)
