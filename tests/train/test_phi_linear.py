"""The hand-written VJP of a linear φ = A·θ recipe (`Recipe.transpose`, `LinearPhi`) equals autograd's
VJP through `Recipe.run`, float64, for every step kind and the combinations prepare builds."""

from __future__ import annotations

import pytest
import torch

from normfold.train import functional as F
from normfold.train.phi import Entry, LinearPhi, Recipe, Step

STEPS = {
    "center": [Step("center", 1, writer=True)],
    "center-bias": [Step("center", -1, writer=True)],
    "center-zero_last": [Step("center", 0, writer=True), Step("zero_last", 0, writer=True)],
    "compress_in": [Step("compress_in", 1)],
    "compress_in-center-zero_last": [Step("compress_in", 0), Step("center", 1, writer=True),
                                     Step("zero_last", 1, writer=True)],
}


def _autograd_vjp(recipe, theta, grad, on):
    t = theta.clone().requires_grad_()
    recipe.run([t], on).backward(grad)
    return t.grad


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("name", list(STEPS))
def test_transpose_is_the_vjp_of_run(name, on):
    g = torch.Generator().manual_seed(0)
    recipe = Recipe("weight", STEPS[name])
    assert recipe.linear
    shape = (7,) if name == "center-bias" else (5, 7)
    theta = torch.randn(shape, generator=g, dtype=torch.float64)
    grad = torch.randn(shape, generator=g, dtype=torch.float64)
    want = _autograd_vjp(recipe, theta, grad, on)
    torch.testing.assert_close(recipe.transpose(grad, on), want, rtol=1e-13, atol=1e-13)
    # through the autograd Function prepare uses
    t = theta.clone().requires_grad_()
    with torch.no_grad():
        out = recipe.run([t], on)
    phi = LinearPhi.apply(Entry((), out, [], []), recipe, on, t)
    torch.testing.assert_close(phi, recipe.run([theta], on), rtol=0, atol=0)
    phi.backward(grad)
    torch.testing.assert_close(t.grad, want, rtol=1e-13, atol=1e-13)


def test_compress_adjoint_inner_product():
    """<A x, g> = <x, Aᵀ g> for the padded reader compression, on each input axis."""
    g = torch.Generator().manual_seed(1)
    for dim in (0, 1):
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        y = torch.randn(4, 6, generator=g, dtype=torch.float64)
        lhs = (F.compress_reader_padded(x, dim) * y).sum()
        rhs = (x * F.compress_reader_padded_adjoint(y, dim)).sum()
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))


def test_folding_recipes_are_not_linear():
    assert not Recipe("weight", [Step("fold_w", 1), Step("compress_in", 1)]).linear
    assert not Recipe("bias", [Step("fold_b", 1)]).linear
