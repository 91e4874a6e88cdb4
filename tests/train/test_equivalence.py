"""Issue 9 item 6: a prepared model trains exactly like its LayerNorm original.

Each test trains the untouched LayerNorm model and a prepared copy with the same loop (20 optimizer
steps, same batches, same θ₀) and compares every loss and every parameter. float64: ≤ 1e-10
relative; float32: the prepared model's drift from the float64 LayerNorm run is compared with the
LayerNorm model's own float32 drift (the floating-point baseline).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from normfold import train as nftrain

import trainkit as tk

TOL = 1e-10


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("family", list(tk.FAMILIES))
def test_float64_training_equals_layernorm(family, optimizer, to):
    fam = tk.FAMILIES[family]
    ln, prep = tk.pair(fam)
    nftrain.prepare(prep, to=to)
    assert list(prep.state_dict()) == list(ln.state_dict())
    assert [n for n, _ in prep.named_parameters()] == [n for n, _ in ln.named_parameters()]
    ref = tk.train(ln, fam, optimizer)
    got = tk.train(prep, fam, optimizer)
    assert tk.loss_error(got.losses, ref.losses) <= TOL
    err, name = tk.worst_param_error(got.params, ref.params)
    assert err <= TOL, (name, err)
    # the run really trained: parameters moved far more than the tolerance
    moved = max(tk.rel(ref.params[n], p) for n, p in tk.pair(fam)[0].named_parameters())
    assert moved > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "whisper"])
def test_rmsnorm_with_folded_affines(family):
    """prepare(keep_affine=False): γ/β folded into the readers' φ (convert's form) trains exactly too."""
    fam = tk.FAMILIES[family]
    ln, prep = tk.pair(fam)
    nftrain.prepare(prep, to="rmsnorm", keep_affine=False)
    assert nftrain.state(prep).folded
    ref = tk.train(ln, fam, "adamw")
    got = tk.train(prep, fam, "adamw")
    assert tk.loss_error(got.losses, ref.losses) <= TOL
    assert tk.worst_param_error(got.params, ref.params)[0] <= TOL


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
def test_prepared_forward_really_is_rms(to):
    """The prepared model's stream is zero-mean (rmsnorm) / has a zero last coordinate (crmsnorm),
    and its norm modules do not compute a LayerNorm: a plain LayerNorm fed the same stream would
    differ from the LN model where the stream is not zero-mean."""
    ln, prep = tk.pair(tk.FAMILIES["gpt2"])
    nftrain.prepare(prep, to=to)
    ids = torch.randint(0, 97, (2, 9))
    hs_ln = ln(input_ids=ids, output_hidden_states=True).hidden_states
    hs = prep(input_ids=ids, output_hidden_states=True).hidden_states
    for h, h_ln in zip(hs[:-1], hs_ln[:-1]):
        scale = h.abs().max().item()
        if to == "rmsnorm":
            assert (h.mean(-1).abs().max() / scale) < 1e-13
            assert torch.allclose(h, h_ln - h_ln.mean(-1, keepdim=True), rtol=0, atol=1e-12 * scale)
        else:
            assert h[..., -1].abs().max() == 0
        assert (h_ln.mean(-1).abs().max() / scale) > 1e-2  # the LN model's stream is not centred
    norm = prep.transformer.h[0].ln_1
    assert isinstance(norm, torch.nn.LayerNorm) and type(norm).__name__ == "PreparedLayerNorm"


def test_outlier_weights_float64():
    fam = tk.Family("gpt2-outliers", tk.outlier_gpt2, tk.FAMILIES["gpt2"].batch)
    for to in ("rmsnorm", "crmsnorm"):
        ln, prep = tk.pair(fam)
        assert ln.transformer.wte.weight.abs().max() > 500
        nftrain.prepare(prep, to=to)
        ref = tk.train(ln, fam, "adamw")
        got = tk.train(prep, fam, "adamw")
        assert tk.loss_error(got.losses, ref.losses) <= TOL
        err, name = tk.worst_param_error(got.params, ref.params)
        assert err <= TOL, (to, name, err)


def test_naive_rmsnorm_swap_does_not_match():
    """Replacing LayerNorm by RMSNorm (same γ, β) without centring is a different model."""
    fam = tk.FAMILIES["gpt2"]
    ln, naive = tk.pair(fam)
    tk.naive_swap(naive)
    ref = tk.train(ln, fam, "adamw")
    got = tk.train(naive, fam, "adamw")
    loss_err = tk.loss_error(got.losses, ref.losses)
    param_err, _ = tk.worst_param_error(got.params, ref.params)
    print(f"naive swap: loss rel. error {loss_err:.3g}, worst parameter rel. error {param_err:.3g}")
    assert abs(got.losses[0] - ref.losses[0]) / ref.losses[0] > 1e-3  # differs from the first forward on
    assert param_err > 1e-2


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
def test_float32_drift_is_floating_point_noise(to):
    """float32: the prepared model's distance to the exact (float64 LayerNorm) run stays within a
    small multiple of the LayerNorm model's own float32 distance, step by step."""
    fam = tk.FAMILIES["gpt2"]
    torch.manual_seed(0)
    exact = fam.build().double()
    ln32 = copy.deepcopy(exact).float()
    prep32 = nftrain.prepare(copy.deepcopy(exact).float(), to=to)
    ref = tk.train(exact, fam, "adamw", keep_steps=True)
    a = tk.train(ln32, fam, "adamw", keep_steps=True)
    b = tk.train(prep32, fam, "adamw", keep_steps=True)
    rows = []
    for s in range(20):
        base = tk.worst_param_error(a.per_step_params[s], ref.per_step_params[s])[0]
        mine = tk.worst_param_error(b.per_step_params[s], ref.per_step_params[s])[0]
        vs_ln = tk.worst_param_error(b.per_step_params[s], a.per_step_params[s])[0]
        rows.append({"step": s + 1, "ln32_vs_exact": base, "prepared32_vs_exact": mine, "prepared32_vs_ln32": vs_ln,
                     "loss_rel_prepared32_vs_ln32": abs(a.losses[s] - b.losses[s]) / abs(a.losses[s])})
    out = os.environ.get("NORMFOLD_DRIFT_JSON")
    if out:
        with open(out.replace(".json", f"-{to}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        assert r["prepared32_vs_exact"] <= 8 * r["ln32_vs_exact"] + 1e-6, r
        assert r["loss_rel_prepared32_vs_ln32"] < 1e-4, r
