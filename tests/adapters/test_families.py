"""Generic checks run for every registered adapter's tiny examples (each head class):

- float64: every output the model returns matches the original to relative error <= 1e-9;
- float32: error against the float64 original <= 4x the original's own float32 error (+64 ulp);
- save -> normfold.load -> same outputs; save -> stock transformers reload -> same outputs (where the report
  says stock_reloadable; for a kept tie, of the untie=True conversion);
- `normfold convert MODEL_DIR` works from the command line.

Family-specific behaviour is tested in each family's own test file.
"""

import fnmatch

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import list_adapters

pytest.importorskip("transformers")

CASES = [(a, ex, head) for a in list_adapters() for ex in a.examples for head in ex.heads]
EXAMPLES = [(a, ex) for a in list_adapters() for ex in a.examples]
F32_EPS = torch.finfo(torch.float32).eps


def _id(case):
    return "-".join(getattr(c, "name", c) for c in case)


def _centred(name, patterns):
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _prep(t, name, patterns):
    t = t.double()
    return t - t.mean(-1, keepdim=True) if _centred(name, patterns) else t


def build(example, head, dtype):
    torch.manual_seed(0)
    return realistic(example.build(head, dtype))


@pytest.mark.parametrize("adapter,example,head", CASES, ids=[_id(c) for c in CASES])
def test_float64_conversion_is_exact_on_every_output(adapter, example, head):
    model = build(example, head, torch.float64)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, verify=False)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    assert ref and set(got) == set(ref)
    for name in ref:
        err = rel_err(_prep(got[name], name, report.centered_outputs), _prep(ref[name], name, report.centered_outputs))
        assert err <= 1e-9, (name, err)
    assert len(report.structure.norms) >= 1


@pytest.mark.parametrize("adapter,example,head", CASES, ids=[_id(c) for c in CASES])
def test_float32_error_within_four_times_baseline(adapter, example, head):
    model = build(example, head, torch.float32)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model)
    assert report.verification["passed"], report.verification["working"]["outputs"]
    exact = run_flat(model.double(), inputs)
    model.float()
    orig, got = run_flat(model, inputs), run_flat(conv, inputs)
    pats = report.centered_outputs
    for name in exact:
        e = _prep(exact[name], name, pats)
        base = rel_err(_prep(orig[name], name, pats), e)
        assert rel_err(_prep(got[name], name, pats), e) <= 4 * base + 64 * F32_EPS, name


@pytest.mark.parametrize("adapter,example", EXAMPLES, ids=[_id(c) for c in EXAMPLES])
def test_save_then_stock_reload(adapter, example, tmp_path):
    import transformers

    head = example.heads[0]
    model = build(example, head, torch.float32)
    conv, report = normfold.convert(model, verify=False)
    out = normfold.save(conv, report, tmp_path / "out")
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    loaded = normfold.load(out)
    got = run_flat(conv, inputs)
    for name, t in run_flat(loaded, inputs).items():
        assert torch.equal(t, got[name]), name
    if report.structure.tied_heads:  # a kept tie loads with normfold.load only; untie=True is the stock form
        conv, report = normfold.convert(model, verify=False, untie=True)
        out = normfold.save(conv, report, tmp_path / "untied")
    if not report.stock_reloadable:
        pytest.skip(f"{adapter.name}/{example.name}: not stock-reloadable by design ({'; '.join(report.notes)})")
    stock = getattr(transformers, head).from_pretrained(out).eval()
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    exact = run_flat(model.double(), inputs)
    model.float()
    orig, re = run_flat(model, inputs), run_flat(stock, inputs)
    pats = report.centered_outputs
    for name in exact:
        e = _prep(exact[name], name, pats)
        assert rel_err(_prep(re[name], name, pats), e) <= 4 * rel_err(_prep(orig[name], name, pats), e) + 64 * F32_EPS


@pytest.mark.parametrize("adapter,example", EXAMPLES, ids=[_id(c) for c in EXAMPLES])
def test_cli_converts_a_saved_checkpoint(adapter, example, tmp_path, capsys):
    import json

    from normfold.cli import main

    build(example, example.heads[-1], torch.float32).save_pretrained(tmp_path / "src")
    code = main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rep = json.loads((tmp_path / "out" / "normfold.json").read_text())
    assert rep["verification"]["passed"] and rep["adapter"] == adapter.name
