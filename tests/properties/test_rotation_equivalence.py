"""Property-based exactness of `normfold.convert(model, rotate=...)` (issue 25): random tiny configs of
every registered family with ×1e3–1e4 outlier channels planted in the stream (the strategies of
test_family_equivalence.py). A rotated conversion either is refused with UnsupportedConversionError (a
hypothesis event) or matches the original in float64 within 1e-9 relative error on every output, stream
outputs compared in the original basis (·Qᵀ, Q rebuilt from the report) and final-norm outputs skipped
(their γ/β went into the heads). The rotated stream stays zero-mean."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("hypothesis")

from family_configs import cases  # noqa: E402
from helpers import is_stream_output, rel_err, run_flat  # noqa: E402
from hypothesis import event, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_family_equivalence import ADAPTERS, build, inputs_for, run_original  # noqa: E402

import normfold  # noqa: E402
from normfold.algebra import rotation_matrix  # noqa: E402
from normfold.errors import UnsupportedConversionError  # noqa: E402


def _final_outputs(names) -> set:
    last: dict = {}
    for n in names:
        m = re.fullmatch(r"(.*hidden_states)\[(\d+)\]", n)
        if m:
            last[m.group(1)] = max(last.get(m.group(1), -1), int(m.group(2)))
    return {f"{k}[{i}]" for k, i in last.items()} | {n for n in names if n.endswith("last_hidden_state")}


@pytest.mark.parametrize("family", sorted(ADAPTERS))
@settings(max_examples=8)
@given(data=st.data(), kind=st.sampled_from(["hadamard", "orthogonal"]), seed=st.integers(0, 2 ** 16))
def test_rotated_float64_exact_on_random_configs(family, data, kind, seed):
    case = data.draw(cases(ADAPTERS[family]), label="case")
    model = build(case)
    inputs = inputs_for(case, model)
    ref = run_original(model, inputs)
    try:
        conv, report = normfold.convert(model, rotate=kind, rotate_seed=seed, verify=False)
    except UnsupportedConversionError as e:
        event(f"refused: {str(e)[:90]}")
        return
    event(f"rotated ({'explicit' if report.structure.rotation.get('explicit') else 'weights only'})")
    rot = report.structure.rotation
    qs = {s["width"]: rotation_matrix(rot["kind"], s["width"], rot["seed"])[0] for s in rot["streams"]}
    got = run_flat(conv, inputs)
    errs = {}
    for name, r in ref.items():
        if name in _final_outputs(ref):
            continue
        t, r = got[name].double(), r.double()
        if is_stream_output(name, report.centered_outputs):
            t, r = t - t.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
            if t.shape[-1] in qs:
                g = got[name].double()
                assert float(g.mean(-1).abs().max()) <= 1e-11 * float(g.abs().max()), name
                t = t @ qs[t.shape[-1]].T
        errs[name] = rel_err(t, r)
    note(f"errors: {errs}")
    assert errs and max(errs.values()) <= 1e-9, errs
