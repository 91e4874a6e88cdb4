"""Issue 26 item 4: the in-memory CLI path verifies in place (`convert(discard_original=True)`,
`verify_conversion(consume_original=True)`): the same converted weights and the same verification numbers as
the copying path, with one float64 model instead of a float64 copy beside the original."""

from __future__ import annotations

import pytest
import torch

import normfold
from helpers import perturb_biases, perturb_norms
from normfold.adapters import get_adapter


@pytest.mark.parametrize("family,kw", [("gpt2", {}), ("gpt2", {"to": "crmsnorm"}), ("opt", {"fold_final": True}),
                                       ("gpt2", {"rotate": "hadamard"})])
def test_discarding_the_original_changes_no_number(family, kw):
    example = get_adapter(family).examples[0]
    torch.manual_seed(0)
    model = example.build(example.heads[0]).eval()
    perturb_norms(model, generator=torch.Generator().manual_seed(0))
    perturb_biases(model, generator=torch.Generator().manual_seed(1))
    twin = example.build(example.heads[0]).eval()
    twin.load_state_dict(model.state_dict())
    ref, ref_report = normfold.convert(model, **kw)
    got, got_report = normfold.convert(twin, discard_original=True, **kw)
    assert ref_report.verification == got_report.verification
    assert ref_report.verification["passed"] is True
    a, b = ref.state_dict(), got.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the kept original is untouched; the discarded one was verified in place (float64 now)
    assert next(model.parameters()).dtype == torch.float32
    assert next(twin.parameters()).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_chunked_centring_equals_whole_tensor(monkeypatch, dtype):
    """Last-axis writers (embedding tables, Conv1D) are centred in place in row chunks: the bytes of one
    whole-tensor algebra.center, whatever the chunk (a trailing single row joins the chunk before it)."""
    from normfold import algebra

    convert_mod = __import__("sys").modules["normfold.conversion"]
    torch.manual_seed(0)
    for rows in (1, 2, 7, 64):
        monkeypatch.setattr(convert_mod, "CENTER_CHUNK_BYTES", rows * 8 * 33)
        t = (torch.randn(301, 33, dtype=torch.float64) * 3 + 1).to(dtype)
        want = algebra.center(t, -1)
        p = torch.nn.Parameter(t.clone(), requires_grad=False)
        assert convert_mod._center_rows_in_place(p, 1)
        assert torch.equal(p.data, want)
    assert not convert_mod._center_rows_in_place(torch.nn.Parameter(torch.randn(4, 5)), 0)  # nn.Linear: out axis 0
