"""Property-based equivalence (hypothesis): for random tiny configs of every registered family —
widths, heads, layer counts, eps, tied/untied, biases on/off, parallel/sequential — with random
weights that carry extreme outlier channels in the residual stream (×1e3–1e4, as in real LLMs), the
converted model computes what the original computes:

- float64: every output within 1e-9 relative error of the original's;
- float32: every output's error against the float64 original ≤ 4× the original's own float32 error
  + 64 ulp × (1 + s/d), s the outlier factor (0 without outliers), d the stream width; for
  residual-stream hidden states (compared centred, at full width) + 1024 ulp × (1 + s/d).

The issue asked for "≤ 4× the original's own float32 error" outright. Hypothesis shows that claim is
false for two kinds of input, and the test asserts the weaker bound above instead (docs/testing.md has
the measurements): outlier channels (centring a stream whose few channels are 1e3–1e4× the others
moves s/d of them into every centred weight, so rounding those weights to float32 costs ~s/d ulp on
the ordinary channels), and stream hidden states whose common mode is large (the converted model
centres them in float32, the reference is centred in float64).

Each target (Pre-RMSNorm, Pre-CRMSNorm on the d−1 stream, zero-padded Pre-CRMSNorm) is drawn per case.
A configuration the adapter cannot convert exactly must be refused with UnsupportedConversionError
(counted as a hypothesis event), never converted wrongly. Outputs are compared by the test itself
(tests/helpers.py), not by normfold.verify.

CI runs the small derandomized "ci" profile; search deeper with
`pytest tests/properties --hypothesis-profile=deep` (or NORMFOLD_HYPOTHESIS_PROFILE=deep).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("hypothesis")

from family_configs import Case, cases  # noqa: E402
from helpers import comparable, is_stream_output, output_errors, realistic, rel_err, run_flat  # noqa: E402
from hypothesis import event, given, note, reject  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

import normfold  # noqa: E402
from normfold.adapters import list_adapters  # noqa: E402
from normfold.errors import UnsupportedConversionError  # noqa: E402

F32_EPS = torch.finfo(torch.float32).eps
ADAPTERS = {a.name: a for a in list_adapters() if a.examples}
TARGETS = st.sampled_from([("rmsnorm", {}), ("crmsnorm", {"pad": False}), ("crmsnorm", {"pad": True})])


def plant_outliers(model: nn.Module, case: Case) -> None:
    """Scale a few residual-stream channels by `case.outlier_scale` wherever they are written: token
    and position embeddings, patch/conv stems, raw embedding parameters (CLS tokens, position tables)
    and every linear layer that writes a stream-wide output. Stream widths are read off the model's
    LayerNorms, so the planting does not depend on normfold's plans."""
    if not case.outlier_scale:
        return
    widths = {m.normalized_shape[-1] for m in model.modules() if isinstance(m, nn.LayerNorm)}
    g = torch.Generator().manual_seed(case.seed)
    chans = {d: torch.randperm(d, generator=g)[: case.outlier_channels] for d in sorted(widths)}
    s = case.outlier_scale
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Embedding) and m.embedding_dim in chans:
                m.weight[:, chans[m.embedding_dim]] *= s
            elif isinstance(m, (nn.Conv1d, nn.Conv2d)) and m.out_channels in chans:
                m.weight[chans[m.out_channels]] *= s
                if m.bias is not None:
                    m.bias[chans[m.out_channels]] *= s
            elif isinstance(m, nn.Linear) and m.out_features in chans and m.in_features not in chans:
                m.weight[chans[m.out_features]] *= s
                if m.bias is not None:
                    m.bias[chans[m.out_features]] *= s
            elif type(m).__name__ == "Conv1D" and m.weight.shape[1] in chans and m.weight.shape[0] not in chans:
                m.weight[:, chans[m.weight.shape[1]]] *= s  # GPT-2's Conv1D: weight is (in, out)
                m.bias[chans[m.weight.shape[1]]] *= s
            elif not isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding, nn.Conv1d, nn.Conv2d)):
                for p in m.parameters(recurse=False):  # raw parameters: CLS tokens, position tables
                    if p.dim() >= 1 and p.shape[-1] in chans:
                        p[..., chans[p.shape[-1]]] *= s


def outlier_spread(model: nn.Module, case: Case) -> float:
    """1 + s/d: centring a stream whose outlier channels are s times the others moves s/d of them into
    every coordinate, and rounding the centred weights (and the centred stream) to float32 costs
    that many more ulp on the ordinary channels. 1 without outliers."""
    d = min(m.normalized_shape[-1] for m in model.modules() if isinstance(m, nn.LayerNorm))
    return 1.0 + case.outlier_scale / d


def build(case: Case, dtype=torch.float64) -> nn.Module:
    import transformers

    torch.manual_seed(case.seed)
    try:
        cfg = getattr(transformers, case.example.config)(**case.kwargs)
        model = getattr(transformers, case.head)(cfg).eval()
    except (ValueError, AssertionError, TypeError) as e:  # transformers rejects the combination itself
        event(f"config rejected by transformers: {type(e).__name__}")
        reject()
    model = realistic(model.to(dtype))
    plant_outliers(model, case)
    return model


def convert_or_refused(model, to, options):
    try:
        return normfold.convert(model, to=to, pad=bool(options.get("pad")), verify=False,
                                variant_options={k: v for k, v in options.items() if k != "pad"} or None)
    except UnsupportedConversionError as e:
        event(f"refused: {to} {options}: {str(e)[:80]}")
        return None, None


def inputs_for(case: Case, model) -> dict:
    return case.adapter.example_inputs(model, torch.Generator().manual_seed(case.seed))


def run_original(model, inputs) -> dict:
    """The original's outputs; a configuration the original itself cannot run (transformers builds
    some combinations it cannot execute, e.g. Falcon's new decoder architecture without parallel
    attention) is not a test case."""
    try:
        return run_flat(model, inputs)
    except Exception as e:  # noqa: BLE001  (whatever transformers raises; normfold has not run yet)
        event(f"original does not run: {type(e).__name__}")
        reject()


@pytest.mark.parametrize("family", sorted(ADAPTERS))
@given(data=st.data(), target=TARGETS)
def test_float64_conversion_exact_on_random_configs(family, data, target):
    case = data.draw(cases(ADAPTERS[family]), label="case")
    to, options = target
    model = build(case)
    inputs = inputs_for(case, model)
    ref = run_original(model, inputs)
    conv, report = convert_or_refused(model, to, options)
    if conv is None:
        return
    errs = output_errors(run_flat(conv, inputs), ref, report.centered_outputs)
    note(f"errors: {errs}")
    event(f"converted: {to} {options}")
    assert max(errs.values()) <= 1e-9, errs


def float32_errors(case: Case, to: str, options: dict):
    """Convert the case's model in float32. Returns None when refused, else (report, spread,
    {output: (converted error, original's own error)}), both errors against the float64 original.
    Shared with benchmarks/scripts/float32_outlier_error.py."""
    model = build(case, torch.float64)
    spread = outlier_spread(model, case)
    inputs = inputs_for(case, model)
    exact = run_original(model, inputs)
    model = model.float()
    orig = run_flat(model, inputs)
    conv, report = convert_or_refused(model, to, options)
    if conv is None:
        return None
    got = run_flat(conv, inputs)
    pats = report.centered_outputs
    return report, spread, {name: (rel_err(*comparable(got[name], exact[name], name, pats)),
                                   rel_err(*comparable(orig[name], exact[name], name, pats))) for name in exact}


@pytest.mark.parametrize("family", sorted(ADAPTERS))
@given(data=st.data(), target=TARGETS)
def test_float32_conversion_within_four_times_the_originals_own_error(family, data, target):
    case = data.draw(cases(ADAPTERS[family]), label="case")
    to, options = target
    result = float32_errors(case, to, options)
    if result is None:
        return
    report, spread, errors = result
    for name, (err, base) in errors.items():
        stream = is_stream_output(name, report.centered_outputs)
        allowed = 4 * base + (1024 if stream else 64) * F32_EPS * spread
        note(f"{name}: converted {err:.3g}, original {base:.3g}, allowed {allowed:.3g}")
        event(f"float32 ratio {'stream' if stream else 'output'} {'outliers' if spread > 1 else 'plain'}: "
              f"{'within 4x' if err <= 4 * base + 64 * F32_EPS else 'beyond 4x'}")
        assert err <= allowed, (name, err, base, allowed)
