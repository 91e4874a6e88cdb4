"""Integer ONNX models: `normfold export DIR --onnx OUT --quantize {int8,int4}` (onnxruntime's
quantize_dynamic; MatMulNBits with normfold's own 4-bit weights), and normfold.quant's integer weights
against a float64 brute force. Skipped without the onnx packages."""

from __future__ import annotations

import json

import pytest
import torch

import normfold
from helpers import realistic
from normfold.adapters import list_adapters
from normfold.cli import main
from normfold.quant import dequantize, quantize_weight


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 16), (8, 7)])
def test_quantize_weight_is_round_to_nearest(bits, group):
    """Each integer is the nearest to w / scale (float64 brute force over the whole range), the scale is
    the row's (block's) absmax over 2^(b-1) - 1, and the range is symmetric."""
    torch.manual_seed(0)
    w = torch.randn(6, 40) * torch.rand(6, 1) * 3
    iw = quantize_weight(w, bits, group)
    top = 2 ** (bits - 1) - 1
    assert iw.q.dtype == torch.int8 and iw.q.abs().max() <= top
    s = iw.scale.double()
    s_full = s[:, None].expand(6, 40) if group is None else s.repeat_interleave(group, 1)[:, :40]
    grid = torch.arange(-top, top + 1, dtype=torch.float64)
    best = grid[((w.double()[..., None] - grid * s_full[..., None]).abs()).argmin(-1)]
    assert torch.equal(iw.q.double(), best)
    blocks = w.double().reshape(6, 1, 40) if group is None else torch.nn.functional.pad(
        w.double(), (0, (-40) % group)).reshape(6, -1, group)
    amax = blocks.abs().amax(-1)
    assert torch.allclose(s.reshape(amax.shape), amax / top, rtol=1e-6)
    assert (dequantize(iw).double() - w.double()).abs().le(s_full / 2 + 1e-6).all()


def test_reduced_range_rows():
    """The ±63 int8 rows (no int16 saturation of AVX2 u8·s8 pair sums): nearest on their own grid."""
    torch.manual_seed(1)
    w = torch.randn(5, 33) * 2
    iw = quantize_weight(w, 8, method="rtn-reduced")
    assert iw.q.abs().max() == 63 and iw.q.dtype == torch.int8
    s = iw.scale.double()[:, None]
    assert torch.allclose(iw.scale.double(), w.double().abs().amax(1) / 63, rtol=1e-6)
    assert (dequantize(iw).double() - w.double()).abs().le(s / 2 + 1e-6).all()


def test_matmulnbits_is_the_dequantized_matmul():
    """One MatMulNBits node with normfold's packing computes x · dequantize(q)ᵀ (float64 reference)."""
    pytest.importorskip("onnxruntime")
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from normfold.engines.ort_quant import pack4

    for k, n, bs in ((64, 16, 32), (24, 8, 32), (96, 40, 16)):
        torch.manual_seed(k)
        w, x = torch.randn(n, k), torch.randn(3, k)
        iw = quantize_weight(w, 4, bs)
        node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=bs, accuracy_level=1)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
                                  [numpy_helper.from_array(pack4(iw.q, bs), "B"),
                                   numpy_helper.from_array(iw.scale.reshape(-1).numpy(), "S")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x.numpy()})[0]
        ref = x.double() @ dequantize(iw).double().t()
        assert float(np.abs(y - ref.numpy()).max() / ref.abs().max()) <= 1e-6


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    for m in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(m)
    root = tmp_path_factory.mktemp("oq")
    a = next(a for a in list_adapters() if a.name == "gpt2")
    torch.manual_seed(0)
    model = realistic(a.examples[0].build("GPT2LMHeadModel", torch.float32)).eval()
    conv, report = normfold.convert(model, to="rmsnorm", verify=False)
    normfold.save(conv, report, root / "rms")
    return root / "rms"


@pytest.mark.parametrize("kind,op", [("int8", "MatMulInteger"), ("int4", "MatMulNBits")])
def test_cli_quantize(gpt2_dir, tmp_path, capsys, kind, op):
    out = tmp_path / "m.onnx"
    assert main(["export", str(gpt2_dir), "--onnx", str(out), "--quantize", kind, "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["passed"] and res["onnx_vs_pytorch"]["max_rel_error"] <= 1e-4  # the float check, before quantizing
    assert res["ops"].get(op, 0) >= 9 and res["ops"].get("RMSNormalization", 0) == 5  # 4 per block × 2 + head
    assert "Gemm" not in res["ops"] and "MatMul" not in res["ops"]
    q = res["quantized_vs_pytorch"]
    assert 0 < q["max_rel_error"] and q["top1_agreement"] is not None


def test_cli_option_mixups_exit_2(gpt2_dir, tmp_path, capsys):
    assert main(["export", str(gpt2_dir), "--onnx", str(tmp_path / "m.onnx"), "--quantization", "int8", "-q"]) == 2
    assert "--quantize" in capsys.readouterr().err
    assert main(["export", str(gpt2_dir), "--ctranslate2", str(tmp_path / "c"), "--quantize", "int8", "-q"]) in (2,)
    assert not list(tmp_path.iterdir())
