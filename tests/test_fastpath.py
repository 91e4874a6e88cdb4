"""Runtime fast paths of loaded models (normfold.fastpath, issue 24): exact against the same checkpoint
loaded with fast=False and against the original model (float64), generate() unchanged, the checkpoint
unchanged by a save from the fast model, torch.export still works, and the fall-back when a
parameter leaves its padded buffer."""

import pytest
import torch

import normfold
from normfold import fastpath

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval(), lambda: {"input_ids": torch.randint(0, 97, (2, 9))}


def _vit():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=32, patch_size=8, num_labels=7)
    return transformers.ViTForImageClassification(cfg).eval(), lambda: {"pixel_values": torch.randn(2, 3, 32, 32)}


FAMILIES = {"gpt2": _gpt2, "vit": _vit}


def _inputs(make, dtype=torch.float64):
    torch.manual_seed(1)
    x = make()
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in x.items()}


def _converted(tmp_path, family, to, dtype=torch.float64):
    torch.manual_seed(0)
    model, make = FAMILIES[family]()
    model = model.to(dtype)
    conv, report = normfold.convert(model, to=to, verify=False)
    normfold.save(conv, report, tmp_path / to)
    return model, make, report


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_writers_exact_in_float64(tmp_path, family):
    model, make, _ = _converted(tmp_path, family, "crmsnorm")
    fast, plain = normfold.load(tmp_path / "crmsnorm"), normfold.load(tmp_path / "crmsnorm", fast=False)
    padded = [m for m in fast.modules() if fastpath.is_padded(m)]
    assert len(padded) == 2 * 2  # two writers per block, two blocks
    assert not any(fastpath.is_padded(m) for m in plain.modules())
    x = _inputs(make)
    with torch.no_grad():
        got, ref, orig = fast(**x).logits, plain(**x).logits, model(**x).logits
    assert _rel(got, ref) <= 1e-12
    assert _rel(got, orig) <= 1e-9
    # the parameters keep the checkpoint's (d-1)-wide shapes, views of the padded buffers
    d = model.config.hidden_size
    for m in padded:
        axis = 0 if isinstance(m, torch.nn.Linear) else 1
        assert m.weight.shape[axis] == d - 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_from_fast_model_writes_the_same_checkpoint(tmp_path, family):
    _, make, report = _converted(tmp_path, family, "crmsnorm")
    fast = normfold.load(tmp_path / "crmsnorm")
    normfold.save(fast, report, tmp_path / "again")
    a = normfold.load(tmp_path / "crmsnorm", fast=False).state_dict()
    b = normfold.load(tmp_path / "again", fast=False).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_generate_tokens_unchanged(tmp_path):
    _, make, _ = _converted(tmp_path, "gpt2", "crmsnorm", dtype=torch.float32)
    fast, plain = normfold.load(tmp_path / "crmsnorm"), normfold.load(tmp_path / "crmsnorm", fast=False)
    ids = _inputs(make)["input_ids"][:1, :5]
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(fast.generate(ids, **kw), plain.generate(ids, **kw))


def test_falls_back_when_the_parameter_leaves_its_buffer(tmp_path):
    _, make, _ = _converted(tmp_path, "vit", "crmsnorm")
    fast, plain = normfold.load(tmp_path / "crmsnorm"), normfold.load(tmp_path / "crmsnorm", fast=False)
    x = _inputs(make)
    writer = next(m for m in fast.modules() if fastpath.is_padded(m))
    with torch.no_grad():
        writer.weight.data = writer.weight.data.clone() * 2  # no longer a view of the padded buffer
        for m in plain.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.shape == writer.weight.shape:
                m.weight.mul_(2)
                break
        assert _rel(fast(**x).logits, plain(**x).logits) <= 1e-12


def test_gradients_take_the_plain_path(tmp_path):
    _, make, _ = _converted(tmp_path, "gpt2", "crmsnorm")
    fast, plain = normfold.load(tmp_path / "crmsnorm"), normfold.load(tmp_path / "crmsnorm", fast=False)
    x = _inputs(make)
    for m in (fast, plain):
        m(**x).logits.square().sum().backward()
    gf = dict(fast.named_parameters())
    for name, p in plain.named_parameters():
        if p.grad is not None:
            assert torch.allclose(gf[name].grad, p.grad, rtol=1e-10, atol=1e-12), name


def test_torch_export_of_fast_model(tmp_path):
    _, make, _ = _converted(tmp_path, "vit", "crmsnorm", dtype=torch.float32)
    fast = normfold.load(tmp_path / "crmsnorm")
    x = _inputs(make, torch.float32)["pixel_values"]
    ep = torch.export.export(fast, (x,))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x).logits, fast(x).logits, rtol=1e-5, atol=1e-5)


def test_rmsnorm_models_get_no_padding(tmp_path):
    _converted(tmp_path, "gpt2", "rmsnorm")
    fast = normfold.load(tmp_path / "rmsnorm")
    assert fastpath.pad_writers(fast) == 0
    assert not any(fastpath.is_padded(m) for m in fast.modules())
