"""Tied embedding / head kept tied by `--to rmsnorm` (issue 24 item 1 and its follow-up).

The default form: the shared table stays the ORIGINAL tensor, still shared with the stock nn.Linear head,
and an explicit Recenter after the embedding makes its output zero-mean (structure.recenter_after); the
final norm keeps its γ/β, so the logits are the original GEMM with no correction and no extra parameter.
The checkpoint is in the stock layout: stock transformers reloads it without the Recenter (its LayerNorms
re-centre their input; tests/test_stock_recenter.py checks every family against the original).
Where the head itself is edited (fold_final folds the final norm's γ into it) the older form stays: the
table is centred (E' = E − μ1ᵀ) and the head (nn.TiedHead) computes z·E'ᵀ + (Σz)·μ (+ bias); checkpoints
written with that form (structure.tied_heads) still load. References are independent: the original model
(float64), a float64 brute-force product for the module, stock transformers for the untied form.
"""

import importlib
import json

import pytest
import torch
from torch import nn

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import list_adapters
from normfold.compress.crmsnorm import TIE_ENTRY
from normfold.nn import TiedHead

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _tied_linear_heads(model):
    """(head module path, table module path) for every nn.Linear head sharing its weight with an nn.Embedding."""
    owner = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, nn.Embedding) and isinstance(w, torch.Tensor):
            owner.setdefault(id(w), name)
    return [(name, owner[id(mod.weight)]) for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and id(mod.weight) in owner]


def _cases():
    cases = []
    for a in list_adapters():
        for ex in a.examples:
            for head in ex.heads:
                model = ex.build(head)
                if not _tied_linear_heads(model):
                    continue
                untied, rep = normfold.convert(model, verify=False, untie=True)
                if any(n.endswith(".weight") for n in rep.structure.untied):  # the table is edited: a tie to keep
                    cases.append((a, ex, head))
    return cases


CASES = _cases()
IDS = [f"{a.name}-{ex.name}-{head}" for a, ex, head in CASES]


def build(example, head, dtype):
    torch.manual_seed(0)
    return realistic(example.build(head, dtype))


def test_every_tied_family_is_covered():
    names = {a.name for a, _, _ in CASES}
    assert {"gpt2", "gpt_neo", "opt", "whisper", "gpt_neox", "phi", "falcon"} <= names, names


def _old_form(monkeypatch):
    """Convert as normfold did before the Recenter form: the tied table centred, the head an nn.TiedHead."""
    _convert = importlib.import_module("normfold.conversion")  # the module (the package attribute is the function)
    monkeypatch.setattr(_convert, "recentre_tied_tables", lambda model, plan, options: plan)


@pytest.mark.parametrize("adapter,example,head", CASES, ids=IDS)
def test_tied_table_stays_original_and_head_stays_stock(adapter, example, head):
    model = build(example, head, torch.float64)
    tied = _tied_linear_heads(model)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, verify=False)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for name in ref:
        if "logits" in name or "scores" in name:
            assert rel_err(got[name], ref[name]) <= 1e-9, name
    assert report.structure.tied_heads == []
    for h, t in tied:
        assert type(conv.get_submodule(h)) is nn.Linear  # the stock head, no correction term
        assert conv.get_submodule(h).weight is conv.get_submodule(t).weight  # one tensor, not a copy
        assert torch.equal(conv.get_submodule(t).weight, model.get_submodule(t).weight)  # the original table
        tables = [n for n, m in conv.named_modules(remove_duplicate=False)
                  if isinstance(m, nn.Embedding) and m.weight is conv.get_submodule(h).weight]
        # the output of the embeddings that wrote the stream is re-centred instead (BART's `shared` only
        # hands the tensor to the encoder's and decoder's embeddings)
        assert set(report.structure.recenter_after) & set(tables), tables
    before = sum(p.numel() for p in model.parameters())
    after = sum(p.numel() for p in conv.parameters())
    assert after <= before
    size = report.to_dict()["size"]
    assert size["weight_bytes"]["after"] <= size["weight_bytes"]["before"]
    untied, _ = normfold.convert(model, verify=False, untie=True)
    vocab = [conv.get_submodule(h).out_features for h, _ in tied]
    d = [conv.get_submodule(h).in_features for h, _ in tied]
    # untie=True pays a vocab x d copy per head instead
    assert sum(p.numel() for p in untied.parameters()) - after >= sum(v * k for v, k in zip(vocab, d))


@pytest.mark.parametrize("adapter,example,head", CASES, ids=IDS)
def test_save_then_normfold_load_gives_the_same_outputs(adapter, example, head, tmp_path):
    model = build(example, head, torch.float32)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model)
    assert report.verification["passed"]
    out = normfold.save(conv, report, tmp_path / "out")
    # the stock layout: stock transformers reloads it too (tests/test_stock_recenter.py)
    assert report.stock_reloadable and (out / "model.safetensors").is_file()
    loaded = normfold.load(out)
    for h, t in _tied_linear_heads(model):
        assert type(loaded.get_submodule(h)) is nn.Linear
        assert loaded.get_submodule(h).weight is loaded.get_submodule(t).weight
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in conv.parameters())
    got = run_flat(conv, inputs)
    for name, value in run_flat(loaded, inputs).items():
        assert torch.equal(value, got[name]), name


CAUSAL = [c for c in CASES if c[2].endswith(("ForCausalLM", "LMHeadModel")) and c[0].name != "whisper"]


@pytest.mark.parametrize("adapter,example,head", CAUSAL, ids=[f"{a.name}-{ex.name}-{h}" for a, ex, h in CAUSAL])
def test_generate_greedy_tokens_unchanged_after_reload(adapter, example, head, tmp_path):
    model = build(example, head, torch.float64)
    conv, report = normfold.convert(model, verify=False)
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    prompt = torch.randint(1, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        want = model.generate(prompt, **kw)
        assert torch.equal(conv.generate(prompt, **kw), want)
        assert torch.equal(loaded.generate(prompt, **kw), want)


def test_whisper_generate_unchanged(tmp_path):
    from normfold.adapters import get_adapter

    adapter = get_adapter("whisper")
    model = build(adapter.examples[0], "WhisperForConditionalGeneration", torch.float64)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, verify=False)
    assert "model.decoder.embed_tokens" in report.structure.recenter_after and not report.structure.tied_heads
    assert type(conv.proj_out) is nn.Linear and conv.proj_out.weight is conv.model.decoder.embed_tokens.weight
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    feats = inputs["input_features"].double()
    kw = dict(max_new_tokens=6, do_sample=False, decoder_input_ids=torch.tensor([[1, 2]] * feats.shape[0]))
    with torch.no_grad():
        want = model.generate(feats, **kw)
        assert torch.equal(loaded.generate(feats, **kw), want)


def _example(name, example=None):
    from normfold.adapters import get_adapter

    a = get_adapter(name)
    ex = a.examples[0] if example is None else next(e for e in a.examples if e.name == example)
    return a, ex


@pytest.mark.parametrize("family,example,head", [("gpt2", None, "GPT2LMHeadModel"),
                                                 ("opt", "pre-ln", "OPTForCausalLM"),
                                                 ("phi", "qk-layernorm-eps6", "PhiForCausalLM")])
@pytest.mark.parametrize("options", [dict(fold_final=True), dict(fold_final=True, allow_new_bias=True)],
                         ids=["fold-final", "fold-final-new-bias"])
def test_folded_final_norm_and_head_bias_stay_exact(family, example, head, options, tmp_path):
    """The final norm's γ (and β, into a bias the head has or grows) folded into a tied head (fold_final: the
    head is edited, so the older form stays): the head keeps γ as its `scale` and the folded bias; Phi's head
    has its own bias."""
    adapter, ex = _example(family, example)
    model = build(ex, head, torch.float64)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, verify=False, **options)
    rec = report.structure.tied_heads[0]
    head_mod = conv.get_submodule(rec["head"])
    assert isinstance(head_mod, TiedHead) and head_mod.weight is conv.get_submodule(rec["table"]).weight
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    assert rel_err(got["logits"], ref["logits"]) <= 1e-9
    if options.get("allow_new_bias"):
        assert rec["scale"] and rec["bias"]  # γ and β both left the final norm
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert isinstance(loaded.get_submodule(rec["head"]), TiedHead)
    assert torch.equal(run_flat(loaded, inputs)["logits"], got["logits"])


@pytest.mark.parametrize("family,example,head", [("gpt2", None, "GPT2LMHeadModel"),
                                                 ("opt", "pre-ln", "OPTForCausalLM"),
                                                 ("phi", "qk-layernorm-eps6", "PhiForCausalLM")])
def test_keep_affine_uses_the_recenter_form(family, example, head, tmp_path):
    adapter, ex = _example(family, example)
    model = build(ex, head, torch.float64)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, verify=False, keep_affine=True)
    (h, t), = _tied_linear_heads(model)
    assert not report.structure.tied_heads and t in report.structure.recenter_after
    assert type(conv.get_submodule(h)) is nn.Linear and conv.get_submodule(h).weight is conv.get_submodule(t).weight
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    assert rel_err(got["logits"], ref["logits"]) <= 1e-9
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert torch.equal(run_flat(loaded, inputs)["logits"], got["logits"])


@pytest.mark.parametrize("family,example,head", [("gpt2", None, "GPT2LMHeadModel"),
                                                 ("whisper", None, "WhisperForConditionalGeneration")])
def test_checkpoints_of_the_older_tied_head_form_still_load(family, example, head, tmp_path, monkeypatch):
    """A checkpoint written by normfold before the Recenter form (centred table, nn.TiedHead, its `mean` in
    the file, structure.tied_heads) loads with normfold.load and computes what it computed."""
    adapter, ex = _example(family, example)
    model = build(ex, head, torch.float32)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    with monkeypatch.context() as m:
        _old_form(m)
        conv, report = normfold.convert(model)
    assert report.verification["passed"] and report.structure.tied_heads
    out = normfold.save(conv, report, tmp_path / "old")
    monkeypatch.undo()
    loaded = normfold.load(out)
    (h, t), = _tied_linear_heads(model)
    assert isinstance(loaded.get_submodule(h), TiedHead) and loaded.get_submodule(h).weight is loaded.get_submodule(t).weight
    ref, got = run_flat(conv, inputs), run_flat(loaded, inputs)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,bias", [(False, False), (True, False), (True, True), (False, True)])
def test_tied_head_module_against_float64_brute_force(dtype, scale, bias):
    g = torch.Generator().manual_seed(0)
    vocab, d = 37, 12
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
    got = head(y.to(dtype))
    assert got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    assert rel_err(got, want) <= tol
    lin = head.untied_linear()  # the stock form computes the same
    assert rel_err(lin(y.to(dtype)), want) <= tol
    assert list(dict(head.named_parameters())) == ["mean"] + (["scale"] if scale else []) + (["bias"] if bias else [])


class _TableAndHead(nn.Module):
    def __init__(self, head: TiedHead, table: nn.Embedding) -> None:
        super().__init__()
        self.table, self.head = table, head

    def forward(self, ids, y):
        return self.table(ids).sum(-1, keepdim=True) + self.head(y)


def _module_for_export():
    g = torch.Generator().manual_seed(0)
    table = nn.Embedding(29, 8)
    head = TiedHead(table, torch.randn(29, generator=g), 1 + torch.randn(8, generator=g), torch.randn(29, generator=g))
    ids = torch.randint(0, 29, (2, 4), generator=g)
    y = torch.randn(2, 4, 8, generator=g)
    return _TableAndHead(head, table).eval(), (ids, y)


def test_tied_head_exports_with_torch_export_and_onnx(tmp_path):
    module, args = _module_for_export()
    ep = torch.export.export(module, args)
    assert torch.allclose(ep.module()(*args), module(*args), rtol=1e-6, atol=1e-6)
    assert "table.weight" in ep.graph_signature.inputs_to_parameters.values()  # the table once, as a parameter
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "head.onnx"
    torch.onnx.export(module, args, str(path), dynamo=True)
    onnx.checker.check_model(str(path))
    sess = ort.InferenceSession(str(path))
    feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
    (out,) = sess.run(None, feeds)
    assert torch.allclose(torch.from_numpy(out), module(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,example,head", [("gpt2", None, "GPT2LMHeadModel"), ("opt", "pre-ln", "OPTForCausalLM")])
def test_converted_tied_model_exports(family, example, head, tmp_path):
    adapter, ex = _example(family, example)
    model = build(ex, head, torch.float32)
    conv, report = normfold.convert(model, verify=False)
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    ep = torch.export.export(loaded, (ids,), {"use_cache": False})
    with torch.no_grad():
        eager = loaded(ids, use_cache=False).logits
        got = ep.module()(ids, use_cache=False).logits
        exact = model.double()(ids, use_cache=False).logits
        base = rel_err(model.float()(ids, use_cache=False).logits, exact)
    assert rel_err(got, eager) <= 1e-5  # the exported graph computes what the module computes
    assert rel_err(got, exact) <= 4 * base + 64 * torch.finfo(torch.float32).eps
    (h, t), = _tied_linear_heads(model)
    assert t in report.structure.recenter_after  # the Recenter after the embedding is in the exported graph:
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    first = ops.index("aten.embedding.default")
    assert ops[first + 1:first + 3] == ["aten.mean.dim", "aten.sub.Tensor"]


def test_converted_tied_model_exports_to_onnx(tmp_path):
    """Every op of the default tied form exports: the Recenter hook after the embedding and the stock head."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    adapter, ex = _example("gpt2")
    model = build(ex, "GPT2LMHeadModel", torch.float32)
    conv, report = normfold.convert(model, verify=False)
    assert "transformer.wte" in report.structure.recenter_after
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"), fast=False)

    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(ids, use_cache=False).logits

    module = Logits(loaded).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "tied.onnx"
    torch.onnx.export(module, (ids,), str(path), dynamo=True)
    onnx.checker.check_model(str(path))
    sess = ort.InferenceSession(str(path))
    (out,) = sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})
    with torch.no_grad():
        want = model.double()(ids).logits
        base = rel_err(model.float()(ids).logits, want)
    assert rel_err(torch.from_numpy(out), want) <= 4 * base + 64 * torch.finfo(torch.float32).eps


def test_untie_gives_the_stock_form_that_transformers_reloads(tmp_path):
    adapter, ex = _example("gpt2")
    model = build(ex, "GPT2LMHeadModel", torch.float32)
    conv, report = normfold.convert(model, untie=True)
    assert report.stock_reloadable and not report.structure.tied_heads
    assert report.to_dict()["reload"]["stock_transformers"] is True
    out = normfold.save(conv, report, tmp_path / "out")
    stock = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model.double()(ids).logits
        base = rel_err(model.float()(ids).logits, exact)
        assert rel_err(stock(ids).logits, exact) <= 4 * base + 64 * torch.finfo(torch.float32).eps


def test_report_states_size_and_reload_path():
    adapter, ex = _example("gpt2")
    model = build(ex, "GPT2LMHeadModel", torch.float32)
    _, kept = normfold.convert(model, verify=False)
    _, untied = normfold.convert(model, verify=False, untie=True)
    params = sum(p.numel() for p in model.parameters())
    for rep in (kept, untied):
        size = rep.to_dict()["size"]
        assert size["parameters"]["before"] == params and size["weight_bytes"]["before"] == 4 * params
        assert size["weight_bytes"]["after"] == 4 * size["parameters"]["after"]
    vocab, d = model.config.vocab_size, model.config.n_embd
    assert untied.size["parameters"]["after"] - kept.size["parameters"]["after"] == vocab * d
    assert kept.size["parameters"]["after"] <= params
    how = kept.to_dict()["reload"]["how"]
    assert "plain transformers" in how and "Recenter at transformer.wte" in how and "does without" in how
    assert "tied embedding/head stays one tensor" in how and "--untie" in how
    assert kept.stock_reloadable and untied.stock_reloadable
    assert any("tied" in n and "Recenter after transformer.wte" in n and "original" in n and "--untie" in n
               and "Stock transformers computes the same logits" in n for n in kept.notes)
    assert not any("TiedHead" in n for n in kept.notes)


@pytest.mark.parametrize("tamper", [
    lambda t: t.update(head="transformer.h.0.attn"),  # not a linear head
    lambda t: t.update(table="transformer.wpe"),  # shapes differ
    lambda t: t.update(table="__class__"),  # not a module of the model
    lambda t: t.update(scale="yes"),  # wrong type
    lambda t: t.update(extra=1),  # unknown field
])
def test_tampered_tied_head_records_are_refused(tamper, tmp_path, monkeypatch):
    from normfold.errors import CheckpointError

    adapter, ex = _example("gpt2")
    _old_form(monkeypatch)
    conv, report = normfold.convert(build(ex, "GPT2LMHeadModel", torch.float32), verify=False)
    out = normfold.save(conv, report, tmp_path / "out")
    rep = json.loads((out / "normfold.json").read_text())
    tamper(rep["structure"]["tied_heads"][0])
    (out / "normfold.json").write_text(json.dumps(rep))
    with pytest.raises(CheckpointError):
        normfold.load(out)


def test_cli_default_keeps_the_tie_and_untie_writes_the_stock_form(tmp_path, capsys):
    from normfold.cli import main

    adapter, ex = _example("gpt2")
    build(ex, "GPT2LMHeadModel", torch.float32).save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "kept"), "-q"]) == 0
    text = capsys.readouterr().out
    assert "weight bytes" in text and "on disk" in text
    assert "stock transformers: yes (from_pretrained); normfold.load: yes (tied head kept as one tensor)" in text
    rep = json.loads((tmp_path / "kept" / "normfold.json").read_text())
    assert "transformer.wte" in rep["structure"]["recenter_after"] and not rep["structure"]["tied_heads"]
    assert rep["size"]["disk_bytes"]["before"] > 0 and rep["reload"]["stock_transformers"] is True
    assert rep["size"]["weight_bytes"]["after"] <= rep["size"]["weight_bytes"]["before"]
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "untied"), "--untie", "-q"]) == 0
    text = capsys.readouterr().out
    assert "stock transformers: yes" in text
    rep_u = json.loads((tmp_path / "untied" / "normfold.json").read_text())
    assert rep_u["size"]["disk_bytes"]["after"] > rep["size"]["disk_bytes"]["after"]
    assert (tmp_path / "untied" / "model.safetensors").is_file()
    assert main(["convert", str(tmp_path / "src"), "--to", "crmsnorm", "--untie", "--out",
                 str(tmp_path / "x"), "-q"]) == 2
    assert "--untie applies to --to rmsnorm" in capsys.readouterr().err


def test_streamed_cli_keeps_the_tie_and_untie_streams_the_stock_form(tmp_path, capsys):
    from normfold.cli import main

    adapter, ex = _example("gpt2")
    model = build(ex, "GPT2LMHeadModel", torch.float32)
    model.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "kept"), "--stream", "always", "-q"]) == 0
    text = capsys.readouterr().out
    assert "on disk" in text and "stock transformers: yes (from_pretrained); normfold.load: yes (tied head" in text
    rep = json.loads((tmp_path / "kept" / "normfold.json").read_text())
    assert "transformer.wte" in rep["structure"]["recenter_after"] and not rep["structure"]["tied_heads"]
    assert rep["verification"]["passed"]
    assert rep["size"]["disk_bytes"]["after"] < 1.02 * rep["size"]["disk_bytes"]["before"]
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "untied"), "--stream", "always",
                 "--untie", "-q"]) == 0
    capsys.readouterr()
    assert (tmp_path / "untied" / "model.safetensors").is_file()
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    stock = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "untied").eval()
    loaded = normfold.load(tmp_path / "kept")
    with torch.no_grad():
        want = model(ids).logits
        assert rel_err(stock(ids).logits, want) <= 1e-5 and rel_err(loaded(ids).logits, want) <= 1e-5


def test_train_export_keeps_the_tie(tmp_path):
    """normfold.train: θ trained one step through the prepared model, then exported: the tie stays (one table,
    the original-form table, the head the stock Linear reading it) and the checkpoint computes the restored
    LayerNorm model's logits."""
    import copy

    from normfold import train

    adapter, ex = _example("gpt2")
    model = build(ex, "GPT2LMHeadModel", torch.float64)
    prepared = train.prepare(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(prepared.parameters(), lr=0.1)
    prepared(ids, labels=ids).loss.backward()
    opt.step()
    conv, report = train.export(prepared, tmp_path / "out")
    assert report.verification["passed"] and not report.structure.tied_heads
    assert "transformer.wte" in report.structure.recenter_after
    plain = train.restore(copy.deepcopy(prepared)).eval()
    loaded = normfold.load(tmp_path / "out")
    assert type(loaded.lm_head) is nn.Linear and loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(loaded.transformer.wte.weight, plain.transformer.wte.weight)  # the trained table itself
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, plain(ids).logits) <= 1e-9
    _, report_u = train.export(prepared, tmp_path / "untied", untie=True)
    assert report_u.stock_reloadable and not report_u.structure.tied_heads


def test_tied_head_gradients_match_the_untied_product():
    """Fine-tuning a converted model: gradients through TiedHead (input, table, mean) are those of
    z·(E' + μ1ᵀ)ᵀ computed out of place in float64."""
    g = torch.Generator().manual_seed(0)
    table = nn.Embedding(23, 6, dtype=torch.float64)
    mean = torch.randn(23, generator=g, dtype=torch.float64)
    head = TiedHead(table, mean)
    head.mean.requires_grad_(True)
    y = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 23, generator=g, dtype=torch.float64)
    (head(y) * w).sum().backward()
    got = (y.grad.clone(), table.weight.grad.clone(), head.mean.grad.clone())
    y2 = y.detach().clone().requires_grad_(True)
    E = table.weight.detach().clone().requires_grad_(True)
    m = mean.clone().requires_grad_(True)
    ((y2 @ (E + m[:, None]).T) * w).sum().backward()
    for a, b in zip(got, (y2.grad, E.grad, m.grad)):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("family,example,head", [("gpt2", None, "GPT2LMHeadModel"),
                                                 ("whisper", None, "WhisperForConditionalGeneration"),
                                                 ("roberta", None, "RobertaForMaskedLM")])
def test_back_to_layernorm_restores_the_stock_tie_and_crmsnorm_keeps_it(family, example, head, tmp_path):
    """--to layernorm from a tied Pre-RMSNorm model: the table gets its row means back and the head is the
    stock tied Linear again (every reader of the Pre-LN stream ignores the per-token constant), so plain
    transformers reloads it with the original's size. --to crmsnorm from it keeps the tie: the original table
    where the family's entry is registered (compress.crmsnorm.TIE_ENTRY: all three), else the compressed one."""
    adapter, ex = _example(family, example)
    model = build(ex, head, torch.float64)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    rms, _ = normfold.convert(model, verify=False)
    ln, report = normfold.convert(rms, to="layernorm", verify=False)
    (h, t), = _tied_linear_heads(model)
    assert type(ln.get_submodule(h)) is nn.Linear and ln.get_submodule(h).weight is ln.get_submodule(t).weight
    assert report.stock_reloadable and not report.structure.tied_heads and report.structure.untied == []
    assert sum(p.numel() for p in ln.parameters()) == sum(p.numel() for p in model.parameters())
    ref = run_flat(model, inputs)
    got = run_flat(ln, inputs)
    for name in ref:
        if "logits" in name:
            assert rel_err(got[name], ref[name]) <= 1e-9, name
    stock = getattr(transformers, head).from_pretrained(normfold.save(ln, report, tmp_path / "ln")).eval()
    assert stock.get_submodule(h).weight is stock.get_submodule(t).weight
    again = run_flat(stock, inputs)
    for name in ref:
        if "logits" in name:
            assert rel_err(again[name], ref[name]) <= 1e-9, name
    crms, creport = normfold.convert(rms, to="crmsnorm", verify=False)
    if family in TIE_ENTRY:  # the original table, the stream compressed after the summed embeddings
        assert creport.structure.compression["tied_heads"] == [] and type(crms.get_submodule(h)) is nn.Linear
        assert crms.get_submodule(h).weight is crms.get_submodule(t).weight
        assert torch.equal(crms.get_submodule(t).weight, model.get_submodule(t).weight)
    else:  # the compressed table (TiedCompressedHead)
        assert [x["head"] for x in creport.structure.compression["tied_heads"]] == [h]
    for name in ref:
        if "logits" in name:
            assert rel_err(run_flat(crms, inputs)[name], ref[name]) <= 1e-9, name


def test_tied_head_record_beside_stock_weights_is_refused(tmp_path):
    from normfold.errors import CheckpointError

    adapter, ex = _example("gpt2")
    model = build(ex, "GPT2LMHeadModel", torch.float32)
    conv, report = normfold.convert(model, verify=False, untie=True)
    out = normfold.save(conv, report, tmp_path / "out")
    rep = json.loads((out / "normfold.json").read_text())
    rep["structure"]["tied_heads"] = [{"head": "lm_head", "table": "transformer.wte", "scale": False, "bias": False}]
    (out / "normfold.json").write_text(json.dumps(rep))
    with pytest.raises(CheckpointError, match="tied heads"):
        normfold.load(out)


def test_fast_path_still_fuses_the_blocks_of_a_tied_model(tmp_path):
    """normfold.load's fast path on the default tied form: every block fused with its hand-off, no TiedHead to
    pack (the head is the stock Linear), and the logits those of fast=False to float32 rounding."""
    from normfold import fastpath

    adapter, ex = _example("gpt2")
    model = build(ex, "GPT2LMHeadModel", torch.float32)
    conv, report = normfold.convert(model, verify=False)
    out = normfold.save(conv, report, tmp_path / "out")
    fast, plain = normfold.load(out), normfold.load(out, fast=False)
    stats = fastpath.refresh(fast)
    assert stats["fused_blocks"] == stats["handoffs"] == model.config.n_layer and stats["packed_tied_heads"] == 0
    assert type(fast.lm_head) is nn.Linear and fast.lm_head.weight is fast.transformer.wte.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(fast(ids).logits, plain(ids).logits) <= 1e-5
