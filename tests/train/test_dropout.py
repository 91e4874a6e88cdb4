"""Issue 9 item 2: dropout in training (paper 001 §4.1).

Both runs re-seed the RNG before every step, so the LayerNorm model and the prepared model draw the
same dropout masks; with every dropout active (residual-branch, embedding and attention-probability
dropout, p = 0.1) the prepared model must still train exactly like the LayerNorm model.
"""

from __future__ import annotations

import pytest
import torch

from normfold import train as nftrain
from normfold.train import functional as F

import trainkit as tk

TOL = 1e-10


def _dropout_family(name: str, p: float = 0.1) -> tk.Family:
    fam = tk.FAMILIES[name]
    build = {"gpt2": tk.gpt2, "gpt_neox": tk.neox, "vit": tk.vit, "whisper": tk.whisper}[name]
    return tk.Family(f"{name}-dropout", lambda: build(dropout=p), fam.batch)


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "vit"])
def test_dropout_training_is_exact(family, to):
    fam = _dropout_family(family)
    ln, prep = tk.pair(fam)
    nftrain.prepare(prep, to=to)
    st = nftrain.state(prep)
    assert st.dropouts, "no residual dropout located"
    assert not st.fallback_streams
    ref = tk.train(ln, fam, "adamw")
    got = tk.train(prep, fam, "adamw")
    assert tk.loss_error(got.losses, ref.losses) <= TOL
    err, name = tk.worst_param_error(got.params, ref.params)
    assert err <= TOL, (name, err)
    # dropout was active: the same model without dropout trains differently
    ln0, _ = tk.pair(tk.FAMILIES[family])
    nodrop = tk.train(ln0, tk.FAMILIES[family], "adamw")
    assert tk.loss_error(nodrop.losses, ref.losses) > 1e-3


def test_gpt2_dropout_sites_located():
    ln, prep = tk.pair(_dropout_family("gpt2"))
    nftrain.prepare(prep)
    st = nftrain.state(prep)
    assert set(st.dropouts) == {"transformer.drop", "transformer.h.0.attn.resid_dropout",
                                "transformer.h.0.mlp.dropout", "transformer.h.1.attn.resid_dropout",
                                "transformer.h.1.mlp.dropout"}
    assert st.dropouts["transformer.drop"] == ["transformer.wte", "transformer.wpe"]
    # attention-probability dropout acts before the output projection, which centres whatever it gets
    assert not any("attn_dropout" in d for d in st.dropouts)


def test_whisper_functional_dropout_falls_back_exactly():
    """Whisper applies its residual dropout with F.dropout (no module to hook): the stream falls back to
    LayerNorm arithmetic in training mode (exact) and stays RMSNorm in eval mode."""
    fam = _dropout_family("whisper")
    ln, prep = tk.pair(fam)
    nftrain.prepare(prep)
    st = nftrain.state(prep)
    assert set(st.fallback_streams) == {"encoder", "decoder"}
    ref = tk.train(ln, fam, "adamw")
    got = tk.train(prep, fam, "adamw")
    assert tk.loss_error(got.losses, ref.losses) <= TOL
    assert tk.worst_param_error(got.params, ref.params)[0] <= TOL
    ln.eval(), prep.eval()
    batch = fam.batch(ln, torch.Generator().manual_seed(5))
    batch["input_features"] = batch["input_features"].double()
    hs = prep(**batch, output_hidden_states=True).decoder_hidden_states[1]
    assert (hs.mean(-1).abs().max() / hs.abs().max()).item() < 1e-13  # eval: centred stream, RMSNorm
    assert abs(prep(**batch).loss.item() - ln(**batch).loss.item()) < 1e-10


def _paper_literal(model, crms=False):
    """Paper 001 §4.1 read literally: centred writers (the eval-mode φ) *and* a Recenter after each
    residual dropout."""
    nftrain.prepare(model, dropout="ignore")
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout) and not name.endswith("attn_dropout"):
            m.register_forward_hook(lambda mod, a, o: o - o.mean(-1, keepdim=True) if mod.training else o)
    return model


def test_recentering_a_centred_writer_after_dropout_is_not_layernorm_training():
    """C(m⊙Cb) ≠ C(m⊙b): keeping the writer centred and recentring after dropout keeps the stream
    zero-mean but is a different function of (θ, mask) than the LayerNorm model; so is ignoring dropout."""
    fam = _dropout_family("gpt2")
    ln, lit = tk.pair(fam)
    _, ign = tk.pair(fam)
    _paper_literal(lit)
    nftrain.prepare(ign, dropout="ignore")
    ref = tk.train(ln, fam, "adamw")
    for other in (tk.train(lit, fam, "adamw"), tk.train(ign, fam, "adamw")):
        assert tk.loss_error(other.losses, ref.losses) > 1e-6
        assert tk.worst_param_error(other.params, ref.params)[0] > 1e-6


def test_drop_path_keeps_zero_mean():
    """Stochastic depth multiplies a whole branch output by one scalar per sample, so a centred writer
    stays centred: C(s·b) = s·Cb (no handling needed), unlike element-wise dropout."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(4, 7, 16, dtype=torch.float64, generator=g) + 3.0
    s = (torch.rand(4, 1, 1, generator=g, dtype=torch.float64) > 0.5).double() / 0.5
    assert torch.allclose(F.center(s * b, -1), s * F.center(b, -1), atol=1e-14, rtol=0)
    m = (torch.rand(b.shape, generator=g, dtype=torch.float64) > 0.1).double() / 0.9
    assert (F.center(m * b, -1) - F.center(m * F.center(b, -1), -1)).abs().max() > 1e-2


def test_crmsnorm_with_plain_dropout_is_a_valid_model_but_not_layernorm_training():
    """Paper 001 §4.1: Pre-CRMSNorm is 'compatible with dropout' — dropout of a compressed branch keeps
    the stream compressed (here: its structural last coordinate stays 0), so the model stays valid;
    but it is not the LayerNorm model's training (the LayerNorm model drops the d-th coordinate of the
    uncentred branch too). normfold's exact handling is needed for equality."""
    fam = _dropout_family("gpt2")
    ln, crms = tk.pair(fam)
    nftrain.prepare(crms, to="crmsnorm", dropout="ignore")
    crms.train()
    torch.manual_seed(3)
    hs = crms(input_ids=torch.randint(0, 97, (2, 9)), output_hidden_states=True).hidden_states
    assert all(h[..., -1].abs().max() == 0 for h in hs[:-1])
    ref = tk.train(ln, fam, "adamw")
    got = tk.train(crms, fam, "adamw")
    assert tk.loss_error(got.losses, ref.losses) > 1e-6
