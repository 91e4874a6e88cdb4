"""`--fold-final` verification finds the folded final norm's outputs by value (verify.FinalNorms.folded), in
memory and block by block, instead of skipping 'last_hidden_state' / 'hidden_states[-1]' by name: the outputs
equal to the γ-less final norm's output are skipped, every other one (the logits) compared, so a wrong folded γ
fails both verifiers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from normfold import io
from normfold.adapters import get_adapter
from normfold.cli import main
from normfold.verify import FinalNorms, verify_conversion

from _compare import make_checkpoint


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    root = tmp_path_factory.mktemp("ff")
    src = make_checkpoint(get_adapter("gpt2").examples[0], "GPT2LMHeadModel", root / "gpt2", shard="20KB")
    out = root / "out"
    assert main(["convert", str(src), "--out", str(out), "--stream", "always", "-q", "--fold-final", "--allow-new-bias", "--untie"]) == 0
    return src, out


def _head_gamma_names(out: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            names += [k for k in h.keys() if "lm_head" in k]
    return names


def _perturb_head(out: Path) -> str:
    from safetensors.torch import load_file, save_file

    for f in sorted(out.glob("*.safetensors")):
        state = load_file(f)
        name = next((k for k in state if "lm_head" in k), None)
        if name is not None:
            t = state[name].clone()
            t[..., 0] *= 1.5  # the folded γ scales the head's columns: a wrong γ_0
            state[name] = t
            save_file(state, f, metadata={"format": "pt"})
            return name
    raise AssertionError(f"no head tensor in {out}")


def test_folded_final_norm_is_found_by_value(folded):
    src, out = folded
    report = io.inspect_converted(out)[0]
    ff = FinalNorms.folded(report.structure)
    assert ff.lacking == ("transformer.ln_f",)
    v = report.verification
    assert v["passed"] is True
    assert "hidden_states[2]" in json.dumps(v.get("skipped", {}))  # = the γ-less ln_f output, found by value


@pytest.mark.parametrize("blockwise", [False, True])
def test_wrong_folded_gamma_fails(folded, tmp_path, blockwise):
    import shutil

    src, out = folded
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    _perturb_head(bad)
    if blockwise:
        from normfold.stream.blockverify import verify_blockwise

        assert verify_blockwise(src, out, fold_final=True)["passed"] is True
        assert verify_blockwise(src, bad, fold_final=True)["passed"] is False
    else:
        original, _ = io.load_source(src)
        converted = io.load(bad)
        adapter = get_adapter("gpt2")
        inputs = adapter.example_inputs(original, torch.Generator().manual_seed(0))
        report = io.inspect_converted(bad)[0]
        v = verify_conversion(original, converted, inputs, final_norms=FinalNorms.folded(report.structure))
        assert v.passed is False
