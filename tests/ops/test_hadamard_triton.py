"""The Triton Walsh–Hadamard kernel (normfold.ops.triton_hadamard) against the aten fwht, bit for bit.

On a CUDA machine it runs on the GPU; without one on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py before triton is first imported). Without the `triton`
package everything here is skipped.
"""

import pytest
import torch

from normfold.ops import triton_hadamard as th, triton_kernels as tk
from normfold.ops.hadamard import fwht, fwht_fast, hadamard_core, hadamard_factor, hadamard_matrix

HAS_CUDA = torch.cuda.is_available()

if not tk.available():
    pytest.skip("the triton package is not installed (pip install triton)", allow_module_level=True)
if not HAS_CUDA and not tk.interpreting():
    pytest.skip("no CUDA, and TRITON_INTERPRET=1 was not set before triton was imported",
                allow_module_level=True)

DEVICE = "cuda" if HAS_CUDA else "cpu"
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _core(n):
    m, _ = hadamard_factor(n)
    return None if m == 1 else hadamard_core(m).float().to(DEVICE)


@pytest.mark.parametrize("n", [1, 2, 8, 12, 20, 48, 64, 96, 768, 1024, 2560, 3072])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_triton_fwht_equals_aten_bit_for_bit(n, rows):
    x = (torch.randn(rows, n, generator=torch.Generator().manual_seed(n * 7 + rows)) * 3).to(DEVICE)
    core = _core(n)
    got = th.fwht(x, core)
    want = fwht(x, core)
    assert torch.equal(got, want)
    want64 = x.double().cpu() @ (hadamard_matrix(n) / n ** 0.5)  # and the dense matrix in float64
    assert (got.double().cpu() - want64).abs().max() <= 1e-5 * want64.abs().max()


def test_triton_fwht_out_in_place_and_leading_dims():
    core = _core(768)
    x = torch.randn(2, 3, 768, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = fwht(x, core)
    x0 = x.clone()
    assert torch.equal(th.fwht(x, core), want) and torch.equal(x, x0)  # input untouched
    out = torch.empty_like(x)
    assert th.fwht(x, core, out=out) is out and torch.equal(out, want)
    th.fwht(x, core, out=x)
    assert torch.equal(x, want)


def test_triton_fwht_refuses_what_it_cannot_do():
    with pytest.raises(ValueError):
        th.fwht(torch.randn(2, 64, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError):
        th.fwht(torch.randn(2, 10, device=DEVICE))  # 10 is not 1·2^k
    assert not th.supports(torch.randn(2, 64))  # CPU tensors: the C kernel's
    assert not th.supports(torch.randn(2, 64, device=DEVICE, requires_grad=True))


@cuda
@pytest.mark.cuda
def test_fwht_fast_sends_cuda_tensors_to_triton(monkeypatch):
    calls = []
    real = th.fwht
    monkeypatch.setattr(th, "fwht", lambda *a, **k: calls.append(1) or real(*a, **k))
    core = _core(3072)
    x = torch.randn(512, 3072, device="cuda")
    assert torch.equal(fwht_fast(x, core), fwht(x, core)) and calls
    monkeypatch.setenv("NORMFOLD_TRITON", "0")
    calls.clear()
    assert torch.equal(fwht_fast(x, core), fwht(x, core)) and not calls
