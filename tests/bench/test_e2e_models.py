"""The e2e benchmark models: the RMS / CRMS variants built by converting the Pre-LN model compute
the same function (float64), on the compressed d−1 stream for CRMS."""

import pytest
import torch

from normfold.bench import e2e_models as em
from normfold.nn import CRMSNorm, RMSNorm

TINY = [
    em.ViTConfig("tiny-vit", dim=32, depth=2, heads=2, mlp=64, patch=8, image=32, classes=10),
    em.GPTConfig("tiny-gpt", dim=24, depth=3, heads=3, mlp=96, seq=12, vocab=61, context=16),
]


def _inputs(cfg, batch=3):
    x = cfg.inputs(batch, torch.Generator().manual_seed(1))
    return x.double() if x.is_floating_point() else x


@pytest.mark.parametrize("cfg", TINY, ids=lambda c: c.name)
def test_variants_agree_in_float64(cfg):
    ln = em.build(cfg, seed=3, dtype=torch.float64)
    models = em.variants(ln)
    assert list(models) == list(em.VARIANTS)
    x = _inputs(cfg)
    with torch.no_grad():
        want = ln(x)
        for name in ("rmsnorm", "crmsnorm"):
            got = models[name](x)
            assert got.shape == want.shape
            rel = float((got - want).abs().max() / want.abs().max())
            assert rel <= 1e-9, (name, rel)
        # the floor is a different function: make sure the test would notice a wrong model
        assert float((models["no-norm"](x) - want).abs().max() / want.abs().max()) > 1e-3


@pytest.mark.parametrize("cfg", TINY, ids=lambda c: c.name)
def test_norm_types_and_stream_width(cfg):
    models = em.variants(em.build(cfg, dtype=torch.float64))
    d = cfg.dim
    assert em.stream_width(models["layernorm"]) == d
    assert em.stream_width(models["rmsnorm"]) == d
    assert em.stream_width(models["crmsnorm"]) == d - 1
    for name, kind in (("layernorm", torch.nn.LayerNorm), ("rmsnorm", RMSNorm), ("crmsnorm", CRMSNorm)):
        norms = [m for m in models[name].modules() if isinstance(m, (torch.nn.LayerNorm, RMSNorm, CRMSNorm))]
        assert len(norms) == 2 * cfg.depth + 1 and all(isinstance(m, kind) for m in norms)
    # block norms' affines were folded into their readers; Pre-RMS keeps the final norm's γ/β (normfold
    # convert's default), Pre-CRMS folds it into the head as well
    rms = [m for m in models["rmsnorm"].modules() if isinstance(m, RMSNorm)]
    assert all(m.weight is None and m.bias is None for m in rms[:-1])
    assert rms[-1].weight is not None and rms[-1].bias is not None
    assert all(m.weight is None and m.bias is None for m in models["crmsnorm"].modules() if isinstance(m, CRMSNorm))
    assert all(m.normalized_shape == (d - 1,) for m in models["crmsnorm"].modules() if isinstance(m, CRMSNorm))
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in models["no-norm"].modules())
    # the residual stream the blocks see really is d−1 wide
    seen = []
    models["crmsnorm"].blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[-1]))
    with torch.no_grad():
        models["crmsnorm"](_inputs(cfg, batch=1))
    assert seen == [d - 1]


def test_converted_float32_stays_close():
    cfg = TINY[0]
    ln = em.build(cfg, seed=5)
    models = em.variants(ln)
    x = cfg.inputs(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ln.double()(x.double())
        for name in ("layernorm", "rmsnorm", "crmsnorm"):
            got = models[name].float()(x)
            assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-4


def test_paper_sizes():
    assert [(c.dim, c.depth, c.heads, c.mlp, c.patch) for c in em.VIT_SIZES.values()] == [
        (192, 12, 3, 768, 16), (384, 12, 6, 1536, 16), (768, 12, 12, 3072, 16), (1024, 24, 16, 4096, 16),
        (1280, 32, 16, 5120, 14)]
    assert [(c.dim, c.depth, c.heads, c.seq) for c in em.GPT3_SIZES.values()] == [
        (768, 12, 12, 512), (1024, 24, 16, 512)]
    assert em.VIT_SIZES["huge"].tokens() == 257
