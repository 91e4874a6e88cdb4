"""Rotated conversions deploy to ONNX: `normfold convert --rotate hadamard` with and without
`--rotate-online` and `--rotate-attention {all,qk}`, saved, exported by the public path
(`normfold export DIR --onnx OUT`, which reloads DIR with `normfold.load`), and run in onnxruntime.

Checked per family (GPT-2, OPT, GPT-NeoX, Phi, GPT-J) and option:

- the command passes its own check (ONNX vs the reloaded PyTorch model) and exits 0;
- the ONNX file, run again at a batch and sequence length other than the ones it was exported with
  (its axes are dynamic), is within 1e-5 (relative, float32) of the reloaded model;
- at the export's inputs it is within 1e-5 of the unrotated original in float64, and within the
  original's own float32 error (times two, at least 1e-5) of the float32 original;
- the run-time pieces are in the graph: the online Walsh–Hadamard transforms change the numbers
  (their weights are rotated), and the query/key rotation of rotary families, which leaves the
  numbers unchanged, is checked by its R among the graph's initializers.

The default opset is 23, where the exporter fuses transformers' rotary arithmetic (GPT-NeoX, Phi)
into the RotaryEmbedding op; `normfold.deploy.broadcast_rotary_caches` makes those nodes run at any
batch size (before, they failed in onnxruntime at batch > 1, rotated or not).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import normfold
from helpers import realistic, rel_err
from normfold.adapters import list_adapters

pytest.importorskip("transformers")

TOL = 1e-5

FAMILIES = {"gpt2": ("tied", "GPT2LMHeadModel"), "opt": ("pre-ln", "OPTForCausalLM"),
            "gpt_neox": ("parallel", "GPTNeoXForCausalLM"), "phi": ("partial-rotary", "PhiForCausalLM"),
            "gptj": ("rotary4", "GPTJForCausalLM")}
PLAIN, ONLINE, ALL, QK = (), ("--rotate-online",), ("--rotate-online", "--rotate-attention", "all"), \
    ("--rotate-attention", "qk")
OPTIONS = {"plain": PLAIN, "online": ONLINE, "all": ALL, "qk": QK}
CASES = [(f, o) for f in ("gpt2", "opt", "gpt_neox", "phi") for o in ("plain", "online", "all")] + \
    [("gpt_neox", "qk"), ("phi", "qk"), ("gptj", "all"), ("gptj", "qk")]
ROTARY = ("gpt_neox", "phi", "gptj")


def need_onnx():
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)


def _build(family):
    name, head = FAMILIES[family]
    ex = next(e for a in list_adapters() if a.name == family for e in a.examples if e.name == name)
    torch.manual_seed(0)
    return realistic(ex.build(head, torch.float32)).eval()


def _convert(model, family, option, tmp_path):
    from normfold.cli import main

    src = tmp_path / "src"
    model.save_pretrained(src)
    code = main(["convert", str(src), "--rotate", "hadamard", *OPTIONS[option], "--out", str(tmp_path / "ckpt"), "-q"])
    assert code == 0, (family, option)
    return tmp_path / "ckpt"


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


@pytest.mark.parametrize("family,option", CASES, ids=[f"{f}-{o}" for f, o in CASES])
def test_rotated_checkpoint_exports_to_onnx(family, option, tmp_path, capsys):
    need_onnx()
    from normfold import deploy
    from normfold.cli import main
    from normfold.unified.fuse import example_inputs

    model = _build(family)
    ckpt = _convert(model, family, option, tmp_path)
    capsys.readouterr()
    out = tmp_path / "m.onnx"
    code = main(["export", str(ckpt), "--onnx", str(out), "--json", "-q"])
    text = capsys.readouterr().out
    assert code == 0, text
    result = json.loads(text)
    assert result["passed"] and result["dynamic"] and result["onnx_vs_pytorch"]["max_rel_error"] <= TOL, result

    loaded = normfold.load(ckpt).eval()
    rot = json.loads((ckpt / "normfold.json").read_text())["structure"]["rotation"]
    assert bool(rot.get("online")) == (option in ("online", "all"))
    assert ("query_key" in rot) == (option in ("all", "qk"))
    sess = deploy.session(out, threads=1)
    names = [i.name for i in sess.get_inputs()]

    # the export's own inputs (those `normfold export` made): against the original, exact and float32
    inputs = example_inputs(loaded, torch.Generator().manual_seed(0))
    got = torch.from_numpy(sess.run(None, deploy.feeds(sess, inputs))[0])
    exact = _logits(copy.deepcopy(model).double(), inputs)
    ref = _logits(model, inputs)
    assert rel_err(got, _logits(loaded, inputs)) <= TOL
    assert rel_err(got, exact) <= TOL, rel_err(got, exact)
    assert rel_err(got, ref) <= max(TOL, 2 * rel_err(ref, exact))

    # another batch and sequence length: the dynamic axes, and the rotary caches at batch 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, loaded.config.vocab_size, (3, 7), generator=g)
    other = {k: v for k, v in {"input_ids": ids, "attention_mask": torch.ones_like(ids)}.items() if k in names}
    got3 = torch.from_numpy(sess.run(None, deploy.feeds(sess, other))[0])
    assert got3.shape[:2] == (3, 7)
    assert rel_err(got3, _logits(loaded, other)) <= TOL
    assert rel_err(got3, _logits(copy.deepcopy(model).double(), other)) <= TOL

    if option in ("all", "qk") and family in ROTARY:  # R is applied at run time: it must be in the graph
        import onnx
        from onnx import numpy_helper

        graph = onnx.load(str(out))
        rs = [torch.from_numpy(numpy_helper.to_array(i).copy()) for i in graph.graph.initializer
              if i.name.endswith("_normfold_qk_rotation")]
        want = next(b for n, b in loaded.named_buffers() if n.endswith("_normfold_qk_rotation"))
        assert rs and all(torch.equal(r, want) for r in rs)


def test_rotary_caches_broadcast_over_the_batch(tmp_path):
    """The opset-23 RotaryEmbedding fusion of an unconverted GPT-NeoX: exported at batch 2, run at batch 3,
    within 1e-5 of PyTorch (failed in onnxruntime before `broadcast_rotary_caches`)."""
    need_onnx()
    from normfold import deploy

    model = _build("gpt_neox")
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    info = deploy.export_onnx(model, {"input_ids": ids}, tmp_path / "m.onnx", opset=23)
    ids3 = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    got = deploy.run_onnx(tmp_path / "m.onnx", info, {"input_ids": ids3})["logits"]
    assert rel_err(got, _logits(model, {"input_ids": ids3})) <= TOL
