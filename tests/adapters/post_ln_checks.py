"""Checks shared by the Post-LN encoder tests (BERT, RoBERTa, DistilBERT, ELECTRA).

They run the original and the converted model themselves (not through normfold.verify) and compare
every output, hidden states included *without* recentring: a Post-LN conversion changes no norm's
output, so even the stream must be unchanged.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.nn import RMSNorm


def build(config_cls, head_cls, dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = head_cls(config_cls(**kwargs)).eval()
    return realistic(model).to(dtype)


def layernorm_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}


def assert_same_outputs(model, conv, inputs, tol=1e-9, **extra):
    ref, got = run_flat(model, {**inputs, **extra}), run_flat(conv, {**inputs, **extra})
    assert ref and set(got) == set(ref)
    for name in ref:
        assert rel_err(got[name], ref[name]) <= tol, (name, rel_err(got[name], ref[name]))
    return ref


def assert_converted_exactly(model, conv, report, converted: list[str]):
    """`converted` became RMSNorms with the LayerNorm's eps; every other LayerNorm is untouched."""
    assert [r.name for r in report.structure.norms] == converted
    kept = {k["name"] for k in report.kept}
    assert kept == layernorm_names(model) - set(converted)
    assert report.layernorms_total == len(layernorm_names(model))
    originals = dict(model.named_modules())
    for name, mod in conv.named_modules():
        if name in converted:
            assert isinstance(mod, RMSNorm) and mod.eps == originals[name].eps, name
        elif name in kept:
            assert isinstance(mod, nn.LayerNorm), name
            for p, q in zip(mod.parameters(), originals[name].parameters()):
                assert torch.equal(p, q), name


def assert_only_edited(model, conv, edited: set[str]):
    """Parameters outside `edited` (name prefixes) are bit-for-bit those of the original."""
    orig = dict(model.named_parameters(remove_duplicate=False))
    for name, p in conv.named_parameters():
        if any(name.startswith(e) for e in edited):
            continue
        if name not in orig:  # a head kept tied to the centred table holds the row means it lost (nn.TiedHead)
            assert name.endswith(".mean"), f"{name} is new"
            continue
        assert torch.equal(p, orig[name]), f"{name} was edited"


def assert_tied_head_keeps_the_original_matrix(head, table, original: torch.Tensor):
    """A head kept tied is the stock nn.Linear reading the embedding's table, which stays the original tensor
    (its output is re-centred by a Recenter after the embedding instead)."""
    from normfold.nn.hooks import has_output_recenter

    assert type(head) is nn.Linear and head.weight is table.weight
    assert torch.equal(table.weight, original) and has_output_recenter(table)


def assert_rows_centred(table: torch.Tensor):
    t = table.detach().double()
    tol = 4 * torch.finfo(table.dtype).eps * float(t.abs().max())  # centred in float64, rounded once
    assert t.mean(-1).abs().max() <= tol


def block_reasons_name_previous_norm(report, chain: list[str]):
    """Each kept block norm's reason names the norm whose output feeds its residual (chain order)."""
    reasons = {k["name"]: k["reason"] for k in report.kept}
    for prev, norm in zip(chain, chain[1:]):
        if norm in reasons:
            assert "Post-LN" in reasons[norm] and prev in reasons[norm], (norm, reasons[norm])


def convert64(model, **kw):
    conv, report = normfold.convert(copy.deepcopy(model), verify=False, **kw)
    return conv, report


def assert_stock_reload_matches(model, tmp_path, inputs, key="logits"):
    """Convert `model` (float32), save, reload with plain transformers: same `key` output as the
    float64 original, within 4x the original's own float32 error. untie=True: a tied MLM head gets its own
    copy of the table, the form stock transformers reloads (by default the tie is kept, normfold.load only)."""
    import transformers

    conv, report = normfold.convert(model, untie=True)
    assert report.stock_reloadable
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    normfold.save(conv, report, tmp_path / "out")
    stock = getattr(transformers, type(model).__name__).from_pretrained(tmp_path / "out").eval()
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    exact = run_flat(copy.deepcopy(model).double(), inputs)[key]
    base = rel_err(run_flat(model, inputs)[key], exact)
    assert rel_err(run_flat(stock, inputs)[key], exact) <= 4 * base + 64 * torch.finfo(torch.float32).eps
    return conv, stock
