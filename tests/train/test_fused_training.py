"""Issue 24 item 5: prepared models train on the fused path (normfold.fastpath's blocks run the residual
add inside the next norm, forward and backward). Against the same model prepared with fast=False and
against the LayerNorm original: float64 losses and parameters after training steps, with dropout on;
the fused kernel really ran (the norm was called with the residual); restore undoes it."""

from __future__ import annotations

import copy

import pytest
import torch

from normfold import fastpath
from normfold import train as nftrain

import trainkit as tk

pytest.importorskip("transformers")


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
@pytest.mark.parametrize("family,dropout", [("gpt2", 0.0), ("gpt2", 0.1), ("vit", 0.1), ("whisper", 0.0)])
def test_fused_training_equals_unfused_and_layernorm(family, dropout, to):
    fam = tk.FAMILIES[family]
    fam = tk.Family(fam.name, lambda: getattr(tk, family)(dropout=dropout), fam.batch)
    ln, fused = tk.pair(fam)
    plain = copy.deepcopy(ln)
    nftrain.prepare(fused, to=to)
    nftrain.prepare(plain, to=to, fast=False)
    assert any(fastpath.is_fused(m) for m in fused.modules())
    assert not any(fastpath.is_fused(m) for m in plain.modules())
    ref, want, got = (tk.train(m, fam, "adamw", steps=6) for m in (ln, plain, fused))
    assert tk.loss_error(got.losses, want.losses) <= 1e-12
    assert tk.worst_param_error(got.params, want.params)[0] <= 1e-12
    assert tk.loss_error(got.losses, ref.losses) <= 1e-10
    assert tk.worst_param_error(got.params, ref.params)[0] <= 1e-10
    nftrain.restore(fused)
    assert not any(fastpath.is_fused(m) for m in fused.modules())
    assert type(fused) is type(ln) and all(type(a) is type(b) for a, b in zip(fused.modules(), ln.modules()))


def test_fused_kernel_runs_in_training_float32():
    """A model wide enough that the fused add + norm op runs (not a decode-sized shortcut), with gradients."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=64, n_embd=192, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    ln = transformers.GPT2LMHeadModel(cfg)
    fused, plain = copy.deepcopy(ln), copy.deepcopy(ln)
    nftrain.prepare(fused, to="rmsnorm")
    nftrain.prepare(plain, to="rmsnorm", fast=False)
    calls = []
    fused.transformer.h[0].ln_2.register_forward_hook(lambda mod, args, out: calls.append(len(args)))
    ids = torch.randint(0, 101, (2, 64))
    losses = []
    for m in (ln, plain, fused):
        m.train()
        torch.manual_seed(7)  # the same dropout masks in the three models
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert calls == [2]  # ln_2 received (attention output, residual): the fused op ran
    assert abs(losses[2] - losses[1]) <= 1e-5 * abs(losses[1]) and abs(losses[2] - losses[0]) <= 1e-5 * abs(losses[0])
    for (n, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert tk.rel(a.grad, b.grad) <= 1e-4, n
