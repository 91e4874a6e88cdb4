"""The fused block forwards are hand copies of transformers code: each records the digest of the source it
was copied from (normfold.fastpath.blocks.FusedBlock.sources), and only runs while the installed
transformers has that source.

- Every registered block class has a copy for the installed transformers: when this fails, a release
  changed a block normfold fuses; refresh the copy (compare the class's forward with the copy, then
  record the digest the failure prints; `normfold.fastpath.blocks.installed_sources()` gives them all).
- A block whose source does not match runs transformers' own code, unfused: float64 outputs equal the
  original model's, and one warning names the class and the release."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import normfold
from helpers import realistic
from normfold import fastpath
from normfold.fastpath import blocks

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("class_name", sorted(blocks.FUSED_BLOCKS))
def test_installed_source_has_a_copy(class_name):
    specs = blocks.FUSED_BLOCKS[class_name]
    try:
        cls = getattr(importlib.import_module(specs[0].module), class_name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{class_name} is no longer in {specs[0].module} (transformers {transformers.__version__}): {e}")
    digests = {s.module: blocks.source_digest(s.module, s.watched()) for s in specs}
    assert blocks.spec_for(cls) is not None, (
        f"transformers {transformers.__version__} changed {class_name} (source digest {digests}); the fused copies "
        f"were written for {[s.sources for s in specs]}: refresh the copy in normfold/fastpath/families and record "
        f"the new digest")


def _a():
    def f(x, y=1):
        """doc"""
        return x + y  # comment
    return f


def _b():
    def f(x,
          y=1):
        return x + y
    return f


def _c():
    def f(x, y=1):
        return x - y
    return f


def test_digest_ignores_comments_docstrings_and_layout():
    assert blocks._code_digest(_a()) == blocks._code_digest(_b()) != blocks._code_digest(_c())


def _gpt2(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    model = realistic(transformers.GPT2LMHeadModel(cfg).eval().double())
    conv, report = normfold.convert(model, verify=False)
    normfold.save(conv, report, tmp_path / "rms")
    return model


def test_changed_source_runs_unfused_and_says_so_once(tmp_path, monkeypatch):
    model = _gpt2(tmp_path)
    monkeypatch.setattr(blocks, "source_digest", lambda module, watches: "0" * 16)  # "a new release"
    monkeypatch.setattr(blocks, "_SPEC_CACHE", {})
    monkeypatch.setattr(blocks, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = normfold.load(tmp_path / "rms").double()
        assert fastpath.fuse_blocks(loaded) == 0  # asked again: no second warning
    stale = [w for w in caught if "GPT2Block" in str(w.message)]
    assert len(stale) == 1, [str(w.message) for w in caught]
    assert f"transformers {transformers.__version__}" in str(stale[0].message) and "unfused" in str(stale[0].message)
    assert not any(fastpath.is_fused(m) for m in loaded.modules())
    ids = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        got, ref = loaded(input_ids=ids).logits, model(input_ids=ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-9


def test_matching_source_fuses(tmp_path):
    _gpt2(tmp_path)
    loaded = normfold.load(tmp_path / "rms")
    assert sum(fastpath.is_fused(m) for m in loaded.modules()) == 2
