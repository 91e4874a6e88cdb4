"""Saving and loading converted checkpoints: stock transformers reload (normfold not imported),
normfold.load, atomic writes."""

import json
import subprocess
import sys

import pytest
import torch

import normfold
from helpers import perturb_biases, perturb_norms, rel_err
from normfold import io
from normfold.errors import CheckpointError, OutputExistsError

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel  # noqa: E402

IDS = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(3))


def tiny(cls=GPT2LMHeadModel, **kw):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3, bos_token_id=0,
                     eos_token_id=0, pad_token_id=0, **kw)
    return perturb_biases(perturb_norms(cls(cfg).eval()))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def converted(tmp_path):
    model = tiny()
    conv, report = normfold.convert(model)
    out = normfold.save(conv, report, tmp_path / "out")
    return model, conv, report, out


@pytest.fixture
def converted_untied(tmp_path):
    """untie=True: the head gets its own copy of the table, the form stock transformers reloads."""
    model = tiny()
    conv, report = normfold.convert(model, untie=True)
    out = normfold.save(conv, report, tmp_path / "out")
    return model, conv, report, out


STOCK_RELOAD = r"""
import sys, json, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    out = m(input_ids=ids).logits
assert not any(k == "normfold" or k.startswith("normfold.") for k in sys.modules), "normfold was imported"
assert all(type(x).__name__ == "LayerNorm" for n, x in m.named_modules() if "ln" in n.split(".")[-1])
torch.save(out, sys.argv[3])
"""


def test_stock_transformers_reload_gives_same_outputs(converted_untied, tmp_path):
    model, conv, report, out = converted_untied
    assert report.stock_reloadable and report.to_dict()["reload"]["stock_transformers"]
    result = tmp_path / "stock_logits.pt"
    proc = subprocess.run([sys.executable, "-c", STOCK_RELOAD, str(out), json.dumps(IDS.tolist()), str(result)],
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    stock = torch.load(result, weights_only=True)
    assert rel_err(stock, logits(conv)) < 1e-5
    assert rel_err(stock, logits(model)) < 1e-5
    # and in float64 the reloaded stock model is as exact as the stored weights allow
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False


def test_tied_checkpoint_reloads_in_stock_transformers_and_with_normfold(converted, tmp_path):
    """The default keeps lm_head tied to the original table with a Recenter after the embedding. Stock
    transformers (normfold not imported) needs no Recenter, its LayerNorms re-centre their input: it loads
    model.safetensors, the tie kept, and computes the original logits; normfold.load re-attaches the Recenter."""
    model, conv, report, out = converted
    assert report.stock_reloadable and "transformer.wte" in report.structure.recenter_after
    assert "Recenter at transformer.wte" in report.to_dict()["reload"]["how"]
    assert (out / io.STOCK_WEIGHTS).is_file() and not (out / io.NORMFOLD_WEIGHTS).exists()
    assert json.loads((out / "config.json").read_text()).get("tie_word_embeddings", True) is True
    result = tmp_path / "stock_logits.pt"
    proc = subprocess.run([sys.executable, "-c", STOCK_RELOAD, str(out), json.dumps(IDS.tolist()), str(result)],
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    stock = torch.load(result, weights_only=True)
    with torch.no_grad():
        exact = model.double()(input_ids=IDS).logits
        base = rel_err(model.float()(input_ids=IDS).logits, exact)
    assert rel_err(stock, exact) <= 4 * base + 64 * torch.finfo(torch.float32).eps
    loaded = normfold.load(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight and type(loaded.lm_head) is torch.nn.Linear
    assert torch.equal(logits(loaded), logits(conv))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_normfold_load_restores_rmsnorm_modules(converted):
    from normfold.nn import RMSNorm

    model, conv, report, out = converted
    loaded = normfold.load(out)
    assert isinstance(loaded.transformer.h[0].ln_1, RMSNorm)
    assert loaded.transformer.h[0].ln_1.weight is None
    assert loaded.transformer.ln_f.weight is not None
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in loaded.modules())
    assert torch.equal(logits(loaded), logits(conv))
    assert loaded.normfold_report.variant == "rmsnorm"


def test_report_has_contract_fields(converted):
    *_, out = converted
    rep = json.loads((out / "normfold.json").read_text())
    assert rep["variant"] == "rmsnorm"
    assert {"total", "converted", "kept"} <= set(rep["layernorms"])
    assert rep["layernorms"]["total"] == 5 and rep["layernorms"]["converted"] == 5
    v = rep["verification"]
    assert {"max_abs_error", "max_rel_error", "top1_agreement", "dtype", "passed"} <= set(v)
    assert v["passed"] is True and v["fp64"]["max_rel_error"] <= 1e-9


def test_non_stock_checkpoint_uses_another_file_and_loads_with_normfold(tmp_path):
    model = tiny()
    conv, report = normfold.convert(model, fold_final=True, allow_new_bias=True)
    assert not report.stock_reloadable
    out = normfold.save(conv, report, tmp_path / "nonstock")
    assert (out / io.NORMFOLD_WEIGHTS).exists() and not (out / io.STOCK_WEIGHTS).exists()
    with pytest.raises(OSError):  # stock transformers must fail loudly, not compute something else
        GPT2LMHeadModel.from_pretrained(out)
    loaded = normfold.load(out)
    assert loaded.lm_head.bias is not None
    assert torch.equal(logits(loaded), logits(conv))


def test_existing_output_is_refused_without_force(converted):
    model, conv, report, out = converted
    before = sorted(p.name for p in out.iterdir())
    stamp = (out / "normfold.json").read_text()
    with pytest.raises(OutputExistsError, match="--force"):
        normfold.save(conv, report, out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "normfold.json").read_text() == stamp


def test_force_replaces_only_when_complete(converted, monkeypatch):
    model, conv, report, out = converted
    stamp = (out / "normfold.json").read_text()
    import safetensors.torch

    def boom(*a, **k):
        raise RuntimeError("disk full")

    import normfold.checkpoint.writer

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    monkeypatch.setattr(normfold.checkpoint.writer, "write_all", boom)  # fails mid-file (normfold's own writer)
    with pytest.raises(RuntimeError, match="disk full"):
        normfold.save(conv, report, out, force=True)
    assert (out / "normfold.json").read_text() == stamp  # old directory untouched
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temp left
    monkeypatch.undo()
    report.notes.append("second save")
    normfold.save(conv, report, out, force=True)
    assert "second save" in (out / "normfold.json").read_text()


def test_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    model = tiny()
    conv, report = normfold.convert(model, verify=False)
    monkeypatch.setattr(type(conv.config), "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(normfold.errors.OutputWriteError, match="nothing was written"):
        normfold.save(conv, report, tmp_path / "never")
    assert list(tmp_path.iterdir()) == []


def test_load_rejects_non_normfold_directory(tmp_path):
    tiny().save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="not a normfold checkpoint"):
        normfold.load(tmp_path / "plain")


def test_sequence_classification_round_trip(tmp_path):
    model = tiny(GPT2ForSequenceClassification, num_labels=3)
    conv, report = normfold.convert(model)
    out = normfold.save(conv, report, tmp_path / "cls")
    stock = GPT2ForSequenceClassification.from_pretrained(out).eval()
    loaded = normfold.load(out)
    assert rel_err(logits(stock), logits(model)) < 1e-5
    assert torch.equal(logits(loaded), logits(conv))


def test_stock_checkpoint_loads_into_aligned_memory_with_the_same_tensors(converted_untied):
    """transformers' from_pretrained leaves a safetensors checkpoint's tensors 8 bytes off a 64-byte
    boundary; normfold.load copies them (io.realign): same values, aligned, ties kept."""
    _, conv, report, out = converted_untied
    assert report.stock_reloadable
    loaded = io.load(out)
    want = conv.state_dict()
    for name, got in loaded.state_dict().items():
        assert torch.equal(got, want[name]), name
    assert all(p.data_ptr() % io.ALIGN_BYTES == 0 for p in loaded.parameters())
    assert torch.equal(logits(loaded), logits(normfold.load(out, fast=False)))
    # a tensor sharing its storage stays shared; an unaligned lone one moves
    m = torch.nn.Module()
    base = torch.arange(20, dtype=torch.float32)
    m.a, m.b = torch.nn.Parameter(base[2:10]), torch.nn.Parameter(base[10:18])
    m.c = torch.nn.Parameter(torch.arange(21, dtype=torch.float32)[1:])
    assert io.realign(m) == 1 and m.c.data_ptr() % io.ALIGN_BYTES == 0 and torch.equal(m.c, torch.arange(1., 21.))
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_normfold_weights_load_bit_identical_in_their_dtype(tmp_path, dtype):
    """A checkpoint only normfold.load can read (here Pre-CRMSNorm) comes back with exactly the saved
    tensors: a float32 skeleton would round float64 weights before the final .to(float64)."""
    model = tiny().to(dtype)
    conv, report = normfold.convert(model, to="crmsnorm")
    out = normfold.save(conv, report, tmp_path / "out")
    assert (out / io.NORMFOLD_WEIGHTS).is_file()
    loaded = io.load(out)
    want = conv.state_dict()
    for name, got in loaded.state_dict().items():
        assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
@pytest.mark.parametrize("build", ["vit-no-pooler", "vit-mask-token", "bert-no-pooler"])
def test_models_built_with_non_default_constructor_arguments_reload_exactly(to, build, tmp_path):
    """config.json does not record constructor choices such as ViTModel(config, add_pooling_layer=False):
    only which tensors exist says so. normfold.load rebuilds the model the checkpoint's tensors describe
    (no pooler with random weights, no refusal of the Pre-CRMS checkpoint for 'missing' pooler tensors),
    and its outputs are the converted model's, bit for bit."""
    torch.manual_seed(0)
    if build.startswith("vit"):
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, image_size=16, patch_size=8)
        kw = {"add_pooling_layer": False} if build == "vit-no-pooler" else {"use_mask_token": True}
        model = transformers.ViTModel(cfg, **kw).eval()
        inputs = {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))}
    else:
        cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=16)
        kw = {"add_pooling_layer": False}
        model = transformers.BertModel(cfg, **kw).eval()
        inputs = {"input_ids": IDS}
    conv, report = normfold.convert(model, to=to)
    assert report.verification["passed"]
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert set(loaded.state_dict()) == set(conv.state_dict())
    if "add_pooling_layer" in kw:
        assert loaded.pooler is None
    with torch.no_grad():
        got, want = loaded(**inputs), conv(**inputs)
    assert set(k for k, v in got.items() if v is not None) == set(k for k, v in want.items() if v is not None)
    for k, v in want.items():
        if v is not None:
            assert torch.equal(got[k], v), k


def test_stock_checkpoint_missing_a_tensor_is_refused(tmp_path):
    """A stock-layout checkpoint without a tensor its model needs (and no constructor keyword that explains
    its absence) is refused before loading: from_pretrained would fill the gap with random values."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=16, patch_size=8)
    conv, report = normfold.convert(transformers.ViTModel(cfg).eval(), to="rmsnorm", verify=False)
    out = normfold.save(conv, report, tmp_path / "out")
    state = load_file(str(out / io.STOCK_WEIGHTS))
    del state["pooler.dense.bias"]  # half the pooler: neither add_pooling_layer=True nor False
    save_file(state, str(out / io.STOCK_WEIGHTS), metadata={"format": "pt"})
    rep = json.loads((out / io.REPORT_FILE).read_text())
    rep["weight_files"] = {}
    (out / io.REPORT_FILE).write_text(json.dumps(rep))
    with pytest.raises(normfold.NormfoldError, match="pooler.dense.bias"):
        normfold.load(out)


def test_source_checkpoint_without_pooler_loads_without_one(tmp_path):
    """`normfold convert DIR` reads a source saved from ViTModel(config, add_pooling_layer=False) as that
    model, not one with a randomly initialized pooler."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=16, patch_size=8)
    transformers.ViTModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path / "src")
    model, _ = io.load_source(tmp_path / "src")
    assert model.pooler is None
