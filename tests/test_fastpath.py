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


def test_bfloat16_writers_stay_plain(tmp_path):
    _converted(tmp_path, "vit", "crmsnorm", dtype=torch.bfloat16)
    fast = normfold.load(tmp_path / "crmsnorm")
    assert not any(fastpath.is_padded(m) for m in fast.modules())
    assert any(fastpath.is_fused(m) for m in fast.modules())


def test_rmsnorm_models_get_no_padding(tmp_path):
    _converted(tmp_path, "gpt2", "rmsnorm")
    fast = normfold.load(tmp_path / "rmsnorm")
    assert fastpath.pad_writers(fast) == 0
    assert not any(fastpath.is_padded(m) for m in fast.modules())


# ---- fused residual add + norm inside the blocks -------------------------------------------------------

def _wide(family):
    """Models wide enough that the fused kernel runs (inputs above the LayerNorm route's size)."""
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=192, n_layer=2, n_head=4, vocab_size=101, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).eval(), lambda: {"input_ids": torch.randint(0, 101, (2, 64))}
    cfg = transformers.ViTConfig(hidden_size=192, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                 image_size=64, patch_size=8, num_labels=7)
    return transformers.ViTForImageClassification(cfg).eval(), lambda: {"pixel_values": torch.randn(2, 3, 64, 64)}


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_blocks_exact_in_float64(tmp_path, family, to):
    model, make, _ = _converted(tmp_path, family, to)
    fast, plain = normfold.load(tmp_path / to), normfold.load(tmp_path / to, fast=False)
    fused = [m for m in fast.modules() if fastpath.is_fused(m)]
    assert len(fused) == 2 and all(type(m).__name__ in fastpath.FUSED_BLOCKS for m in fused)
    x = _inputs(make)
    with torch.no_grad():
        got, ref, orig = fast(**x).logits, plain(**x).logits, model(**x).logits
    assert _rel(got, ref) <= 1e-12
    assert _rel(got, orig) <= 1e-9
    for m in fused:
        assert fastpath.unfuse_block(m) and type(m).__name__ in fastpath.FUSED_BLOCKS
    with torch.no_grad():
        assert _rel(fast(**x).logits, ref) <= 1e-12


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_fused_kernel_path_float32(tmp_path, family, to):
    torch.manual_seed(0)
    model, make = _wide(family)
    conv, report = normfold.convert(model, to=to, verify=False)
    normfold.save(conv, report, tmp_path / to)
    fast, plain = normfold.load(tmp_path / to), normfold.load(tmp_path / to, fast=False)
    x = _inputs(make, torch.float32)
    seen = []
    norm = fast.transformer.h[0].ln_2 if family == "gpt2" else fast.vit.layers[0].layernorm_after
    norm.register_forward_hook(lambda mod, args, out: seen.append(len(args)))
    with torch.no_grad():
        got, ref, orig = fast(**x).logits, plain(**x).logits, model(**x).logits
    assert seen == [2]  # the norm was called with the residual: the fused path ran
    assert _rel(got, ref) <= 1e-5 and _rel(got, orig) <= 1e-5


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
def test_fused_generate_tokens_unchanged(tmp_path, to):
    torch.manual_seed(0)
    model, make = _wide("gpt2")
    conv, report = normfold.convert(model, to=to, verify=False)
    normfold.save(conv, report, tmp_path / to)
    fast, plain = normfold.load(tmp_path / to), normfold.load(tmp_path / to, fast=False)
    ids = _inputs(make, torch.float32)["input_ids"]
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(fast.generate(ids, **kw), plain.generate(ids, **kw))
        assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_fused_model_exports_and_compiles(tmp_path, family, to):
    torch.manual_seed(0)
    model, make = _wide(family)
    conv, report = normfold.convert(model, to=to, verify=False)
    normfold.save(conv, report, tmp_path / "m")
    fast = normfold.load(tmp_path / "m")
    x = _inputs(make, torch.float32)
    key = "input_ids" if family == "gpt2" else "pixel_values"
    with torch.no_grad():
        want = fast(**x).logits
        kw = {key: x[key], **({"use_cache": False} if family == "gpt2" else {})}
        ep = torch.export.export(fast, (), kw)
        torch.testing.assert_close(ep.module()(**kw).logits, want, rtol=1e-5, atol=1e-5)
        if family == "vit":  # one compile is enough for the tests' time budget
            compiled = torch.compile(fast, fullgraph=True)
            torch.testing.assert_close(compiled(**x).logits, want, rtol=1e-5, atol=1e-5)
