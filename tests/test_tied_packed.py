"""nn.TiedHead's packed runtime form (issue 24, "cheaper, not only exact"): one GEMM over the buffer
[E' | μ | μ | 0…] whose first d columns are the embedding's weight. References: the unpacked formula
(float64, ≤ 1e-12), a float64 brute-force product, the original model; the checkpoint bytes must not change.
"""

import copy
import importlib

import pytest
import torch
from torch import nn

import normfold
from helpers import realistic, rel_err
from normfold.nn import TiedHead
from normfold.nn import tied
from normfold.nn.tied import pack_tied_heads, unpack_tied_heads

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _pack_float64_too(monkeypatch):
    """The packed form runs in bfloat16 only (where it pays); float64 too here, to check it exactly. The
    conversions here make the older tied form (centred table, nn.TiedHead) that checkpoints written before the
    Recenter form carry, and that fold_final still makes: `--to rmsnorm` now keeps the original table and a
    stock head by default (tests/test_ties.py)."""
    monkeypatch.setattr(tied, "AUG_DTYPES", frozenset({torch.bfloat16, torch.float64}))
    _convert = importlib.import_module("normfold.conversion")  # the module (the package attribute is the function)
    monkeypatch.setattr(_convert, "recentre_tied_tables", lambda model, plan, options: plan)


def test_packed_dtypes_are_where_it_was_measured_to_pay(monkeypatch):
    monkeypatch.undo()
    assert tied.AUG_DTYPES == frozenset({torch.bfloat16})


def _head(dtype, scale=True, bias=True, vocab=37, d=12):
    g = torch.Generator().manual_seed(0)
    E = torch.randn(vocab, d, generator=g, dtype=torch.float64) + 3 * torch.randn(vocab, 1, generator=g,
                                                                                   dtype=torch.float64)
    gamma = 1 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64)
    mu = E.mean(-1)
    table = nn.Embedding(vocab, d, dtype=dtype)
    with torch.no_grad():
        table.weight.copy_(E - mu[:, None])
    head = TiedHead(table, mu.to(dtype), gamma.to(dtype) if scale else None, b.to(dtype) if bias else None)
    y = torch.randn(3, 5, d, generator=g, dtype=torch.float64)
    want = (y * gamma if scale else y) @ E.T + (b if bias else 0)
    return table, head, y, want


@pytest.mark.parametrize("scale,bias", [(False, False), (True, False), (True, True), (False, True)])
def test_packed_float64_matches_the_formula_and_brute_force(scale, bias):
    table, head, y, want = _head(torch.float64, scale, bias)
    with torch.no_grad():
        ref = head(y)
        w = table.weight
        assert head.pack() and head.packed()
        assert table.weight is w and not w.is_contiguous()  # the same Parameter, its data a view of the buffer
        got = head(y)
    assert rel_err(got, ref) <= 1e-12 and rel_err(got, want) <= 1e-12
    assert list(dict(head.named_parameters())) == ["mean"] + (["scale"] if scale else []) + (["bias"] if bias else [])


def test_packed_bfloat16_is_no_worse_than_the_formula():
    table, head, y, want = _head(torch.bfloat16, vocab=211, d=64)
    with torch.no_grad():
        ref = head(y.bfloat16())
        assert head.pack()
        got = head(y.bfloat16())
    # one rounding of the float32-accumulated sum instead of two
    assert rel_err(got, want) <= rel_err(ref, want) * 1.01 + 1e-3
    assert rel_err(got, want) <= 5e-2


def test_packed_follows_in_place_writes_and_falls_back_when_the_link_breaks():
    table, head, y, _ = _head(torch.float64)
    head.pack()
    with torch.no_grad():
        head.mean.mul_(2)  # the μ columns follow the mean's version counter
        got = head(y)
        head.unpack()
        ref = head(y)
        assert rel_err(got, ref) <= 1e-12
        head.pack()
        table.load_state_dict({"weight": torch.randn_like(table.weight)})  # copies in place: still packed
        assert head.packed()
        got = head(y)
        head.unpack()
        assert rel_err(got, head(y)) <= 1e-12
        head.pack()
        table.weight.data = table.weight.data.clone()  # re-homed: the plain formula runs, the buffer is dropped
        assert not head.packed()
        head(y)
        assert "_normfold_aug" not in head.__dict__


def test_to_dtype_deepcopy_and_gradients():
    table, head, y, want = _head(torch.float64)
    head.pack()
    holder = nn.ModuleDict({"table": table, "head": head})
    twin = copy.deepcopy(holder)
    assert twin["head"]._table is twin["table"] and not twin["head"].packed()  # a plain copy, no buffer
    with torch.no_grad():
        assert rel_err(twin["head"](y), want) <= 1e-12
    holder.float()
    assert torch.float32 not in tied.AUG_DTYPES and not head.packed() and "_normfold_aug" not in head.__dict__
    holder.double()
    assert head.packed()  # re-packed in the new dtype
    # gradients (fine-tuning): the formula runs and they are those of the untied product
    yy = y.clone().requires_grad_()
    head(yy).sum().backward()
    assert yy.grad is not None
    opt = torch.optim.SGD([table.weight], lr=0.1)
    table.weight.requires_grad_(True)
    loss = head(y).square().mean()
    loss.backward()
    opt.step()
    assert head.packed()  # the optimizer updates the view in place
    with torch.no_grad():
        got = head(y)
        head.unpack()
        assert rel_err(got, head(y)) <= 1e-12


def test_packed_head_exports_with_torch_export():
    table, head, y, want = _head(torch.float64)
    head.pack()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.head = table, head

        def forward(self, ids, y):
            return self.table(ids).sum(-1, keepdim=True) + self.head(y)

    m = M().eval()
    ids = torch.randint(0, 37, (3, 5))
    ep = torch.export.export(m, (ids, y))
    with torch.no_grad():
        assert rel_err(ep.module()(ids, y), m(ids, y)) <= 1e-12
    assert "table.weight" in ep.graph_signature.inputs_to_parameters.values()
    assert not any("aug" in str(c) for c in ep.graph_signature.inputs_to_buffers)


def _gpt2(dtype):
    from normfold.adapters import get_adapter

    ex = get_adapter("gpt2").examples[0]
    torch.manual_seed(0)
    return realistic(ex.build("GPT2LMHeadModel", dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gpt2_checkpoint_bytes_unchanged_and_logits_exact(dtype, tmp_path):
    model = _gpt2(dtype)
    conv, report = normfold.convert(model, verify=False)
    head = conv.lm_head
    assert isinstance(head, TiedHead) and head.packed()
    a = normfold.save(conv, report, tmp_path / "packed")
    unpack_tied_heads(conv)
    b = normfold.save(conv, report, tmp_path / "plain")
    for f in ("model.safetensors", "normfold.safetensors"):
        pa, pb = a / f, b / f
        if pa.exists() or pb.exists():
            assert pa.read_bytes() == pb.read_bytes(), f
    loaded = normfold.load(a)
    plain = normfold.load(a, fast=False)
    assert loaded.lm_head.packed() and not plain.lm_head.packed()  # fast=False: the formula
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = loaded(ids, use_cache=False).logits
        ref = plain(ids, use_cache=False).logits
        orig = model.double()(ids, use_cache=False).logits
    if dtype == torch.float64:
        assert rel_err(got, ref) <= 1e-12 and rel_err(got, orig) <= 1e-9
    else:
        assert rel_err(got, orig) <= 2 * rel_err(ref, orig) + 1e-3
    assert pack_tied_heads(loaded) == 0  # already packed


def test_gpt2_generate_unchanged_packed_float64(tmp_path):
    model = _gpt2(torch.float64)
    conv, report = normfold.convert(model, verify=False)
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert loaded.lm_head.packed()
    prompt = torch.randint(1, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        assert torch.equal(loaded.generate(prompt, **kw), model.generate(prompt, **kw))


def test_back_to_layernorm_unpacks(tmp_path):
    model = _gpt2(torch.float64)
    conv, report = normfold.convert(model, verify=False)
    assert conv.lm_head.packed()
    back, _ = normfold.convert(conv, to="layernorm", verify=False)
    w = back.transformer.wte.weight
    assert w.is_contiguous() and back.lm_head.weight is w


def test_packed_head_exports_to_onnx(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    table, head, y, want = _head(torch.float64)
    assert head.pack()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.head = table, head

        def forward(self, ids, y):
            return self.table(ids).sum(-1, keepdim=True) + self.head(y)

    m = M().eval()
    ids = torch.randint(0, 37, (3, 5))
    path = tmp_path / "packed.onnx"
    torch.onnx.export(m, (ids, y), str(path), dynamo=True)
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path))
    assert not any(tuple(i.dims) == (37, 12 + 8) for i in model.graph.initializer)  # the buffer is not exported
    try:
        sess = ort.InferenceSession(str(path))
    except Exception as e:  # float64 kernels missing in this onnxruntime build
        pytest.skip(f"onnxruntime cannot run the float64 graph: {e}")
    (out,) = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), (ids, y))})
    with torch.no_grad():
        assert rel_err(torch.from_numpy(out), m(ids, y)) <= 1e-12


def test_unpack_and_pack_a_converted_bfloat16_model():
    model = _gpt2(torch.bfloat16)
    conv, report = normfold.convert(model, verify=False)
    assert conv.lm_head.packed()
    plain, _ = normfold.convert(model, verify=False, fast=False)
    assert not plain.lm_head.packed()
    assert unpack_tied_heads(conv) == 1 and not conv.lm_head.packed()
    assert conv.transformer.wte.weight.is_contiguous()
    assert pack_tied_heads(conv) == 1
