"""Issue 13 in the analysis: scale folding (LayerScale) and seeing through resampling / layout changes
along non-feature dims — with the cases that must NOT fold, each converted and checked in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normfold
from helpers import rel_err
from normfold.analysis import analyze

D, T, V = 12, 9, 23


class ScaledBlock(nn.Module):
    def __init__(self, mode, shared=None):
        super().__init__()
        self.mode = mode
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.w, self.b = nn.Parameter(torch.randn(D, D) * 0.3), nn.Parameter(torch.randn(D))
        shape = {"per_token": (T, 1), "per_token_channel": (T, D), "scalar_param": ()}.get(mode, (D,))
        self.lam = shared if shared is not None else nn.Parameter(torch.rand(shape) + 0.5)

    def forward(self, x):
        h = self.ln(x)
        y = h @ self.w if self.mode == "functional" else F.dropout(self.fc(h), 0.1, self.training)
        return x + y * self.lam


class ScaledLM(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.b1 = ScaledBlock(mode)
        self.b2 = ScaledBlock(mode, shared=self.b1.lam if mode == "shared" else None)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)
        with torch.no_grad():
            for m in (self.b1.ln, self.b2.ln, self.ln_f):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)

    def forward(self, ids):
        return self.head(self.ln_f(self.b2(self.b1(self.tok(ids)))))


IDS = {"ids": torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("mode,folded", [("module", True), ("functional", True), ("scalar_param", True),
                                         ("per_token", True), ("shared", False), ("per_token_channel", False)])
def test_layerscale(mode, folded):
    torch.manual_seed(0)
    model = ScaledLM(mode).double().eval()
    report = analyze(model, IDS)
    assert len(report.foldable) == (3 if folded else 1)  # b1.ln always (it reads the embeddings only)
    scales = report.to_plan().streams[0].scale_folds
    if mode in ("module", "functional"):  # per-channel λ: folded into the writer
        assert {s for _, s in scales} == {"b1.lam", "b2.lam"}
    else:  # a per-row scale (scalar, per token) keeps zero mean as is; λ shared or varying per token and
        assert scales == []  # channel cannot be folded into one writer
    if not folded:
        assert "mul" in report.norm("b2.ln").reason
    conv, rep = normfold.convert(model, adapter=report.to_adapter(), inputs=IDS)
    assert rep.verification["passed"] and rep.verification["fp64"]["max_rel_error"] <= 1e-9
    with torch.no_grad():
        assert rel_err(conv(**IDS), model(**IDS)) <= 1e-12
    if scales:
        assert torch.equal(conv.b1.lam, torch.ones(D, dtype=torch.float64))


class Resampled(nn.Module):
    """Patch tokens + a position table resampled to the patch grid (Dinov2/ViT interpolate_pos_encoding)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.patch = nn.Conv2d(3, D, 2, stride=2)
        self.pos = nn.Parameter(torch.randn(1, 16, D))  # a 4x4 grid
        self.ln_1, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, 5)

    def table(self, n):
        grid = self.pos.reshape(1, 4, 4, D).permute(0, 3, 1, 2)  # features on dim 1
        if self.mode == "feature_axis":  # resampling along the features themselves: not zero-mean
            x = F.interpolate(self.pos[None], size=(n * n, D), mode="bilinear", align_corners=False)[0]
            return x
        if self.mode == "nearest":
            grid = F.interpolate(grid, size=(n, n), mode="nearest")
        elif self.mode == "antialias":
            grid = F.interpolate(grid, size=(n, n), mode="bilinear", antialias=True, align_corners=False)
        elif self.mode == "pool":
            grid = F.adaptive_avg_pool2d(grid, n)
        else:
            grid = F.interpolate(grid, size=(n, n), mode="bicubic", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(1, n * n, D)

    def forward(self, pixels):
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        x = x + self.table(int(x.shape[1] ** 0.5))
        x = x + self.fc(self.ln_1(x))
        return self.head(self.ln_f(x).mean(1))


@pytest.mark.parametrize("mode", ["bicubic", "nearest", "antialias", "pool", "feature_axis"])
@pytest.mark.parametrize("size", [12, 6])  # a 6x6 grid (upsampled from 4x4) or 3x3 (downsampled)
def test_resampled_position_table(mode, size):
    torch.manual_seed(0)
    model = Resampled(mode).double().eval()
    px = {"pixels": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)}
    report = analyze(model, px)
    if mode == "feature_axis":
        assert not report.foldable and "upsample_bilinear2d" in report.norm("ln_1").reason
        return
    assert len(report.foldable) == 2 and "pos" in report.to_plan().streams[0].writers
    conv, rep = normfold.convert(model, adapter=report.to_adapter(), inputs=px)
    assert rep.verification["fp64"]["max_rel_error"] <= 1e-9
    with torch.no_grad():
        assert rel_err(conv(**px), model(**px)) <= 1e-12


def test_mean_over_the_feature_dim_is_not_zero_mean():
    from normfold.analysis.graph import Node
    from normfold.analysis.rules import _reduce

    x = Node("x", "input", shape=(2, 5, D))
    over_tokens = Node("m", "mean", args=(x, [1]), shape=(2, D))
    over_features = Node("m", "mean", args=(x, [-1], True), shape=(2, 5, 1))
    assert _reduce(over_tokens, -1) == -1 and _reduce(over_features, -1) is None
