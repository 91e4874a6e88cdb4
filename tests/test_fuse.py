"""fuse_offline_norms: tiny GPT-2 and ViT models with UnifiedNorm swapped in and trained a few steps;
eval outputs before and after fusion compared by the tests themselves in float64."""

import copy

import pytest
import torch
from torch import nn

import normfold
from helpers import perturb_biases, perturb_norms, rel_err
from normfold.algebra import fold_into_writer
from normfold.nn import FixedAffine, OfflineNorm, UnifiedNorm
from normfold.unified.variant import swap_layernorms

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

GPT2 = dict(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)
VIT = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
           intermediate_size=48, num_labels=5, layer_norm_eps=1e-6)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and far faster on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train_a_few_steps(model, batch, steps=6, lr=0.05):
    """UN's statistics, windows and γ/β all move: fusion must use the trained state."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = model(**batch(g)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def gpt2_batch(g):
    ids = torch.randint(0, 97, (4, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def vit_batch(g):
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}


def outputs64(model, inputs):
    m = copy.deepcopy(model).to(torch.float64).eval()
    with torch.no_grad():
        out = m(**{k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()})
    return out


def norm_modules(model):
    return [n for n, m in model.named_modules() if isinstance(m, (nn.LayerNorm, OfflineNorm, FixedAffine))]


def check_fused(un_model, inputs, key, **kwargs):
    """Fuse a float64 copy and compare its outputs with the unfused float64 model's."""
    un64 = copy.deepcopy(un_model).to(torch.float64).eval()
    fused64, report = normfold.fuse_offline_norms(un64, inputs, **kwargs)
    before, after = outputs64(un64, inputs), outputs64(fused64, inputs)
    assert rel_err(after[key], before[key]) <= 1e-9
    return fused64, report


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_lm_head_fuses_every_norm(tied):
    torch.manual_seed(0)
    model = perturb_biases(perturb_norms(GPT2LMHeadModel(GPT2Config(**GPT2, tie_word_embeddings=tied))))
    assert len(swap_layernorms(model, M=2, M_grad=3, warmup=2)) == 5
    train_a_few_steps(model, gpt2_batch)
    assert int(model.transformer.h[0].ln_1.step) == 6 and int(model.transformer.h[0].ln_1.grad_step) == 6
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    fused, report = check_fused(model, {"input_ids": ids}, "logits")
    assert norm_modules(fused) == [] and report.kept == []
    assert {f["name"]: f["into"] for f in report.fused}["transformer.ln_f"] == ["lm_head"]
    assert all(f["direction"] == "following" and f["source"] == "adapter plan" for f in report.fused)
    assert report.added_bias == ["lm_head"]  # ln_f's shift needs a bias on the bias-free head
    assert ("transformer.wte.weight" in report.untied) == tied
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    # and in the working dtype, the fused float32 model is as close as float32 allows
    fused32, _ = normfold.fuse_offline_norms(model)
    with torch.no_grad():
        assert rel_err(fused32(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5


def test_vit_classifier_fuses_every_norm_by_trace():
    torch.manual_seed(0)
    model = perturb_biases(perturb_norms(ViTForImageClassification(ViTConfig(**VIT))))
    assert len(swap_layernorms(model, M=2, warmup=2)) == 5
    train_a_few_steps(model, vit_batch)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    # ViT has an adapter now; use_plan=False exercises the trace-only path this test is about
    fused, report = check_fused(model, {"pixel_values": pixels}, "logits", use_plan=False)
    assert norm_modules(fused) == [] and report.kept == []
    into = {f["name"]: f["into"] for f in report.fused}
    first = next(n for n in into if n.endswith("0.layernorm_before"))
    block = first[: -len("layernorm_before")]
    # the three attention input projections, and the MLP's first linear (names vary across versions)
    qkv = {"query", "key", "value", "q_proj", "k_proj", "v_proj"}
    assert len(into[first]) == 3 and all(r.startswith(block) and r.split(".")[-1] in qkv for r in into[first])
    (fc,) = into[block + "layernorm_after"]
    assert fc.startswith(block) and fc.split(".")[-1] in ("dense", "fc1")
    assert into["vit.layernorm"] == ["classifier"]  # reads a view (the [CLS] row) of the norm's output
    assert all(f["source"] == "trace" for f in report.fused)


def test_a_norm_whose_output_is_returned_is_kept_with_its_reason():
    torch.manual_seed(0)
    model = perturb_norms(GPT2Model(GPT2Config(**GPT2)))
    swap_layernorms(model, M=2, warmup=1)
    _set_statistics(model)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    fused, report = check_fused(model, {"input_ids": ids}, "last_hidden_state")
    assert [k["name"] for k in report.kept] == ["ln_f"]
    assert "no module reads its output" in report.kept[0]["reason"]
    assert "not the output of a linear layer" in report.kept[0]["reason"]
    assert norm_modules(fused) == ["ln_f"] and isinstance(fused.ln_f, FixedAffine)


def test_an_unseen_functional_reader_is_caught_by_the_float64_check():
    """ViTModel's final norm feeds the pooler's linear layer (seen by the trace) and is also
    returned as last_hidden_state (invisible to it): fusing into the pooler would change that output."""
    torch.manual_seed(0)
    model = ViTModel(ViTConfig(**VIT))
    swap_layernorms(model, M=2, warmup=1)
    _set_statistics(model)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    fused, report = check_fused(model, {"pixel_values": pixels}, "last_hidden_state")
    assert [k["name"] for k in report.kept] == ["layernorm"]
    assert "changed the model's outputs" in report.kept[0]["reason"]
    before, after = outputs64(model, {"pixel_values": pixels}), outputs64(fused, {"pixel_values": pixels})
    assert rel_err(after["pooler_output"], before["pooler_output"]) <= 1e-9


def _set_statistics(model):
    """Trained-looking running statistics and affines (so a wrong fusion cannot go unnoticed)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, OfflineNorm):
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 3 + 0.2)
                m.weight.copy_(1 + 0.5 * torch.randn(m.num_features, generator=g))
                m.bias.copy_(0.5 * torch.randn(m.num_features, generator=g))
                if m.config.centered:
                    m.running_mean.copy_(torch.randn(m.num_features, generator=g))


class PostNorm(nn.Module):
    """linear -> norm -> GELU: the norm's reader is not linear, so it folds into the preceding linear."""

    def __init__(self, method):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.norm = OfflineNorm(8, method=method, M=2, warmup=1) if method != "un" else UnifiedNorm(8, M=2)
        self.act = nn.GELU()
        self.down = nn.Linear(8, 3, bias=False)

    def forward(self, x):
        return self.down(self.act(self.norm(self.up(x))))


class Residual(nn.Module):
    """x + norm(x) read by a GELU: no linear neighbour either way."""

    def __init__(self):
        super().__init__()
        self.norm = UnifiedNorm(6, M=2)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.norm(x + 1.0))


@pytest.mark.parametrize("method", ["un", "bn", "mabn", "pn"])
def test_fusion_into_the_preceding_linear(method):
    torch.manual_seed(0)
    model = PostNorm(method)
    _set_statistics(model)
    x = torch.randn(2, 5, 6)
    fused, report = _fuse_plain(model, x)
    assert report.fused == [{"name": "norm", "into": ["up"], "direction": "preceding", "source": "trace"}]
    assert isinstance(fused.norm, nn.Identity) and not isinstance(fused.norm, FixedAffine)


def _fuse_plain(model, x):
    m64 = copy.deepcopy(model).double().eval()
    fused, report = normfold.fuse_offline_norms(m64, {"x": x.double()})
    with torch.no_grad():
        assert rel_err(fused(x.double()), m64(x.double())) <= 1e-9
    return fused, report


def test_no_linear_neighbour_keeps_a_fixed_affine():
    model = Residual()
    _set_statistics(model)
    fused, report = _fuse_plain(model, torch.randn(3, 4, 6))
    assert report.fused == [] and isinstance(fused.norm, FixedAffine)
    assert "non-linear module(s): act (GELU)" in report.kept[0]["reason"]


def test_model_without_offline_norms_is_refused():
    with pytest.raises(normfold.NormfoldError, match="no offline norms"):
        normfold.fuse_offline_norms(nn.Sequential(nn.Linear(2, 2)), {"input": torch.randn(1, 2)})


def test_original_is_untouched_and_keeps_its_mode():
    torch.manual_seed(0)
    model = PostNorm("un").train()
    before = copy.deepcopy(model.state_dict())
    normfold.fuse_offline_norms(model, {"x": torch.randn(2, 6)})
    assert model.training and isinstance(model.norm, UnifiedNorm)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_fold_into_writer_against_brute_force():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(5, 4).double()
    conv = nn.Conv2d(3, 4, 3).double()
    scale, shift = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    for module, x, channel_dim in [(lin, torch.randn(7, 5, dtype=torch.float64), -1),
                                   (conv, torch.randn(2, 3, 6, 6, dtype=torch.float64), 1)]:
        shape = [1] * x.dim()
        shape[channel_dim] = -1
        with torch.no_grad():
            want = module(x) * scale.reshape(shape) + shift.reshape(shape)
            w, b = fold_into_writer(module.weight, module.bias, scale, shift, out_dim=0)
            module.weight.copy_(w)
            module.bias.copy_(b)
            assert rel_err(module(x), want) < 1e-14
    # HF Conv1D layout: y = x @ W + b with W (in, out); no bias: the shift becomes one
    W = torch.randn(3, 2, generator=g)
    x = torch.randn(5, 3, generator=g)
    w, b = fold_into_writer(W, None, torch.tensor([2.0, 3.0]), torch.tensor([1.0, -1.0]), out_dim=1)
    assert rel_err(x @ w + b, (x @ W) * torch.tensor([2.0, 3.0]) + torch.tensor([1.0, -1.0])) < 1e-6
    assert b.dtype == torch.float32


# ---- fusion without example inputs (issue 13) ------------------------------------------------------------

class CustomPreNorm(nn.Module):
    """A custom module normfold cannot make inputs for: x + fc2(gelu(fc1(norm1(x)))); norm2 read by a head
    and also returned (a functional consumer); norm3 after a linear writer whose output feeds only it."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = UnifiedNorm(6, M=2), UnifiedNorm(6, M=2), UnifiedNorm(8, M=2)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 6)
        self.head = nn.Linear(6, 4)
        self.up = nn.Linear(6, 8)
        self.act = nn.GELU()

    def forward(self, x):
        x = x + self.fc2(self.act(self.fc1(self.norm1(x))))
        h = self.norm2(x)
        return self.head(h), h, self.act(self.norm3(self.up(x)))


def test_fusion_without_inputs_folds_per_site_and_checks_each_site():
    torch.manual_seed(0)
    model = CustomPreNorm()
    _set_statistics(model)
    with pytest.raises(normfold.NormfoldError):
        normfold.unified.fuse.example_inputs(model)  # nothing to build inputs from: the per-site path is taken
    fused, report = normfold.fuse_offline_norms(model.double())
    assert model.training  # the original keeps its mode; compare in eval mode below
    model.eval()
    by = {f["name"]: f for f in report.fused}
    assert by["norm1"]["into"] == ["fc1"] and by["norm1"]["direction"] == "following"
    assert by["norm3"]["into"] == ["up"] and by["norm3"]["direction"] == "preceding"
    assert [k["name"] for k in report.kept] == ["norm2"] and "the model output" in report.kept[0]["reason"]
    v = report.verification
    assert v["scope"] == "per-site" and v["passed"] and {s["name"] for s in v["sites"]} == {"norm1", "norm3"}
    assert all(s["max_rel_error"] <= 1e-12 for s in v["sites"])
    # the model-level truth, checked independently here
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    with torch.no_grad():
        for a, b in zip(fused(x), model(x)):
            assert rel_err(a, b) <= 1e-12


def test_per_site_check_catches_a_wrong_fold():
    torch.manual_seed(0)
    model = CustomPreNorm().double()
    _set_statistics(model)
    bad = normfold.unified.fuse.Decision("norm1", "following", ("fc2",), "test")  # fc2 does not read norm1
    with pytest.raises(Exception):
        normfold.unified.fuse.check_site(model, bad)  # shapes do not even match: 6 features into an 8-input layer
    good = normfold.unified.fuse.Decision("norm1", "following", ("fc1",), "test")
    assert normfold.unified.fuse.check_site(model, good) <= 1e-12
