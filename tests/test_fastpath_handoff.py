"""Cross-block hand-off (normfold.fastpath.handoff, issue 24 item 2): a block's last add runs the next norm's
fused op and the next norm returns the stashed result when called with exactly that tensor.

Per family (GPT-2, ViT, GPT-J, Phi, GPT-NeoX parallel, Falcon parallel_attn and new decoder architecture),
a tiny model built in code, converted (rmsnorm, crmsnorm), saved, reloaded fast and with fast=False:
float64 <= 1e-12 apart (hidden states included) and <= 1e-9 from the original; float32 inputs wide enough
for the fused kernel use every link's stash (counted); greedy generate() unchanged; the fall-backs
(in-place change by a hook or by hand, another tensor, gradients, inference_mode with hooks) give the
plain result; deepcopy / state_dict / save are unaffected; torch.export works; strip removes it all."""

from __future__ import annotations

import copy

import pytest
import torch

import normfold
from helpers import realistic, run_flat
from normfold import fastpath
from normfold.fastpath import handoff

transformers = pytest.importorskip("transformers")

D, SEQ, LAYERS = 128, 72, 3  # 2 x 72 x 128 > LN_ROUTE_MAX_NUMEL: the fused kernel runs in float32


def _ids(vocab):
    return lambda: {"input_ids": torch.randint(4, vocab, (2, SEQ))}


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=D, n_layer=LAYERS, n_head=4, vocab_size=101, n_positions=96,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), _ids(101), lambda m: m.transformer


def _vit():
    cfg = transformers.ViTConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4,
                                 intermediate_size=2 * D, image_size=32, patch_size=4, num_labels=5)
    return transformers.ViTForImageClassification(cfg), lambda: {"pixel_values": torch.randn(3, 3, 32, 32)}, \
        lambda m: m.vit


def _gptj():
    cfg = transformers.GPTJConfig(vocab_size=103, n_positions=96, n_embd=D, n_layer=LAYERS, n_head=4, rotary_dim=16,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPTJForCausalLM(cfg), _ids(103), lambda m: m.transformer


def _phi():
    cfg = transformers.PhiConfig(vocab_size=107, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=LAYERS,
                                 num_attention_heads=4, max_position_embeddings=96, bos_token_id=0, eos_token_id=0,
                                 pad_token_id=0)
    return transformers.PhiForCausalLM(cfg), _ids(107), lambda m: m.model


def _gpt_neox():
    cfg = transformers.GPTNeoXConfig(vocab_size=107, max_position_embeddings=96, hidden_size=D,
                                     num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=2 * D,
                                     use_parallel_residual=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPTNeoXForCausalLM(cfg), _ids(107), lambda m: m.gpt_neox


def _falcon(**kw):
    cfg = transformers.FalconConfig(vocab_size=127, max_position_embeddings=96, hidden_size=D,
                                    num_hidden_layers=LAYERS, num_attention_heads=4, bias=True, bos_token_id=1,
                                    eos_token_id=2, pad_token_id=3, **kw)
    return transformers.FalconForCausalLM(cfg), _ids(127), lambda m: m.transformer


def _deit():
    cfg = transformers.DeiTConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4,
                                  intermediate_size=2 * D, image_size=32, patch_size=4, num_labels=5)
    return transformers.DeiTForImageClassification(cfg), lambda: {"pixel_values": torch.randn(3, 3, 32, 32)}, \
        lambda m: m.deit


FAMILIES = {
    "gpt2": _gpt2,
    "vit": _vit,
    "deit": _deit,
    "gptj": _gptj,
    "phi": _phi,
    "gpt_neox_parallel": _gpt_neox,
    "falcon_parallel": lambda: _falcon(parallel_attn=True, multi_query=True, alibi=False),
    "falcon_new_arch": lambda: _falcon(new_decoder_architecture=True, parallel_attn=True, num_kv_heads=2,
                                       alibi=False),
}
DECODERS = [f for f in FAMILIES if f not in ("vit", "deit")]
_FINAL = {"gpt2": "ln_f", "vit": "layernorm", "deit": "layernorm", "gptj": "ln_f", "phi": "final_layernorm",
          "gpt_neox_parallel": "final_layer_norm", "falcon_parallel": "ln_f", "falcon_new_arch": "ln_f"}
CASES = [(f, to) for f in FAMILIES for to in ("rmsnorm", "crmsnorm")]
IDS = [f"{f}-{t}" for f, t in CASES]


def _build(family, dtype):
    torch.manual_seed(0)
    model, make, base = FAMILIES[family]()
    return realistic(model.eval()).to(dtype), make, base


def _saved(tmp_path, model, to):
    try:
        conv, report = normfold.convert(model, to=to, verify=False)
    except Exception as e:  # noqa: BLE001  (a conversion normfold refuses for this family)
        pytest.skip(f"{to} not available: {e}")
    normfold.save(conv, report, tmp_path / to)
    return normfold.load(tmp_path / to), normfold.load(tmp_path / to, fast=False), report


def _inputs(make, dtype):
    torch.manual_seed(1)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in make().items()}


def _out(model, x):
    return model(**x).logits


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _layers(base):
    return base.h if hasattr(base, "h") else base.layers


@pytest.mark.parametrize("family,to", CASES, ids=IDS)
def test_handoff_exact_in_float64(tmp_path, family, to):
    model, make, base = _build(family, torch.float64)
    fast, plain, _ = _saved(tmp_path, model, to)
    layers = list(_layers(base(fast)))
    # block i links to block i+1's first norm, the last block to the final norm, where that norm reads the
    # stash: an RMSNorm / CRMSNorm, not a StreamCRMSNorm that decompresses the Pre-CRMS stream back to d
    # (GPT-J / Phi Pre-CRMS: every norm decompresses, nothing is linked, the blocks add plainly)
    targets = [getattr(b, handoff._entry(b)) for b in layers[1:]] + [getattr(base(fast), _FINAL[family])]
    expected = sum(handoff._target(n) for n in targets)
    assert [handoff.is_linked(b) for b in layers] == [handoff._target(n) for n in targets]
    assert to == "crmsnorm" or expected == LAYERS
    assert handoff.stats(plain)["links"] == 0
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        got, ref, orig = _out(fast, x), _out(plain, x), _out(model, x)
    st = handoff.stats(fast)
    assert st["hits"] == st["links"] == expected and st["misses"] == 0
    assert _rel(got, ref) <= 1e-12
    assert _rel(got, orig) <= 1e-9
    every, every_ref = run_flat(fast, x), run_flat(plain, x)  # the hidden states (the sums s) included
    assert every.keys() == every_ref.keys()
    for k in every:
        assert _rel(every[k], every_ref[k]) <= 1e-12, k


@pytest.mark.parametrize("family,to", CASES, ids=IDS)
def test_handoff_kernel_path_float32(tmp_path, family, to, monkeypatch):
    monkeypatch.setattr(handoff, "FLOAT32_MIN_NUMEL", 0)  # these inputs are small: hand off anyway
    model, make, _ = _build(family, torch.float32)
    fast, plain, _ = _saved(tmp_path, model, to)
    x = _inputs(make, torch.float32)
    with torch.no_grad():
        got, ref, orig = _out(fast, x), _out(plain, x), _out(model, x)
    st = handoff.stats(fast)
    assert st["hits"] == st["links"] and st["misses"] == 0  # every stash was used
    assert to == "crmsnorm" or st["links"] == LAYERS
    assert _rel(got, ref) <= 1e-5 and _rel(got, orig) <= 1e-4
    with torch.inference_mode():  # inference tensors (no version counter): plain by default
        assert _rel(_out(fast, x), ref) <= 1e-5
    assert handoff.stats(fast)["hits"] == st["hits"]
    monkeypatch.setattr(handoff, "INFERENCE_TENSORS", True)  # opted in: handed off while no hook is set
    with torch.inference_mode():
        assert _rel(_out(fast, x), ref) <= 1e-5
    assert handoff.stats(fast)["hits"] == 2 * st["hits"]


@pytest.mark.parametrize("family", DECODERS)
def test_handoff_generate_tokens_unchanged(tmp_path, family, monkeypatch):
    monkeypatch.setattr(handoff, "FLOAT32_MIN_NUMEL", 0)
    model, make, _ = _build(family, torch.float32)
    fast, plain, _ = _saved(tmp_path, model, "rmsnorm" if family in ("gptj", "phi") else "crmsnorm")
    ids = _inputs(make, torch.float32)["input_ids"]
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": model.config.pad_token_id}
    with torch.no_grad():
        want = plain.generate(ids, **kw)
        assert torch.equal(fast.generate(ids, **kw), want)
        assert torch.equal(model.generate(ids, **kw), want)
    assert handoff.stats(fast)["hits"] >= LAYERS - 1  # the prefill handed off; decode steps stay plain


def _first_block(fast, family):
    return _layers(FAMILIES[family]()[2](fast))[0]


def _scale_in_place(mod, args, out):
    (out[0] if isinstance(out, tuple) else out).mul_(1.5)  # returns None: the same tensor, changed in place


@pytest.mark.parametrize("family", ["gpt2", "falcon_parallel", "phi"])
def test_in_place_change_by_a_hook_falls_back(tmp_path, family, monkeypatch):
    monkeypatch.setattr(handoff, "INFERENCE_TENSORS", True)  # the opt-in's hook guard is checked below
    model, make, base = _build(family, torch.float64)
    fast, plain, _ = _saved(tmp_path, model, "rmsnorm")
    for m in (fast, plain):
        _layers(base(m))[0].register_forward_hook(_scale_in_place)
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        got, ref = _out(fast, x), _out(plain, x)
    st = handoff.stats(fast)
    assert st["misses"] == 1 and st["hits"] == st["links"] - 1  # the stale stash was not used
    assert _rel(got, ref) <= 1e-12
    with torch.inference_mode():  # no version counter: the hook on the block means no stash at all
        assert _rel(_out(fast, x), ref) <= 1e-12
    assert handoff.stats(fast)["misses"] == 1


def test_other_tensor_and_in_place_change_by_hand(tmp_path, monkeypatch):
    monkeypatch.setattr(handoff, "FLOAT32_MIN_NUMEL", 0)
    model, make, _ = _build("gpt2", torch.float32)
    fast, plain, _ = _saved(tmp_path, model, "rmsnorm")
    b0, b1 = fast.transformer.h[0], fast.transformer.h[1]
    norm, plain_norm = b1.ln_1, plain.transformer.h[1].ln_1
    torch.manual_seed(2)
    x, other = torch.randn(2, SEQ, D), torch.randn(2, SEQ, D)
    with torch.no_grad():
        s = b0(x)
        assert torch.equal(norm(other), plain_norm(other))  # another tensor: recomputed, the stash dropped
        assert torch.equal(norm(s), plain_norm(s))
        s = b0(x)
        s.add_(0.25)  # in place: the version counter moved
        assert torch.equal(norm(s), plain_norm(s))
        s = b0(x)
        want = plain_norm(s)
        assert torch.equal(b0(x), s)  # the block's sum is the unfused sum, bit for bit
    assert handoff.stats(fast)["misses"] == 2 and handoff.stats(fast)["hits"] == 0  # a new stash replaces one
    with torch.no_grad():
        s = b0(x)
        got = norm(s)
    assert handoff.stats(fast)["hits"] == 1 and _rel(got, want) <= 1e-5


def test_gradients_take_the_plain_path(tmp_path):
    """With a gradient needed the block adds plainly (a gradient w.r.t. the hidden states must include the
    norm's path): no stash, the same gradients as the fast=False model."""
    model, make, _ = _build("gpt2", torch.float64)
    fast, plain, _ = _saved(tmp_path, model, "rmsnorm")
    x = _inputs(make, torch.float64)
    grads = []
    for m in (fast, plain):
        out = m(**x, output_hidden_states=True)
        h = out.hidden_states[1]
        (g,) = torch.autograd.grad(out.logits.square().mean(), h)
        grads.append(g)
    assert handoff.stats(fast)["hits"] == 0 and handoff.stats(fast)["misses"] == 0
    assert _rel(grads[0], grads[1]) <= 1e-12


def test_deepcopy_state_dict_and_save_unaffected(tmp_path):
    model, make, _ = _build("gpt2", torch.float64)
    fast, plain, report = _saved(tmp_path, model, "rmsnorm")
    assert list(fast.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in fast.named_modules()] == [n for n, _ in plain.named_modules()]
    twin = copy.deepcopy(fast)
    h = twin.transformer.h
    assert handoff.target(h[0]) is h[1].ln_1 and handoff.target(h[-1]) is twin.transformer.ln_f
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        ref = _out(plain, x)
        assert _rel(_out(twin, x), ref) <= 1e-12
    assert handoff.stats(twin)["hits"] == LAYERS and handoff.stats(fast)["hits"] == 0
    normfold.save(fast, report, tmp_path / "again")
    a = normfold.load(tmp_path / "rmsnorm", fast=False).state_dict()
    b = normfold.load(tmp_path / "again", fast=False).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fastpath.strip(fast)
    assert handoff.stats(fast)["links"] == 0
    assert not any(handoff._STASH in m.__dict__ or handoff._LINK in m.__dict__ for m in fast.modules())
    with torch.no_grad():
        assert _rel(_out(fast, x), ref) <= 1e-12


@pytest.mark.parametrize("family", ["gpt2", "falcon_new_arch"])
def test_fast_model_exports(tmp_path, family, monkeypatch):
    monkeypatch.setattr(handoff, "FLOAT32_MIN_NUMEL", 0)
    model, make, _ = _build(family, torch.float32)
    fast, _, _ = _saved(tmp_path, model, "crmsnorm")
    x = {**_inputs(make, torch.float32), "use_cache": False}
    with torch.no_grad():
        want = _out(fast, x)
        hits = handoff.stats(fast)["hits"]
        ep = torch.export.export(fast, (), x)
        assert handoff.stats(fast)["hits"] == hits  # no stash while tracing
        assert _rel(ep.module()(**x).logits, want) <= 1e-5


def test_norm_replaced_after_linking(tmp_path):
    """A norm swapped for another module after apply: the block looks its target up on each call, finds no
    stash on the new module and adds plainly (no wasted fused op), and the result is the plain one."""
    model, make, _ = _build("gpt2", torch.float64)
    fast, plain, _ = _saved(tmp_path, model, "rmsnorm")
    for m in (plain, fast):
        torch.manual_seed(3)
        ln = torch.nn.LayerNorm(D, dtype=torch.float64)  # the last one is fast's
        torch.nn.init.normal_(ln.weight)
        m.transformer.h[1].ln_1 = ln
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        assert _rel(_out(fast, x), _out(plain, x)) <= 1e-12
    st = handoff.stats(fast)
    assert st["hits"] == LAYERS - 1 and st["misses"] == 0 and handoff.target(fast.transformer.h[0]) is ln


def test_small_float32_sums_add_plainly(tmp_path):
    """Below FLOAT32_MIN_NUMEL a float32 block adds plainly (a speed choice): no stash, the plain result."""
    model, make, _ = _build("gpt2", torch.float32)
    fast, plain, _ = _saved(tmp_path, model, "rmsnorm")
    x = _inputs(make, torch.float32)
    assert x["input_ids"].numel() * D < handoff.FLOAT32_MIN_NUMEL
    with torch.no_grad():
        got, ref = _out(fast, x), _out(plain, x)
    assert handoff.stats(fast)["hits"] == 0 and handoff.stats(fast)["misses"] == 0
    assert _rel(got, ref) <= 1e-5
