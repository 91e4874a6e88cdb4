"""The Pre-CRMSNorm runtime against brute force, generation with a KV cache, and the bundled model
through the command line (convert --to crmsnorm / --pad → normfold.load → same greedy tokens; the
parameter count shrinks by exactly the expected amount; verify; --to layernorm → stock transformers)."""

import json

import pytest
import torch
from torch import nn

import normfold
from helpers import realistic
from normfold.adapters import list_adapters
from normfold.compress import StreamCRMSNorm, TiedCompressedHead
from normfold.io import default_model_path

pytest.importorskip("transformers")
MODEL = default_model_path()


def _rms(x, eps):  # brute force on the full zero-mean vector
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("decompress", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_stream_crmsnorm_matches_rmsnorm_of_the_full_vector(decompress, pad):
    g = torch.Generator().manual_seed(0)
    d = 12
    full = torch.randn(3, 5, d, generator=g, dtype=torch.float64)
    full = full - full.mean(-1, keepdim=True)
    x = torch.cat([full[..., :-1], torch.zeros_like(full[..., -1:])], -1) if pad else full[..., :-1]
    affine = decompress
    norm = StreamCRMSNorm(d, eps=1e-5, weight=affine, bias=affine, decompress=decompress, pad=pad, dtype=torch.float64)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(d, generator=g))
            norm.bias.copy_(torch.randn(d, generator=g))
    want = _rms(full, 1e-5)
    if affine:
        want = want * norm.weight + norm.bias
    got = norm(x)
    if not decompress:
        want = torch.cat([want[..., :-1], torch.zeros_like(want[..., -1:])], -1) if pad else want[..., :-1]
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("pad", [False, True])
def test_tied_compressed_head_equals_the_original_tied_product(pad):
    g = torch.Generator().manual_seed(1)
    vocab, d = 17, 8
    table = torch.randn(vocab, d, generator=g, dtype=torch.float64) + 3.0  # rows with a large mean
    mean = table.mean(1)
    centred = table - mean[:, None]
    emb = nn.Embedding(vocab, d if pad else d - 1, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(torch.cat([centred[:, :-1], torch.zeros(vocab, 1, dtype=torch.float64)], 1) if pad
                         else centred[:, :-1])
    head = TiedCompressedHead(emb, mean, pad=pad)
    y = torch.randn(2, 4, d, generator=g, dtype=torch.float64)  # any y: a final norm's affine output
    assert torch.allclose(head(y), y @ table.T, rtol=0, atol=1e-12)
    assert [n for n, _ in head.named_parameters()] == ["mean"]  # the table is shared, not copied


CAUSAL = [(a, ex, h) for a in list_adapters() for ex in a.examples[:1] for h in ex.heads
          if h.endswith("ForCausalLM") or h.endswith("LMHeadModel")]


@pytest.mark.parametrize("pad", [False, True], ids=["d-1", "pad"])
@pytest.mark.parametrize("adapter,example,head", CAUSAL, ids=[f"{a.name}-{h}" for a, _, h in CAUSAL])
def test_generate_with_kv_cache_after_save_and_load(adapter, example, head, pad, tmp_path):
    torch.manual_seed(0)
    model = realistic(example.build(head, torch.float64))
    conv, report = normfold.convert(model, to="crmsnorm", pad=pad, verify=False)
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert any(isinstance(m, StreamCRMSNorm) for m in loaded.modules())
    ids = torch.randint(3, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    cfg = model.config
    max_pos = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 64
    # tiny configs have 32 positions (OPT offsets by 2): as many new tokens as fit, at most 32
    kw = dict(max_new_tokens=min(32, max_pos - 4 - 2), do_sample=False, use_cache=True, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    want = model.generate(ids, **kw)
    assert torch.equal(loaded.generate(ids, **kw), want)
    assert torch.equal(conv.generate(ids, **kw), want)


# ---- the bundled model through the CLI ------------------------------------------------------------------

def _expected_change(cfg) -> int:
    """Parameters removed by Pre-LN -> Pre-CRMSNorm on a tied GPT-2, counted from the config alone: the tie
    is kept on the original tables (wte and wpe unchanged, the stream compressed on h.0's input, no row-mean
    vector), every block writer loses one output (attn.c_proj and mlp.c_proj a row and a bias entry), every
    block-norm reader one input (c_attn, c_fc), and the block norms' folded γ/β go."""
    d, L, ff = cfg.n_embd, cfg.n_layer, cfg.n_inner or 4 * cfg.n_embd
    per_layer = (d + 1) + (ff + 1) + 3 * d + ff
    return -(L * per_layer + L * 2 * 2 * d)


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="bundled model not built")
def test_bundled_model_cli_crmsnorm_load_generate_verify_and_back(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from normfold.cli import main

    original = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    assert main(["convert", "--to", "crmsnorm", "--out", str(tmp_path / "crms"), "-q"]) == 0
    out = capsys.readouterr().out
    assert "stream width    decoder 192 -> 191" in out
    report = json.loads((tmp_path / "crms" / "normfold.json").read_text())
    assert report["variant"] == "crmsnorm" and report["verification"]["passed"]
    size = report["size"]["parameters"]
    n0 = sum(p.numel() for p in original.parameters())
    assert size["before"] == n0
    assert size["change"] == _expected_change(original.config) < 0

    loaded = normfold.load(tmp_path / "crms")
    assert sum(p.numel() for p in loaded.parameters()) == size["after"]
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=32, do_sample=False, use_cache=True, pad_token_id=0, attention_mask=torch.ones_like(ids))
    want = original.generate(ids, **kw)
    assert torch.equal(loaded.generate(ids, **kw), want)

    assert main(["verify", str(MODEL), str(tmp_path / "crms"), "-q"]) == 0

    assert main(["convert", "--to", "crmsnorm", "--pad", "--out", str(tmp_path / "pad"), "-q"]) == 0
    assert torch.equal(normfold.load(tmp_path / "pad").generate(ids, **kw), want)

    # back to the stock architecture: plain transformers, LayerNorms, same tokens
    assert main(["convert", str(tmp_path / "crms"), "--to", "layernorm", "--out", str(tmp_path / "ln"), "-q"]) == 0
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "ln").eval()
    assert type(stock) is type(original)
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    assert torch.equal(stock.generate(ids, **kw), want)


def test_cli_refuses_layernorm_from_a_layernorm_model_and_pad_without_crmsnorm(capsys):
    from normfold.cli import main

    assert main(["convert", "--to", "layernorm", "--dry-run", "-q"]) == 2
    assert "already is a LayerNorm model" in capsys.readouterr().err
    assert main(["convert", "--pad", "--dry-run", "-q"]) == 2
    assert "--pad applies to --to crmsnorm only" in capsys.readouterr().err
