"""Issue 24 item 4: the Pre-CRMS runtime's cheaper paths compute what the general paths computed.

- the norm kernels' fast calls read a row-strided stream (x[..., :d−1] of a d-wide buffer: what the padded
  writers return) in place instead of leaving it to the dispatcher: bit-identical to the dispatcher's call,
  and within rounding of the float64 reference;
- the stream's entry (re-centre + compress) returns a contiguous (d−1)-wide tensor with the values of the
  sliced d-wide result (bit-identical), exact in float64;
- the final norm's decompressed γ⊙n + β is built in one buffer: bit-identical to the general path,
  float64 within 1e-12 of the reference;
- whole loaded models (GPT-2 with a kept tie, ViT) give the same bits with these paths as with them
  turned off, float64 outputs ≤ 1e-12 relative to the original, and greedy generate() is unchanged.
"""

import pytest
import torch

from normfold import ops
from normfold.compress import StreamCRMSNorm
from normfold.compress import runtime
from normfold.ops import cpu as ops_cpu
from normfold.ops import cpu_calls

pytestmark = pytest.mark.skipif(ops_cpu.library() is None, reason="normfold CPU kernel not built here")


def _crms_ref(x):  # float64 CRMSNorm of a compressed zero-mean stream: RMSNorm of the full vector, first d−1
    x = x.double()
    full = torch.cat([x, -x.sum(-1, keepdim=True)], -1)
    return (full * torch.rsqrt(full.square().mean(-1, keepdim=True) + 1e-5))[..., :-1]


def _strided(shape, dtype, g):
    buf = torch.randn(*shape[:-1], shape[-1] + 1, generator=g).to(dtype)
    return buf[..., :-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256, 767), (197, 383), (2, 3, 11)])
def test_fast_calls_read_row_strided_streams_as_the_dispatcher_does(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x, r = _strided(shape, dtype, g), _strided(shape, dtype, g)
    assert not x.is_contiguous()
    n = shape[-1]
    w = torch.randn(n, generator=g)
    y = cpu_calls.fast_forward(x, None, None, 1e-5, True)
    assert y is not None and y.is_contiguous()
    assert torch.equal(y, ops.crms_norm(x, None, None, 1e-5))
    # (not bit-equal to the contiguous copy's result: the kernel's row reduction depends on alignment)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (y.double() - _crms_ref(x)).abs().max().item() <= tol * 4
    for res in (r, r.contiguous()):
        out = cpu_calls.fast_add_forward(x, res, w, None, 1e-5, True)
        assert out is not None
        s, y2 = out
        s0, y0 = ops.add_crms_norm(x, res, w, None, 1e-5)
        assert torch.equal(s, s0) and torch.equal(y2, y0)
        assert torch.equal(s, x + res)
        assert (y2.double() - _crms_ref(s) * w.double()).abs().max().item() <= tol * 4 * w.abs().max().item()


def test_fast_calls_refuse_what_is_not_a_row_view():
    x = torch.randn(8, 6)[:, ::2]  # last stride 2: not read in place
    assert cpu_calls.fast_forward(x, None, None, 1e-5, True) is None
    assert cpu_calls.fast_add_forward(x, x.contiguous(), None, None, 1e-5, True) is None
    t = torch.randn(4, 5, 7).transpose(0, 1)[..., :-1]  # rows not one stride apart: no (rows, n) view
    assert cpu_calls._row_view(t, 6) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_entry_recentre_compress_is_contiguous_and_unchanged(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 9, 16, generator=g, dtype=torch.float64) * 0.02 + 3.0).to(dtype)
    got = runtime._recenter_compress(x, False)
    x1 = x - x.mean(-1, keepdim=True)
    before = (x1 - x1.mean(-1, keepdim=True))[..., :-1]  # the former two-pass form, sliced
    assert got.is_contiguous() and got.shape[-1] == 15
    assert torch.equal(got, before)
    if dtype == torch.float64:
        ref = (x - x.mean(-1, keepdim=True))[..., :-1]
        assert (got - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_decompressed_final_norm_matches_the_general_path(dtype, affine):
    g = torch.Generator().manual_seed(3)
    d = 24
    norm = StreamCRMSNorm(d, weight=affine != "none", bias=affine == "both", decompress=True, dtype=dtype)
    with torch.no_grad():
        if norm.weight is not None:
            norm.weight.copy_(torch.randn(d, generator=g))
        if norm.bias is not None:
            norm.bias.copy_(torch.randn(d, generator=g))
    full = torch.randn(3, 7, d, generator=g, dtype=torch.float64)
    full = full - full.mean(-1, keepdim=True)
    x = full[..., :-1].to(dtype)
    with torch.inference_mode():
        got = norm(x)
    # the general path (what runs under autograd), by hand
    n = ops.crms_norm(x, None, None, norm.eps)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    nf = n.to(acc)
    want = torch.cat([nf, -nf.sum(-1, keepdim=True)], -1)
    if norm.weight is not None:
        want = want * norm.weight.to(acc)
    if norm.bias is not None:
        want = want + norm.bias.to(acc)
    want = want.to(dtype)
    assert got.shape == (3, 7, d) and got.dtype == dtype
    assert torch.equal(got, want)
    with torch.enable_grad():
        assert torch.equal(norm(x.clone().requires_grad_(dtype != torch.bfloat16)).detach(), want)
    ref = full * torch.rsqrt(full.square().mean(-1, keepdim=True) + norm.eps)
    if norm.weight is not None:
        ref = ref * norm.weight.double()
    if norm.bias is not None:
        ref = ref + norm.bias.double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    assert (got.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


def _tiny(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=64)
        return transformers.GPT2LMHeadModel(cfg).eval(), {"input_ids": torch.randint(0, 97, (2, 9))}
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=32, patch_size=8, num_labels=5)
    return transformers.ViTForImageClassification(cfg).eval(), {"pixel_values": torch.randn(2, 3, 32, 32)}


def _perturb(model):  # LayerNorm affines away from (1, 0), embeddings off-centre: the conversion has work to do
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
    return model


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_loaded_models_same_bits_with_and_without_the_cheaper_paths(family, tmp_path, monkeypatch):
    import normfold

    import copy

    model, x = _tiny(family)
    model = _perturb(model)

    def logits(m):
        with torch.inference_mode():
            return m(**x).logits

    # float64 (converted, saved and loaded in float64): exact against the original
    m64, x64 = copy.deepcopy(model).double(), {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    crms, report = normfold.convert(m64, to="crmsnorm", verify=False)
    normfold.save(crms, report, tmp_path / "m64")
    with torch.inference_mode():
        want = m64(**x64).logits
        got = normfold.load(tmp_path / "m64")(**x64).logits
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()

    crms, report = normfold.convert(model, to="crmsnorm", verify=False)
    normfold.save(crms, report, tmp_path / "m")
    fast = normfold.load(tmp_path / "m")
    a = logits(fast)
    monkeypatch.setattr(cpu_calls, "_row_view", lambda t, n: None)
    monkeypatch.setattr(StreamCRMSNorm, "_decompressed", lambda self, x: None)
    b = logits(fast)
    assert torch.equal(a, b)
    if family == "gpt2":
        monkeypatch.undo()
        ids = x["input_ids"][:1, :4]
        with torch.inference_mode():
            out = fast.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref)
