"""normfold.algebra.rotation against float64 brute force: Hadamard matrices, Q orthogonal with 1·Q = 1,
the stream-axis product, and the β/γ bias."""

import math

import pytest
import torch

from normfold.algebra import rotation as rot

F64 = torch.float64
HADAMARD_ORDERS = [1, 2, 4, 8, 12, 16, 20, 24, 32, 44, 48, 60, 64, 96, 192, 768, 1024]
NO_HADAMARD = [3, 10, 30, 36, 100]


@pytest.mark.parametrize("d", HADAMARD_ORDERS)
def test_hadamard_is_plus_minus_one_and_orthogonal(d):
    h = rot.hadamard_matrix(d)
    assert h.shape == (d, d) and bool(((h == 1) | (h == -1)).all())
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=F64))  # integers: exact in float64


@pytest.mark.parametrize("d", NO_HADAMARD)
def test_orders_without_a_construction_are_refused(d):
    assert not rot.has_hadamard(d)
    with pytest.raises(ValueError):
        rot.hadamard_matrix(d)
    q, used = rot.rotation_matrix("hadamard", d, 0)
    assert used == "orthogonal"


@pytest.mark.parametrize("kind", rot.KINDS)
@pytest.mark.parametrize("d", [4, 12, 24, 32, 36, 192, 256])
def test_q_is_orthogonal_and_fixes_the_ones_direction(kind, d):
    q, used = rot.rotation_matrix(kind, d, seed=3)
    eye = torch.eye(d, dtype=F64)
    assert (q @ q.T - eye).abs().max() < 1e-13
    assert (q.T @ q - eye).abs().max() < 1e-13
    one = torch.ones(d, dtype=F64)
    assert (one @ q - one).abs().max() < 1e-12  # row convention: the stream x·Q
    assert (q @ one - one).abs().max() < 1e-12
    assert used == ("hadamard" if kind == "hadamard" and rot.has_hadamard(d) else "orthogonal")
    # a zero-mean row stays zero-mean and keeps its norm
    x = torch.randn(5, d, dtype=F64, generator=torch.Generator().manual_seed(1))
    x = x - x.mean(-1, keepdim=True)
    y = x @ q
    assert y.mean(-1).abs().max() < 1e-13 * x.abs().max()
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-13, atol=0)


def test_seeds_give_different_rotations_and_the_same_seed_the_same():
    a, _ = rot.rotation_matrix("hadamard", 64, 0)
    b, _ = rot.rotation_matrix("hadamard", 64, 0)
    c, _ = rot.rotation_matrix("hadamard", 64, 1)
    assert torch.equal(a, b) and (a - c).abs().max() > 0.1
    o1, _ = rot.rotation_matrix("orthogonal", 64, 0)
    assert (o1 - a).abs().max() > 0.1


@pytest.mark.parametrize("d", [64, 192])
def test_hadamard_rotation_spreads_an_outlier_channel(d):
    """A one-hot zero-mean row (an outlier channel, centred) comes out flat: crest factor max/rms ~ O(1)."""
    q, _ = rot.rotation_matrix("hadamard", d, 0)
    x = torch.zeros(d, dtype=F64)
    x[5] = 1.0
    x = x - x.mean()
    crest = lambda v: float(v.abs().max() / v.pow(2).mean().sqrt())  # noqa: E731
    assert crest(x) > 0.9 * math.sqrt(d)
    assert crest(x @ q) < crest(x) / 3  # Householder correction included: 13.9 -> 1.5..4.1 at d=192


def test_fix_ones_brute_force():
    d = 12
    m = rot.random_orthogonal(d, 7)
    q = rot.fix_ones(m)
    u = torch.full((d,), 1 / math.sqrt(d), dtype=F64)
    w = u @ m - u
    householder = torch.eye(d, dtype=F64) - 2 * torch.outer(w, w) / (w @ w)
    assert (q - m @ householder).abs().max() < 1e-14
    assert torch.equal(rot.fix_ones(torch.eye(d, dtype=F64)), torch.eye(d, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_rotate_axis_matches_writer_and_reader_algebra(dtype):
    """Linear weight (out, in): as a writer (out = stream) the output y becomes y·Q; as a
    reader (in = stream) the rotated input x·Q read with W·Q gives the original output."""
    g = torch.Generator().manual_seed(0)
    d, n = 12, 7
    q, _ = rot.rotation_matrix("hadamard", d, 0)
    x = torch.randn(3, n, dtype=F64, generator=g)
    writer = torch.randn(d, n, dtype=F64, generator=g)  # nn.Linear(n -> d).weight
    bias = torch.randn(d, dtype=F64, generator=g)
    w2 = rot.rotate_axis(writer.to(dtype), q, 0).double()
    b2 = rot.rotate_axis(bias.to(dtype), q, 0).double()
    ref = (x @ writer.T + bias) @ q
    tol = 1e-13 if dtype == F64 else 1e-6
    assert ((x @ w2.T + b2) - ref).abs().max() <= tol * ref.abs().max()
    s = torch.randn(3, d, dtype=F64, generator=g)  # the stream
    reader = torch.randn(n, d, dtype=F64, generator=g)  # nn.Linear(d -> n).weight
    r2 = rot.rotate_axis(reader.to(dtype), q, 1).double()
    ref = s @ reader.T
    assert ((s @ q) @ r2.T - ref).abs().max() <= tol * ref.abs().max()
    conv1d = reader.T.contiguous()  # HF Conv1D (in, out): the stream is axis 0
    c2 = rot.rotate_axis(conv1d.to(dtype), q, 0).double()
    assert ((s @ q) @ c2 - ref).abs().max() <= tol * ref.abs().max()
    assert rot.rotate_axis(reader.to(dtype), q, 1).dtype == dtype


def test_unfold_gamma_bias():
    g = torch.Generator().manual_seed(0)
    gamma = torch.rand(8, dtype=F64, generator=g) + 0.5
    beta = torch.randn(8, dtype=F64, generator=g)
    n = torch.randn(4, 8, dtype=F64, generator=g)
    b = rot.unfold_gamma_bias(beta, gamma)
    assert torch.allclose((n + b) * gamma, n * gamma + beta, rtol=1e-14, atol=1e-15)
    assert rot.unfold_gamma_bias(None, gamma) is None
    gamma[2] = 0
    with pytest.raises(ValueError):
        rot.unfold_gamma_bias(beta, gamma)
