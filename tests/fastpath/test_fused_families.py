"""Fused residual add + norm inside the sequential-residual blocks of every family normfold.fastpath covers
beyond GPT-2 / ViT (issue 24 item 2): GPT-Neo, OPT (Pre-LN), BLOOM, GPT-NeoX (sequential), Falcon
(sequential, RW style), GPT-BigCode, DeiT, DINOv2, CLIP / SigLIP / SigLIP2 (both towers), Whisper and
mBART (encoder and decoder).

Per family, a tiny model built in code, converted (rmsnorm and crmsnorm where normfold converts it),
saved, and reloaded fast and with fast=False: float64 outputs <= 1e-12 apart and <= 1e-9 from the
original; the blocks are fused and each fused norm is called with the residual (2 arguments) on a
float32 input wide enough for the fused kernel; decoders generate the same greedy tokens as the
fast=False model and the original; torch.export of the fast model matches it. Configurations the
patch does not cover (Post-LN OPT) stay on transformers' code."""

from __future__ import annotations

import pytest
import torch

import normfold
from helpers import realistic, run_flat
from normfold import fastpath
from normfold.nn.norms import LN_ROUTE_MAX_NUMEL

transformers = pytest.importorskip("transformers")

D = 128  # hidden width: 2 x 72 tokens x 128 > LN_ROUTE_MAX_NUMEL, so the fused kernel runs in float32
SEQ = 72


def _ids(vocab, batch=2, seq=SEQ):
    return lambda: {"input_ids": torch.randint(4, vocab, (batch, seq))}


def _pixels(batch=3, size=32):
    return lambda: {"pixel_values": torch.randn(batch, 3, size, size)}


def _gpt_neo(**kw):
    cfg = transformers.GPTNeoConfig(vocab_size=101, max_position_embeddings=96, hidden_size=D, num_layers=2,
                                    num_heads=4, attention_types=[[["global", "local"], 1]], window_size=16,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw)
    return transformers.GPTNeoForCausalLM(cfg), _ids(101)


def _opt(**kw):
    cfg = transformers.OPTConfig(vocab_size=97, max_position_embeddings=96, hidden_size=D, num_hidden_layers=2,
                                 num_attention_heads=4, ffn_dim=2 * D, word_embed_proj_dim=D, bos_token_id=2,
                                 eos_token_id=2, pad_token_id=1, **kw)
    return transformers.OPTForCausalLM(cfg), _ids(97)


def _bloom(**kw):
    cfg = transformers.BloomConfig(vocab_size=101, hidden_size=D, n_layer=2, n_head=4, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=3, **kw)
    return transformers.BloomForCausalLM(cfg), _ids(101)


def _gpt_neox(parallel=False, **kw):
    cfg = transformers.GPTNeoXConfig(vocab_size=107, max_position_embeddings=96, hidden_size=D, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=2 * D, use_parallel_residual=parallel,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw)
    return transformers.GPTNeoXForCausalLM(cfg), _ids(107)


def _falcon(parallel=False, **kw):
    cfg = transformers.FalconConfig(vocab_size=127, max_position_embeddings=96, hidden_size=D, num_hidden_layers=2,
                                    num_attention_heads=4, multi_query=parallel, parallel_attn=parallel,
                                    alibi=not parallel, bias=True, bos_token_id=1, eos_token_id=2, pad_token_id=3, **kw)
    return transformers.FalconForCausalLM(cfg), _ids(127)


def _deit(**kw):
    cfg = transformers.DeiTConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * D,
                                  image_size=32, patch_size=4, num_labels=3, **kw)
    return transformers.DeiTForImageClassification(cfg), _pixels()


def _dinov2(**kw):
    cfg = transformers.Dinov2Config(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
                                    image_size=32, patch_size=4, num_labels=3, layerscale_value=0.7,
                                    **{"drop_path_rate": 0.1, **kw})
    return transformers.Dinov2ForImageClassification(cfg), _pixels()


def _clip(**kw):
    text = dict(vocab_size=99, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=98, pad_token_id=1)
    vision = dict(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=4)
    text.update(kw)
    vision.update(kw)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=20)
    ids, px = _ids(98), _pixels()
    return transformers.CLIPModel(cfg), lambda: {**ids(), **px()}


def _whisper(**kw):
    cfg = transformers.WhisperConfig(vocab_size=99, num_mel_bins=8, max_source_positions=80, max_target_positions=96,
                                     d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
                                     begin_suppress_tokens=None, **kw)
    ids = _ids(99)
    return transformers.WhisperForConditionalGeneration(cfg), \
        lambda: {"input_features": torch.randn(2, 8, 160), "decoder_input_ids": ids()["input_ids"]}


def _gpt_bigcode(**kw):
    cfg = transformers.GPTBigCodeConfig(vocab_size=109, n_positions=96, n_embd=D, n_layer=2, n_head=4, multi_query=True,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw)
    return transformers.GPTBigCodeForCausalLM(cfg), _ids(109)


def _mbart(**kw):
    cfg = transformers.MBartConfig(vocab_size=99, max_position_embeddings=96, d_model=D, encoder_layers=2,
                                   decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                   encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D, pad_token_id=1, bos_token_id=0,
                                   eos_token_id=2, decoder_start_token_id=2, scale_embedding=True, **kw)
    ids = _ids(99)
    return transformers.MBartForConditionalGeneration(cfg), \
        lambda: {"input_ids": ids()["input_ids"], "decoder_input_ids": ids()["input_ids"]}


_TEXT = dict(vocab_size=99, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=98, pad_token_id=1)


def _siglip(**kw):
    vision = dict(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=4, **kw)
    cfg = transformers.SiglipConfig(text_config=dict(_TEXT, **kw), vision_config=vision)
    ids, px = _ids(98), _pixels()
    return transformers.SiglipModel(cfg), lambda: {**ids(), **px()}


def _siglip2(**kw):
    vision = dict(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4, num_patches=64,
                  patch_size=4, **kw)
    cfg = transformers.Siglip2Config(text_config=dict(_TEXT, **kw), vision_config=vision)
    ids = _ids(98)
    return transformers.Siglip2Model(cfg), lambda: {
        **ids(), "pixel_values": torch.randn(3, 64, 3 * 4 * 4),
        "pixel_attention_mask": torch.ones(3, 64, dtype=torch.long), "spatial_shapes": torch.tensor([[8, 8]] * 3)}


def _whisper_causal(**kw):
    model, make = _whisper(**kw)
    ids = _ids(99)
    return transformers.WhisperForCausalLM(model.config), ids


# family -> (builder, conversions normfold supports for it, {block class: norms called with the residual})
FAMILIES = {
    "gpt_neo": (_gpt_neo, ("rmsnorm", "crmsnorm"), {"GPTNeoBlock": ("ln_2",)}),
    "opt": (_opt, ("rmsnorm", "crmsnorm"), {"OPTDecoderLayer": ("final_layer_norm",)}),
    "bloom": (_bloom, ("rmsnorm", "crmsnorm"), {"BloomBlock": ("post_attention_layernorm",)}),
    # pretraining_tp > 1 with slow_but_exact: the attention's sliced dense, then the same residual hand-off
    # (crmsnorm is refused by design for it: the accumulator is d wide)
    "bloom_tp2": (lambda **kw: _bloom(pretraining_tp=2, slow_but_exact=True, **kw), ("rmsnorm",),
                  {"BloomBlock": ("post_attention_layernorm",)}),
    "gpt_neox": (_gpt_neox, ("rmsnorm", "crmsnorm"), {"GPTNeoXLayer": ("post_attention_layernorm",)}),
    "falcon": (_falcon, ("rmsnorm", "crmsnorm"), {"FalconDecoderLayer": ("post_attention_layernorm",)}),
    "deit": (_deit, ("rmsnorm", "crmsnorm"), {"DeiTLayer": ("layernorm_after",)}),
    # no DINOv2 adapter: the derived plan converts to rmsnorm; crmsnorm is refused (see families/dinov2.py)
    "dinov2": (_dinov2, ("rmsnorm",), {"Dinov2Layer": ("norm2",)}),
    "clip": (_clip, ("rmsnorm", "crmsnorm"), {"CLIPEncoderLayer": ("layer_norm2",)}),
    "whisper": (_whisper, ("rmsnorm", "crmsnorm"),
                {"WhisperEncoderLayer": ("final_layer_norm",),
                 "WhisperDecoderLayer": ("encoder_attn_layer_norm", "final_layer_norm")}),
    "gpt_bigcode": (_gpt_bigcode, ("rmsnorm", "crmsnorm"), {"GPTBigCodeBlock": ("ln_2",)}),
    "mbart": (_mbart, ("rmsnorm", "crmsnorm"),
              {"MBartEncoderLayer": ("final_layer_norm",),
               "MBartDecoderLayer": ("encoder_attn_layer_norm", "final_layer_norm")}),
    "siglip": (_siglip, ("rmsnorm", "crmsnorm"), {"SiglipEncoderLayer": ("layer_norm2",)}),
    "siglip2": (_siglip2, ("rmsnorm", "crmsnorm"), {"Siglip2EncoderLayer": ("layer_norm2",)}),
    # the decoder without encoder states: self-attention's add fused with final_layer_norm
    "whisper_causal": (_whisper_causal, ("rmsnorm", "crmsnorm"), {"WhisperDecoderLayer": ("final_layer_norm",)}),
}
DECODERS = ["gpt_neo", "opt", "bloom", "bloom_tp2", "gpt_neox", "falcon", "whisper", "gpt_bigcode", "mbart",
            "whisper_causal"]
# each family's dropout (and drop-path) probabilities, for the training-mode check
DROPOUT = {
    "gpt_neo": dict(resid_dropout=0.2, embed_dropout=0.1, attention_dropout=0.1),
    "opt": dict(dropout=0.2, attention_dropout=0.1),
    "bloom": dict(hidden_dropout=0.2, attention_dropout=0.1),
    "bloom_tp2": dict(hidden_dropout=0.2, attention_dropout=0.1),
    "gpt_neox": dict(hidden_dropout=0.2, attention_dropout=0.1),
    "falcon": dict(hidden_dropout=0.2, attention_dropout=0.1),
    "deit": dict(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.1),
    "dinov2": dict(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.1, drop_path_rate=0.3),
    "clip": dict(attention_dropout=0.2),
    "whisper": dict(dropout=0.2, attention_dropout=0.1, activation_dropout=0.1),
    "whisper_causal": dict(dropout=0.2, attention_dropout=0.1, activation_dropout=0.1),
    "gpt_bigcode": dict(resid_pdrop=0.2, embd_pdrop=0.1, attn_pdrop=0.1),
    "mbart": dict(dropout=0.2, attention_dropout=0.1, activation_dropout=0.1),
    "siglip": dict(attention_dropout=0.2),
    "siglip2": dict(attention_dropout=0.2),
}
CASES = [(f, to) for f, (_, tos, _) in FAMILIES.items() for to in tos]


def test_every_registered_block_has_a_case():
    """The blocks come from the family registry (normfold.adapters.families, `Family.fused`): a family whose
    fused block has no case here fails until one is added."""
    covered = {name for _, _, names in FAMILIES.values() for name in names}
    # GPT-2 and ViT: tests/test_fastpath.py; GPT-J and Phi (hand-off only): tests/test_fastpath_handoff.py
    covered |= {"GPT2Block", "ViTLayer", "GPTJBlock", "PhiDecoderLayer"}
    assert set(fastpath.FUSED_BLOCKS) <= covered, sorted(set(fastpath.FUSED_BLOCKS) - covered)


def _inputs(make, dtype):
    torch.manual_seed(1)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in make().items()}


def _out(family, out):
    return out.logits_per_image if family in ("clip", "siglip", "siglip2") else out.logits


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _build(family, dtype, builder=None, **kw):
    torch.manual_seed(0)
    model, make = (builder or FAMILIES[family][0])(**kw)
    return realistic(model.eval()).to(dtype), make


def _saved(tmp_path, model, to):
    conv, report = normfold.convert(model, to=to, verify=False)
    normfold.save(conv, report, tmp_path / to)
    return normfold.load(tmp_path / to), normfold.load(tmp_path / to, fast=False)


def _blocks(model, names):
    return [m for m in model.modules() if type(m).__name__ in names]


@pytest.mark.parametrize("family,to", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_fused_exact_in_float64(tmp_path, family, to):
    names = FAMILIES[family][2]
    model, make = _build(family, torch.float64)
    fast, plain = _saved(tmp_path, model, to)
    blocks = _blocks(fast, names)
    assert len(blocks) >= 2 and all(fastpath.is_fused(m) for m in blocks)
    assert not any(fastpath.is_fused(m) for m in plain.modules())
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        got, ref, orig = (_out(family, m(**x)) for m in (fast, plain, model))
    assert _rel(got, ref) <= 1e-12
    assert _rel(got, orig) <= 1e-9
    every, every_ref = run_flat(fast, x), run_flat(plain, x)  # hidden states (the stream) included
    assert every.keys() == every_ref.keys() and any("hidden_states" in k for k in every)
    for k in every:
        assert _rel(every[k], every_ref[k]) <= 1e-12, k
    for m in blocks:  # unfused again: transformers' code, the same outputs
        assert fastpath.unfuse_block(m)
    with torch.no_grad():
        assert _rel(_out(family, fast(**x)), ref) <= 1e-12


@pytest.mark.parametrize("family,to", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_fused_kernel_path_float32(tmp_path, family, to):
    names = FAMILIES[family][2]
    model, make = _build(family, torch.float32)
    fast, plain = _saved(tmp_path, model, to)
    seen, hooked = {}, 0
    for name, block in ((n, b) for n, b in fast.named_modules() if type(b).__name__ in names):
        assert fastpath.is_fused(block), name
        for attr in names[type(block).__name__]:
            norm = getattr(block, attr)
            assert fastpath.fusable(norm), (name, attr, type(norm))
            key = f"{name}.{attr}"
            norm.register_forward_hook(lambda mod, args, out, key=key: seen.setdefault(key, []).append(
                (len(args), args[0].numel())))
            hooked += 1
    x = _inputs(make, torch.float32)
    with torch.no_grad():
        got, ref, orig = (_out(family, m(**x)) for m in (fast, plain, model))
    assert len(seen) == hooked >= 2
    for key, calls in seen.items():  # every fused norm got the residual, on inputs above the LayerNorm route
        assert calls and all(n == 2 and numel > LN_ROUTE_MAX_NUMEL for n, numel in calls), (key, calls)
    assert _rel(got, ref) <= 1e-5 and _rel(got, orig) <= 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_training_mode_dropout_and_gradients(tmp_path, family):
    """model.train() with every dropout on: the fused forward draws the same masks in the same order
    (same seed, same outputs) and gives the same gradients as transformers' code."""
    model, make = _build(family, torch.float64, **DROPOUT[family])
    fast, plain = _saved(tmp_path, model, FAMILIES[family][1][-1])
    assert any(fastpath.is_fused(m) for m in fast.modules())
    x = _inputs(make, torch.float64)
    outs = []
    for m in (fast, plain):
        m.train()
        torch.manual_seed(7)
        out = _out(family, m(**x))
        out.square().mean().backward()
        outs.append(out.detach())
    assert _rel(outs[0], outs[1]) <= 1e-12
    assert _rel(outs[0], _out(family, plain.eval()(**x)).detach()) > 1e-3  # dropout did act
    grads = dict(fast.named_parameters())
    n = 0
    for name, p in plain.named_parameters():
        if p.grad is not None:
            n += 1
            assert torch.allclose(grads[name].grad, p.grad, rtol=1e-10, atol=1e-12), name
    assert n > 0


def _generate(model, family, x, **kw):
    kw = {"max_new_tokens": 6, "do_sample": False, **kw}
    if family == "whisper":
        return model.generate(input_features=x["input_features"], decoder_input_ids=x["decoder_input_ids"], **kw)
    return model.generate(x["input_ids"], attention_mask=torch.ones_like(x["input_ids"]), **kw)


@pytest.mark.parametrize("family", DECODERS)
def test_fused_generate_tokens_unchanged(tmp_path, family):
    """Greedy, float32, the whole batch (2 x 72 tokens: the prefill runs the fused kernel, decode steps
    the norms' small-input route)."""
    model, make = _build(family, torch.float32)
    to = FAMILIES[family][1][-1]
    fast, plain = _saved(tmp_path, model, to)
    assert any(fastpath.is_fused(m) for m in fast.modules())
    x = _inputs(make, torch.float32)
    pad = model.config.pad_token_id
    with torch.no_grad():
        got = _generate(fast, family, x, pad_token_id=pad)
        assert torch.equal(got, _generate(plain, family, x, pad_token_id=pad))
        assert torch.equal(got, _generate(model, family, x, pad_token_id=pad))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_model_exports(tmp_path, family):
    model, make = _build(family, torch.float32)
    to = FAMILIES[family][1][-1]
    fast, _ = _saved(tmp_path, model, to)
    x = _inputs(make, torch.float32)
    kw = {**x, **({"use_cache": False} if family in DECODERS else {})}
    with torch.no_grad():
        want = _out(family, fast(**kw))
        ep = torch.export.export(fast, (), kw)
        assert _rel(_out(family, ep.module()(**kw)), want) <= 1e-5  # the reference formula vs the kernel


# (parallel-residual GPT-NeoX and Falcon are fused since the cross-block hand-off: tests/test_fastpath_handoff.py)
@pytest.mark.parametrize("builder", [lambda: _opt(do_layer_norm_before=False)], ids=["opt-post-ln"])
def test_uncovered_configurations_keep_transformers_code(tmp_path, builder):
    torch.manual_seed(0)
    model, make = builder()
    model = realistic(model.eval()).double()
    fast, plain = _saved(tmp_path, model, "rmsnorm")
    assert not any(fastpath.is_fused(m) for m in fast.modules())
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        assert _rel(fast(**x).logits, plain(**x).logits) <= 1e-12


@pytest.mark.parametrize("family", list(FAMILIES))
def test_norm_replaced_after_fusing_runs_transformers_code(tmp_path, family):
    """A fused block whose norm is no longer a normfold stream norm (replaced after fusing) falls back to
    transformers' forward: the same outputs as the fast=False model given the same replacement."""
    names = FAMILIES[family][2]
    model, make = _build(family, torch.float64)
    fast, plain = _saved(tmp_path, model, "rmsnorm")
    plain_mods = dict(plain.named_modules())
    n = 0
    for name, block in [(n, b) for n, b in fast.named_modules() if type(b).__name__ in names]:
        assert fastpath.is_fused(block)
        for attr in names[type(block).__name__]:
            torch.manual_seed(n)
            ln = torch.nn.LayerNorm(getattr(block, attr).normalized_shape, dtype=torch.float64)
            torch.nn.init.normal_(ln.weight)
            setattr(block, attr, ln)
            setattr(plain_mods[name], attr, ln)
            n += 1
    assert n >= 2
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        assert _rel(_out(family, fast(**x)), _out(family, plain(**x))) <= 1e-12


# the reverse conversion needs an adapter: DINOv2 (derived plan) has none
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "dinov2"])
def test_reverse_conversion_unfuses(tmp_path, family):
    """convert(fast model, to='layernorm') refreshes the fast paths: no block stays fused (its norms are
    LayerNorms again), and the stock Pre-LN model computes the original function."""
    names = FAMILIES[family][2]
    model, make = _build(family, torch.float64)
    fast, _ = _saved(tmp_path, model, FAMILIES[family][1][-1])
    back, _ = normfold.convert(fast, to="layernorm", verify=False)
    assert _blocks(back, names) and not any(fastpath.is_fused(m) for m in back.modules())
    x = _inputs(make, torch.float64)
    with torch.no_grad():
        assert _rel(_out(family, back(**x)), _out(family, model(**x))) <= 1e-9


def test_bloom_compiles_fullgraph(tmp_path):
    """BLOOM's fused block hands BloomAttention an additive-identity object, which dynamo cannot trace: under
    torch.compile the block runs transformers' code (one graph, the same function)."""
    model, make = _build("bloom", torch.float32)
    fast, _ = _saved(tmp_path, model, "crmsnorm")
    x = {**_inputs(make, torch.float32), "use_cache": False}
    with torch.no_grad():
        want = fast(**x).logits
        assert _rel(torch.compile(fast, fullgraph=True)(**x).logits, want) <= 1e-5
