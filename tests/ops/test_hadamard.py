"""normfold.ops.hadamard: fwht against the dense float64 matrix, orthonormality, torch.export."""

import pytest
import torch

from normfold.ops.hadamard import fwht, hadamard_core, hadamard_factor, hadamard_matrix


def _core(n, dtype=torch.float64):
    m, _ = hadamard_factor(n)
    return None if m == 1 else hadamard_core(m).to(dtype)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 12, 20, 24, 48, 64, 80, 192, 768, 1024])
def test_fwht_matches_the_dense_matrix(n):
    h = hadamard_matrix(n)
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    ref = x @ h / n ** 0.5
    assert (fwht(x, _core(n)) - ref).abs().max() <= 1e-13 * ref.abs().max()
    x32 = x.float()
    assert (fwht(x32, _core(n, torch.float32)).double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_fwht_keeps_norms_and_refuses_bad_widths():
    x = torch.randn(4, 96, dtype=torch.float64)
    assert torch.allclose(fwht(x, _core(96)).norm(dim=-1), x.norm(dim=-1), rtol=1e-13)
    with pytest.raises(ValueError):
        fwht(torch.randn(2, 10), None)


def test_fwht_exports():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("core", hadamard_core(12).float())

        def forward(self, x):
            return fwht(x, self.core)

    m = M()
    x = torch.randn(2, 7, 192)
    ep = torch.export.export(m, (x,))
    assert torch.allclose(ep.module()(x), m(x))
    assert not any("normfold" in str(n.target) for n in ep.graph.nodes)  # plain aten


# ---- the C kernel (nf_fwht_f32) against the aten fwht ----

@pytest.mark.parametrize("n", [1, 2, 8, 64, 192, 768, 1024, 3072, 2560])
def test_fwht_fast_equals_aten_bit_for_bit(n):
    from normfold.ops import cpu
    from normfold.ops.hadamard import fwht_fast

    if cpu.library() is None:
        pytest.skip("normfold CPU kernel unavailable")
    f = hadamard_factor(n)
    core = None if f[0] == 1 else hadamard_core(f[0]).float()
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n))
    got = fwht_fast(x, core)
    assert torch.equal(got, fwht(x, core))
    assert torch.equal(x, torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n)))  # input untouched
    # and against the dense matrix in float64
    want = x.double() @ (hadamard_matrix(n).double() / n ** 0.5)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_fwht_fast_falls_back_to_aten_for_autograd_and_other_dtypes():
    from normfold.ops.hadamard import fwht_fast

    x = torch.randn(4, 64, requires_grad=True)
    y = fwht_fast(x)
    y.sum().backward()  # the aten path: differentiable
    assert x.grad is not None
    xd = torch.randn(4, 64, dtype=torch.float64)
    assert torch.equal(fwht_fast(xd), fwht(xd))


@pytest.mark.parametrize("n", [4, 12, 16, 20, 24, 32, 40, 48, 96, 128, 384, 512, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fwht_fast_bit_for_bit_over_the_kernel_paths(n, rows):
    """Every code path of nf_fwht_f32: p < 8 (scalar), one to eight vectors per chunk (registers only),
    more (passes over the row), with and without a Paley core; against the aten fwht bit for bit."""
    from normfold.ops import cpu
    from normfold.ops.hadamard import fwht_fast

    if cpu.library() is None:
        pytest.skip("normfold CPU kernel unavailable")
    f = hadamard_factor(n)
    core = None if f[0] == 1 else hadamard_core(f[0]).float()
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * n)) * 3
    want = fwht(x, core)
    assert torch.equal(fwht_fast(x, core), want)
    want64 = x.double() @ (hadamard_matrix(n) / n ** 0.5)
    assert (want.double() - want64).abs().max() <= 1e-5 * want64.abs().max()


def test_fwht_fast_out_in_place_threads_and_strided_input():
    from normfold.ops import cpu
    from normfold.ops.hadamard import fwht_fast

    if cpu.library() is None:
        pytest.skip("normfold CPU kernel unavailable")
    core = hadamard_core(12).float()
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(1))
    want = fwht(x, core)
    out = torch.empty_like(x)
    assert fwht_fast(x, core, out=out) is out and torch.equal(out, want)
    y = x.clone()
    fwht_fast(y, core, out=y)  # in place
    assert torch.equal(y, want)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # rows split over OpenMP threads (when the library has OpenMP)
        assert torch.equal(fwht_fast(x, core), want)
    finally:
        torch.set_num_threads(saved)
    xt = torch.randn(768, 40, generator=torch.Generator().manual_seed(2)).t()  # not contiguous
    assert torch.equal(fwht_fast(xt, core), fwht(xt, core))
    with pytest.raises(ValueError):
        fwht_fast(x, core, out=torch.empty(3, 768))
