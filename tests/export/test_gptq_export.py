"""GPTQ's integer weights in the engines (`normfold export ... --int-weights gptq | gptq-reduced`): the integers and
scales read back out of the written CTranslate2 `model.bin` and out of the ONNX MatMulNBits initializers are GPTQ's
own (`normfold.quant` levels and scales, computed in Python), the engine runs the model whose weights are those
values dequantized, and GPTQ's layer objective is at or below round-to-nearest's on every exported layer.
Skipped without ctranslate2 / the onnx packages."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import normfold
from helpers import perturb_biases, perturb_norms
from normfold.cli import main

pytest.importorskip("transformers")

BUNDLED_TOKENIZER = normfold.io.default_model_path() / "tokenizer.json"


def _gpt2(vocab=2048):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return perturb_biases(perturb_norms(transformers.GPT2LMHeadModel(cfg))).eval()


@pytest.fixture(scope="module")
def converted():
    model = _gpt2()
    conv, report = normfold.convert(model, to="rmsnorm", verify=False)
    return model, conv.eval(), report


def _batches(vocab=2048, n=2):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (4, 64), generator=g) for _ in range(n)]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _objective_below_rtn(res):
    assert res.objectives and set(res.objectives) == set(res.weights)
    for name, (g, r) in res.objectives.items():
        assert g <= r * (1 + 1e-9), (name, g, r)


# ---------------------------------------------------------------- CTranslate2 int8


@pytest.mark.parametrize("bits,top", [(8, 127), (7, 63)])
def test_ct2_file_holds_gptq_rows(converted, tmp_path, bits, top):
    pytest.importorskip("ctranslate2")
    from normfold.engines import ct2
    from normfold.engines.intweights import gptq_model
    from normfold.quant import from_quantized

    _, conv, report = converted
    res = gptq_model(conv, _batches(), bits=bits)
    _objective_below_rtn(res)
    spec = ct2.build_spec(res.model, report)
    out = ct2.write(spec, tmp_path / "m", "int8", own_weights=lambda w: from_quantized(res.table.lookup(w)))
    var = ct2.read_variables(out)
    names = {"self_attention/linear_0": "attn.c_attn", "self_attention/linear_1": "attn.c_proj",
             "ffn/linear_0": "mlp.c_fc", "ffn/linear_1": "mlp.c_proj"}
    pairs = [(f"decoder/layer_{i}/{k}", f"transformer.h.{i}.{v}") for i in range(2) for k, v in names.items()]
    pairs.append(("decoder/projection", "lm_head"))
    for ct_name, path in pairs:
        qw = res.weights[path]
        q, ws = var[ct_name + "/weight"], var[ct_name + "/weight_scale"]
        assert q.dtype == np.int8 and np.abs(q).max() <= top
        assert np.array_equal(q, qw.q.numpy()), ct_name  # GPTQ's levels, bit for bit
        assert np.array_equal(ws, (1.0 / qw.scale[:, 0]).numpy().astype(np.float32)), ct_name  # engine multiplier
        # dequantized as the engine does (q / weight_scale) = GPTQ's q · scale, up to the reciprocal's rounding
        deq = torch.from_numpy(q.astype(np.float32) / ws[:, None])
        assert torch.allclose(deq, qw.dequantize(torch.float32), rtol=2e-7, atol=0)
    # the engine runs the dequantized-GPTQ model; what remains is its int8 activation rounding (per token):
    # ±63 rows: within 2e-2 of the logits' scale (measured 7.6e-3). ±127 rows: on x86 CPUs without VNNI the
    # engine's u8·s8 pair sums saturate in int16 (measured 0.26 here, the engine's own rounding likewise),
    # so only the top-1 tokens are checked
    inputs = ct2.check_inputs(conv, "generator", torch.Generator().manual_seed(1), length=16)
    got = ct2.engine_logits(out, "generator", inputs)
    want = ct2.torch_logits(res.model, "generator", inputs)
    if top == 63:
        assert _rel(got, want) <= 2e-2
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_row_table_refuses_foreign_rows(converted, tmp_path):
    pytest.importorskip("ctranslate2")
    from normfold.engines import ct2
    from normfold.engines.intweights import IntWeightsError, gptq_model
    from normfold.quant import from_quantized

    _, conv, report = converted
    res = gptq_model(conv, _batches(n=1), bits=8)
    spec = ct2.build_spec(conv, report)  # the float model: its rows are not GPTQ's
    with pytest.raises(IntWeightsError, match="no GPTQ row"):
        ct2.write(spec, tmp_path / "m", "int8", own_weights=lambda w: from_quantized(res.table.lookup(w)))
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------- ONNX MatMulNBits int4


def _nbits_nodes(path):
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    for node in m.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            zp = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            yield node, attrs, inits[node.input[1]], inits[node.input[2]], zp


@pytest.mark.parametrize("group,symmetric", [(32, True), (64, False), (None, True)])
def test_onnx_initializers_hold_gptq_levels(converted, tmp_path, group, symmetric):
    for m in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(m)
    from normfold import deploy
    from normfold.engines import ort_quant
    from normfold.engines.intweights import gptq_model

    original, conv, report = converted
    res = gptq_model(conv, _batches(), bits=4, group_size=group, symmetric=symmetric)
    _objective_below_rtn(res)
    ids = {"input_ids": torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(5))}
    f = tmp_path / "f.onnx"
    info = deploy.export_onnx(res.model, ids, f)
    q4 = tmp_path / "q4.onnx"
    count = ort_quant.quantize_int4(f, q4, weights=res.table.lookup)
    assert count == 9  # 4 linears × 2 blocks + the head
    by_deq = {name: qw for name, qw in res.weights.items()}
    seen = set()
    for node, attrs, b, scales, zp in _nbits_nodes(q4):
        n, k, bs = attrs["N"], attrs["K"], attrs["block_size"]
        assert bs == (group or ort_quant.nbits_block(k, None))
        u = ort_quant.unpack_nibbles(b.reshape(n, -1), k).to(torch.int16)
        blocks = -(-k // bs)
        s = torch.from_numpy(scales).reshape(n, blocks)
        if symmetric:
            assert zp is None
            z = torch.full((n, blocks), 8, dtype=torch.int16)
        else:
            zz = torch.from_numpy(zp).reshape(n, -1)
            z = torch.stack([zz & 15, zz >> 4], -1).reshape(n, -1)[:, :blocks].to(torch.int16)
        idx = torch.arange(k) // bs
        deq = ((u - z[:, idx]).to(torch.float32) * s[:, idx])  # what MatMulNBits computes with
        match = [p for p, qw in by_deq.items() if qw.q.shape == (n, k)
                 and torch.equal(deq, qw.dequantize(torch.float32))]
        assert match, node.name
        qw = by_deq[match[0]]
        levels = qw.q.to(torch.int16) + (8 if symmetric else 0)
        assert torch.equal(u, levels)  # GPTQ's integers, bit for bit
        assert torch.equal(s, qw.scale)
        if not symmetric:
            assert torch.equal(z, qw.zero.to(torch.int16))
        seen.add(match[0])
    assert seen == set(res.weights)
    got = torch.as_tensor(deploy.run_onnx(q4, info, ids)["logits"])
    with torch.no_grad():
        want = res.model(**ids, use_cache=False).logits
        ref = original(**ids, use_cache=False).logits
    assert _rel(got, want) <= 1e-4  # the engine computes the dequantized-GPTQ model (float32 accumulation)
    assert _rel(got, ref) > 1e-4  # and that is another model than the float one: the quantization's error


def test_onnx_runtime_quantizer_sees_every_linear(converted, tmp_path):
    """onnxruntime's own MatMulNBitsQuantizer (the comparison `bench quant --engine onnxruntime --gptq` makes)
    converts MatMul only; Gemm is rewritten as MatMul (+ Add) first, exactly."""
    for m in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(m)
    from normfold import deploy
    from normfold.engines import ort_quant

    _, conv, _ = converted
    ids = {"input_ids": torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(5))}
    f = tmp_path / "f.onnx"
    info = deploy.export_onnx(conv, ids, f)
    mm = tmp_path / "mm.onnx"
    assert ort_quant.gemm_as_matmul(f, mm) == 8
    assert "Gemm" not in deploy.op_counts(mm)
    base = torch.as_tensor(deploy.run_onnx(f, info, ids)["logits"])
    assert _rel(torch.as_tensor(deploy.run_onnx(mm, info, ids)["logits"]), base) <= 1e-5
    q = tmp_path / "q.onnx"
    ort_quant.quantize_int4_onnxruntime(f, q, block_size=32)
    ops = deploy.op_counts(q)
    # every block linear; the tied head's weight is a Transpose of the embedding here, not a constant it converts
    assert ops.get("MatMulNBits", 0) >= 8 and "Gemm" not in ops


# ---------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, converted):
    root = tmp_path_factory.mktemp("gq")
    _, conv, report = converted
    normfold.save(conv, report, root / "rms")
    (root / "rms" / "tokenizer.json").write_bytes(BUNDLED_TOKENIZER.read_bytes())
    words = "In the beginning God created the heaven and the earth. And the earth was without form, and void. "
    (root / "calib.txt").write_text(words * 40)
    return root


def test_cli_ct2_gptq_reduced(model_dir, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    from normfold.engines import ct2

    out = tmp_path / "c"
    assert main(["export", str(model_dir / "rms"), "--ctranslate2", str(out), "--quantization", "int8",
                 "--int-weights", "gptq-reduced", "--calibration", str(model_dir / "calib.txt"),
                 "--calibration-windows", "2", "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    g = res["gptq"]
    assert g["bits"] == 7 and g["objective_vs_rtn"]["below_rtn"] == g["objective_vs_rtn"]["layers"] == 9
    assert res["ct2_vs_dequantized"]["max_rel_error"] <= 2e-2  # ±63 rows: no int16 saturation
    var = ct2.read_variables(out)
    w = [a for k, a in var.items() if k.endswith("/weight") and a.dtype == np.int8 and "embeddings" not in k]
    assert len(w) == 9 and max(int(np.abs(a).max()) for a in w) == 63


def test_cli_onnx_gptq_int4(model_dir, tmp_path, capsys):
    for m in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(m)
    out = tmp_path / "m.onnx"
    assert main(["export", str(model_dir / "rms"), "--onnx", str(out), "--quantize", "int4", "--int-weights", "gptq",
                 "--calibration", str(model_dir / "calib.txt"), "--calibration-windows", "2", "--block-size", "64",
                 "--asymmetric", "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    # 4 linears × 2 blocks; the head tied to the embedding stays float, as in the RTN int4 export
    assert res["passed"] and res["ops"].get("MatMulNBits") == 8 and res["gptq"]["float_layers"] == ["lm_head"]
    assert res["quantized_vs_dequantized"]["max_rel_error"] <= 1e-4
    assert res["quantized_vs_pytorch"]["max_rel_error"] > 1e-4
    assert res["gptq"]["group_size"] == 64 and not res["gptq"]["symmetric"]


@pytest.mark.parametrize("args,what", [
    (["--ctranslate2", "{out}", "--quantization", "int8", "--int-weights", "gptq"], "--calibration"),
    (["--ctranslate2", "{out}", "--int-weights", "gptq", "--calibration", "{cal}"], "int8"),
    (["--ctranslate2", "{out}", "--quantization", "int8", "--int-weights", "gptq", "--calibration", "{cal}",
      "--asymmetric"], "ONNX"),
    (["--onnx", "{out}.onnx", "--quantize", "int4", "--int-weights", "gptq-reduced", "--calibration", "{cal}"],
     "CTranslate2"),
    (["--onnx", "{out}.onnx", "--quantize", "int8", "--int-weights", "gptq", "--calibration", "{cal}"], "int4"),
    (["--onnx", "{out}.onnx", "--quantize", "int4", "--calibration", "{cal}"], "gptq"),
    (["--onnx", "{out}.onnx", "--quantize", "int4", "--int-weights", "gptq", "--calibration", "{missing}"],
     "no such file"),
])
def test_cli_refusals_write_nothing(model_dir, tmp_path, capsys, args, what):
    pytest.importorskip("ctranslate2")
    for m in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(m)
    out = tmp_path / "o"
    args = [a.format(out=out, cal=model_dir / "calib.txt", missing=tmp_path / "none.txt") for a in args]
    assert main(["export", str(model_dir / "rms"), *args, "-q"]) == 2
    assert what in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
