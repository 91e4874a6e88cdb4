"""normfold.train.export to Pre-CRMSNorm keeps a tied table the trained tensor itself (issue 24 item 1, the
training path): the Whisper decoder's table stays one tensor shared with the stock proj_out, holding exactly
the trained θ (the restored LayerNorm model's table), and the exported model computes the trained model's
logits in float64. The same `normfold.convert` decides it (compress.crmsnorm.TIE_ENTRY), so this checks that the
training path reaches it with trained (not freshly built) weights."""

from __future__ import annotations

import copy

import torch
from torch import nn

import normfold
from normfold import train as nftrain
from normfold.compress import TiedCompressedHead

import trainkit as tk


def test_export_crmsnorm_keeps_the_trained_table_tied_whisper(tmp_path):
    fam = tk.FAMILIES["whisper"]
    ln, prep = tk.pair(fam)
    assert ln.proj_out.weight is ln.model.decoder.embed_tokens.weight  # tied
    nftrain.prepare(prep, to="crmsnorm")
    tk.train(prep, fam, "adamw", steps=3)
    trained = nftrain.restore(copy.deepcopy(prep)).eval()
    table = trained.model.decoder.embed_tokens.weight
    assert not torch.equal(table, ln.model.decoder.embed_tokens.weight)  # training moved it
    conv, report = nftrain.export(prep, tmp_path / "out")
    assert report.verification["passed"] and report.structure.compression["tied_heads"] == []
    assert not any(isinstance(m, TiedCompressedHead) for m in conv.modules())
    assert type(conv.proj_out) is nn.Linear and conv.proj_out.weight is conv.model.decoder.embed_tokens.weight
    assert torch.equal(conv.proj_out.weight, table)
    assert sum(p.numel() for p in conv.parameters()) <= sum(p.numel() for p in trained.parameters())
    loaded = normfold.load(tmp_path / "out")
    assert loaded.proj_out.weight is loaded.model.decoder.embed_tokens.weight
    assert torch.equal(loaded.proj_out.weight, table)
    batch = fam.batch(trained, torch.Generator().manual_seed(5))
    kw = {"input_features": batch["input_features"].double(), "decoder_input_ids": batch["labels"]}
    with torch.no_grad():
        want = trained(**kw).logits
        for model in (conv, loaded):
            got = model(**kw).logits
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-12
