"""The online Hadamard on the attention output (QuaRot): exact in float64 per family, on the attention
output projections only, replayed by normfold.load (bit-identical) and exported by torch.export."""

import pytest
import torch

import normfold
from helpers import rel_err, run_flat
from normfold.nn.online import has_input_hadamard
from normfold.rotate import add_attention_online_hadamard
from test_rotate_families import _back, _build, _final_outputs, _ids, _qs, _ref

pytest.importorskip("transformers")

CASES = [(("gpt2", "tied", "GPT2LMHeadModel"), "attn.c_proj"), (("opt", "pre-ln", "OPTForCausalLM"), "self_attn.out_proj"),
         (("gpt_neox", "parallel", "GPTNeoXForCausalLM"), "attention.dense"),
         (("phi", "partial-rotary", "PhiForCausalLM"), "self_attn.dense"),
         (("gptj", "rotary4", "GPTJForCausalLM"), "attn.out_proj"),
         (("falcon", "new-arch-ln-attn-mlp", "FalconForCausalLM"), "self_attention.dense")]


@pytest.mark.parametrize("case,suffix", CASES, ids=_ids([c for c, _ in CASES]))
def test_attention_output_hadamard_is_exact_reloads_and_exports(case, suffix, tmp_path):
    adapter, model, inputs = _build(*case, torch.float64)
    conv, report = normfold.convert(model, rotate="hadamard", rotate_online=True)
    down = list(report.structure.rotation["online"])
    done = add_attention_online_hadamard(conv, report)
    assert done and all(p.endswith(suffix) for p in done), done
    assert report.structure.rotation["online"] == down + done and not report.stock_reloadable
    mods = dict(conv.named_modules())
    assert all(has_input_hadamard(mods[p]) for p in done)
    qs = _qs(report)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for name in ref:
        if name not in _final_outputs(ref):
            assert rel_err(_back(name, got[name], report, qs), _ref(name, ref[name], report)) <= 1e-9, name
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert all(has_input_hadamard(dict(loaded.named_modules())[p]) for p in done)
    for name, t in run_flat(loaded, inputs).items():
        if case[0] == "gptj":  # GPT-J reloads within 1e-10 even without this step (its rotary tables are rebuilt)
            assert rel_err(t, got[name]) <= 1e-9, name
        else:
            assert torch.equal(t, got[name]), name
    ids = inputs["input_ids"]
    ep = torch.export.export(loaded, (), {"input_ids": ids, "use_cache": False})
    assert rel_err(ep.module()(input_ids=ids, use_cache=False).logits, loaded(input_ids=ids, use_cache=False).logits) <= 1e-9


def test_needs_a_rotated_model():
    _, model, _ = _build("gpt2", "tied", "GPT2LMHeadModel", torch.float64)
    conv, report = normfold.convert(model)
    with pytest.raises(normfold.NormfoldError, match="needs a rotated model"):
        add_attention_online_hadamard(conv, report)
