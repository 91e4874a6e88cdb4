"""The analysis on hand-written models, one rule at a time, with both tracers; and the plan it derives
converting a model that has no adapter, checked against the original model itself."""

import copy

import pytest
import torch
from torch import nn

import normfold
from analysis_toys import PostLN, PreLN, Sandwich, realistic_norms
from helpers import rel_err
from normfold.analysis import analyze, trace
from normfold.analysis.rules import reshape_axis
from normfold.errors import NormfoldError, UntraceableModelError

IDS = torch.randint(0, 31, (2, 10), generator=torch.Generator().manual_seed(3))
TRACERS = ["export", "fx"]


def build(cls, **kw):
    torch.manual_seed(0)
    return realistic_norms(cls(**kw)).double().eval()


def verdicts(report):
    return {n.name: n.foldable for n in report.norms}


# ---- axis bookkeeping --------------------------------------------------------------------------------------

@pytest.mark.parametrize("src,dst,axis,want", [
    ((2, 8, 24), (16, 24), -1, -1),  # Conv1D's flatten of the tokens
    ((16, 24), (2, 8, 24), -1, -1),
    ((2, 8, 24), (2, 8, 3, 8), -1, None),  # split into heads: the feature dim is gone
    ((2, 24, 4, 4), (2, 24, 16), -3, -2),  # conv channels through flatten(2)
    ((2, 8, 24), (2, 8, 1, 24), -1, -1),
    ((2, 8, 24), (2, 192), -1, None),
])
def test_reshape_keeps_the_axis_only_when_rows_survive(src, dst, axis, want):
    assert reshape_axis(src, dst, axis) == want


# ---- hand-written models ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tracer", TRACERS)
def test_pre_ln_model_without_adapter_is_fully_foldable(tracer):
    model = build(PreLN)
    report = analyze(model, IDS, tracer=tracer)
    assert report.tracer == f"torch.{tracer}"
    assert all(verdicts(report).values()) and report.total == 5
    blk = report.norm("blocks.0.ln_1")
    assert blk.readers == ["blocks.0.q", "blocks.0.k", "blocks.0.v"] and blk.affine_foldable
    assert sorted(blk.writers) == ["pos", "tok"]
    assert report.norm("blocks.1.ln_2").writers and "blocks.0.proj" in report.norm("blocks.1.ln_2").writers
    assert report.norm("ln_f").readers == ["head"]
    assert {w.name for w in report.writers} == {"tok", "pos", "blocks.0.o", "blocks.0.proj", "blocks.1.o",
                                                "blocks.1.proj"}


def test_both_tracers_agree_on_every_verdict_reader_and_writer():
    model = build(PreLN, stem=True)
    a, b = (analyze(model, IDS, tracer=t) for t in TRACERS)
    assert [(n.name, n.foldable, n.reason, n.readers, n.writers) for n in a.norms] == \
        [(n.name, n.foldable, n.reason, n.readers, n.writers) for n in b.norms]


@pytest.mark.parametrize("tracer", TRACERS)
def test_gelu_stem_makes_nothing_foldable_and_is_named(tracer):
    report = analyze(build(PreLN, stem=True), IDS, tracer=tracer)
    assert not any(verdicts(report).values())
    for n in report.norms:
        assert n.reason == "input includes the output of gelu after stem (not zero-mean)"


def test_post_ln_names_the_previous_norms_affine_output():
    report = analyze(build(PostLN), IDS)
    assert verdicts(report) == {"ln_e": True, "lns.0": False, "lns.1": False}
    assert report.norm("lns.0").reason == "input includes the affine output of ln_e (γ⊙n+β is not zero-mean)"
    assert report.norm("lns.1").reason == "input includes the affine output of lns.0 (γ⊙n+β is not zero-mean)"
    # ln_e is foldable, but its output is the stream (an add reads it): the affine stays in the norm
    e = report.norm("ln_e")
    assert not e.affine_foldable and "add" in e.affine_note


def test_a_norm_without_affine_passes_zero_mean_on():
    # Paper 002's Algorithm 1 treats every LayerNorm output as centred; that holds only without affine.
    free, affine = analyze(build(Sandwich, affine_free=True), torch.randn(2, 4, 5, dtype=torch.float64)), \
        analyze(build(Sandwich, affine_free=False), torch.randn(2, 4, 5, dtype=torch.float64))
    assert free.norm("ln_b").foldable and free.norm("ln_b").writers == ["w"]
    assert not affine.norm("ln_b").foldable
    assert "affine output of ln_a" in affine.norm("ln_b").reason


def test_constant_gamma_and_zero_beta_count_as_no_affine():
    model = build(Sandwich, affine_free=False)
    with torch.no_grad():
        model.ln_a.weight.fill_(0.7)
        model.ln_a.bias.zero_()
    assert analyze(model, torch.randn(2, 4, 5, dtype=torch.float64)).norm("ln_b").foldable
    with torch.no_grad():
        model.ln_a.bias[0] = 1e-3
    assert not analyze(model, torch.randn(2, 4, 5, dtype=torch.float64)).norm("ln_b").foldable


def test_writer_whose_output_also_reaches_a_gelu_cannot_be_centred():
    report = analyze(build(Sandwich), torch.randn(2, 4, 5, dtype=torch.float64))
    reason = report.norm("ln_c").reason
    assert "the output of side (linear), which cannot be centred: its output also reaches gelu" in reason
    assert "affine output of ln_b" in reason


def test_multi_dim_layernorm_is_not_foldable():
    report = analyze(build(Sandwich), torch.randn(2, 4, 5, dtype=torch.float64))
    assert "normalizes over the last 2 dims" in report.norm("ln_2d").reason


@pytest.mark.parametrize("tracer", TRACERS)
def test_tied_head_is_untied_not_a_blocker(tracer):
    model = build(PreLN, tie=True)
    report = analyze(model, IDS, tracer=tracer)
    assert all(verdicts(report).values())
    tok = next(w for w in report.writers if w.name == "tok")
    assert tok.tied_with == ["head.weight"]
    assert any("untie" in n for n in report.notes)


class FunctionalHead(PreLN):
    """The token table is read again by the top-level forward itself: no separate name to untie."""

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.T


def test_weight_reused_functionally_blocks_centring():
    report = analyze(build(FunctionalHead), IDS)
    n = report.norm("blocks.0.ln_1")
    assert not n.foldable
    assert "the output of tok (embedding), which cannot be centred: its weight is also used by" in n.reason
    assert "ln_f" in [x.name for x in report.norms] and not report.norm("ln_f").foldable


@pytest.mark.parametrize("tracer", TRACERS)
def test_dropout_keeps_zero_mean_in_eval_and_breaks_it_in_training(tracer):
    model = build(PreLN, dropout=0.1)
    assert all(verdicts(analyze(model, IDS, tracer=tracer)).values())
    model.train()
    report = analyze(model, IDS, tracer=tracer)
    v = verdicts(report)
    assert v["blocks.0.ln_1"]  # no dropout before the first block
    assert not any(v[k] for k in ("blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2", "ln_f"))
    assert "dropout in training mode in blocks.0.drop" in report.norm("blocks.0.ln_2").reason
    assert "model.eval()" in report.norm("blocks.0.ln_2").reason


def test_embeddings_left_alone_reproduce_the_papers_plain_column():
    report = analyze(build(PreLN), IDS, center_embeddings=False)
    assert not any(verdicts(report).values())
    assert "embeddings are not centred" in report.norm("blocks.0.ln_1").reason


# ---- conversion of a model without an adapter, from the analysis' plan -----------------------------

def _outputs(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("kw", [dict(), dict(tie=True), dict(layers=3, d=16, heads=4)],
                         ids=["untied", "tied", "deeper"])
def test_analysis_plan_converts_a_model_without_adapter_exactly(kw):
    model = build(PreLN, **kw)
    with pytest.raises(normfold.errors.NormfoldError, match="pass them yourself"):
        normfold.convert(model)  # no adapter for this class, and no config to make inputs from
    _, auto = normfold.convert(model, inputs=IDS)  # the analysis' plan, traced on these inputs (issue 13)
    assert auto.adapter == "analysis" and auto.verification["passed"]
    report = analyze(model, IDS)
    conv, crep = normfold.convert(model, adapter=report.to_adapter())
    assert crep.to_dict()["layernorms"]["converted"] == 5 + 2 * (kw.get("layers", 2) - 2)
    assert not any(isinstance(m, nn.LayerNorm) for m in conv.modules())
    assert rel_err(_outputs(conv, IDS), _outputs(model, IDS)) <= 1e-9  # independent of normfold.verify
    assert crep.verification["passed"] and crep.verification["fp64"]["max_rel_error"] <= 1e-9
    # the stream is zero-mean after centring: every ln input
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append(a[0].mean(-1).abs().max().item()))
             for m in conv.modules() if type(m).__name__ == "RMSNorm"]
    _outputs(conv, IDS)
    for h in hooks:
        h.remove()
    assert seen and max(seen) <= 1e-12
    if kw.get("tie"):
        assert model.head.weight is model.tok.weight  # the original keeps its tie


def test_plan_keeps_what_is_not_foldable_with_the_reason():
    model = build(PostLN)
    report = analyze(model, IDS)
    plan = report.to_plan()
    assert [s.path for s in plan.streams[0].norms] == ["ln_e"]
    assert plan.streams[0].norms[0].readers == ()  # affine stays: the output is the stream
    assert {k.path for k in plan.kept} == {"lns.0", "lns.1"}
    conv, crep = normfold.convert(model, adapter=report.to_adapter())
    assert rel_err(_outputs(conv, IDS), _outputs(model, IDS)) <= 1e-9
    assert any(k["name"] == "lns.0" and "affine output of ln_e" in k["reason"] for k in crep.kept)


def test_report_serializes():
    report = analyze(build(PostLN), IDS)
    d = report.to_dict()
    assert d["layernorms"] == {"total": 3, "foldable": 1}
    assert d["norms"][1]["reason"].startswith("input includes the affine output of ln_e")
    assert "inputs" not in d
    import json

    assert json.loads(report.to_json())["tracer"] == "torch.export"


# ---- tracing failures and fallbacks ---------------------------------------------------------------------

@torch.library.custom_op("normfold_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


class CustomOpStem(nn.Module):
    """A custom op without a fake kernel: torch.export fails, torch.fx (which runs it) does not."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln, self.out = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.ln(twice(self.fc(x))))


def test_auto_falls_back_to_fx_and_names_the_unknown_op():
    report = analyze(CustomOpStem(), torch.randn(2, 4))
    assert report.tracer == "torch.fx"
    assert report.norm("ln").reason == "input includes the output of twice after fc (not zero-mean)"


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(4, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # Python control flow on a tensor's value
            h = -h
        return self.ln(h)


def test_untraceable_model_raises_a_helpful_error(capfd):
    with pytest.raises(UntraceableModelError) as err:
        analyze(DataDependent(), torch.randn(2, 4))
    msg = str(err.value)
    assert "torch.export" in msg and "torch.fx" in msg and "control flow" in msg and "inputs=" in msg
    assert isinstance(err.value, NormfoldError)
    assert "def forward" not in capfd.readouterr().err  # export's partial-graph dump is swallowed


def test_plain_module_needs_inputs():
    with pytest.raises(NormfoldError, match="pass them yourself"):
        analyze(PreLN())


def test_a_graph_can_be_reused_for_several_option_sets():
    model = build(PreLN)
    graph = trace(model, {"ids": IDS})
    a = analyze(model, IDS, graph=graph)
    b = analyze(model, IDS, graph=graph, center_embeddings=False)
    assert len(a.foldable) == 5 and len(b.foldable) == 0
    assert copy.deepcopy(a.to_plan()) == a.to_plan()


class ReturnsStream(PreLN):
    """Also returns the residual stream itself: after centring it comes back recentred."""

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x)), x


@pytest.mark.parametrize("tracer", TRACERS)
def test_stream_outputs_are_named_and_declared_centred(tracer):
    model = build(ReturnsStream)
    # an output other than hidden states may not silently change: centring is refused...
    blocked = analyze(model, IDS, tracer=tracer)
    assert not blocked.foldable
    assert "the model output 'output[1]', which would come back recentred" in blocked.norm("ln_f").reason
    # ...unless the caller says that output carries the stream
    report = analyze(model, IDS, tracer=tracer, recentred_outputs=("output[1]",))
    assert report.stream_outputs == ["output[1]"]
    assert report.to_plan().centered_outputs == ["output[[]1[]]"]
    conv, crep = normfold.convert(model, adapter=report.to_adapter())
    assert crep.verification["passed"], crep.verification["fp64"]
    (logits, x), (logits2, x2) = _outputs(model, IDS), _outputs(conv, IDS)
    assert rel_err(logits2, logits) <= 1e-9
    assert rel_err(x2, x - x.mean(-1, keepdim=True)) <= 1e-9


class SharedBlock(PreLN):
    """One block applied twice (ALBERT / universal-transformer style weight sharing)."""

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for _ in range(2):
            x = self.blocks[0](x)
        return self.head(self.ln_f(x))


def test_a_block_called_twice_folds_once_and_converts_exactly():
    model = build(SharedBlock, layers=1)
    report = analyze(model, IDS)
    ln_1 = report.norm("blocks.0.ln_1")
    assert ln_1.foldable and ln_1.calls == 2 and ln_1.affine_foldable
    assert report.total == 3 and len(report.foldable) == 3
    conv, crep = normfold.convert(model, adapter=report.to_adapter())
    assert rel_err(_outputs(conv, IDS), _outputs(model, IDS)) <= 1e-9


class SharedReader(nn.Module):
    """One linear reads two different norms: neither affine can be folded into it."""

    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = nn.Linear(5, d), nn.Linear(5, d)
        self.ln_a, self.ln_b = nn.LayerNorm(d), nn.LayerNorm(d)
        self.proj = nn.Linear(d, 3)

    def forward(self, x):
        return self.proj(self.ln_a(self.a(x))) + self.proj(self.ln_b(self.b(x)))


def test_a_reader_shared_by_two_norms_keeps_the_affines():
    model = build(SharedReader)
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    report = analyze(model, x)
    for name in ("ln_a", "ln_b"):
        n = report.norm(name)
        assert n.foldable and n.readers == ["proj"] and not n.affine_foldable
        assert n.affine_note == "its reader proj is also called on other inputs"
    conv, crep = normfold.convert(model, adapter=report.to_adapter(), inputs={"x": x})
    assert conv.ln_a.weight is not None  # γ stayed in the RMSNorm
    assert rel_err(conv(x), model(x)) <= 1e-9


def test_float_inputs_follow_the_models_dtype():
    model = build(Sandwich)  # float64
    report = analyze(model, torch.randn(2, 4, 5))  # float32 input, as an adapter's example inputs may be
    assert report.norm("ln_a").foldable and report.inputs["x"].dtype == torch.float64


class GeluFeedsNorms(nn.Module):
    """An nn.GELU module output read by one norm, or by two: a Recenter after it pays off only for two."""

    def __init__(self, two: bool, d=8):
        super().__init__()
        self.two = two
        self.fc, self.act = nn.Linear(5, d), nn.GELU()
        self.ln_b, self.ln_c = nn.LayerNorm(d), nn.LayerNorm(d)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.act(self.fc(x))
        y = self.out(self.ln_b(h))
        return y + self.out(self.ln_c(h)) if self.two else y


def test_a_recenter_is_proposed_only_when_it_serves_two_norms():
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    one = analyze(build(GeluFeedsNorms, two=False), x, recenter=True)
    assert not one.foldable and "gelu" in one.norm("ln_b").reason
    two_model = build(GeluFeedsNorms, two=True)
    two = analyze(two_model, x, recenter=True)
    assert [n.name for n in two.foldable] == ["ln_b", "ln_c"]
    assert two.norm("ln_b").recenter == ["act"] and two.to_plan().streams[-1].recenter_after == ["act"]
    conv, crep = normfold.convert(two_model, adapter=two.to_adapter())
    # the shift a Recenter removes reaches ln_b and ln_c only, which ignore it: a stock model needs no Recenter
    assert crep.stock_reloadable and rel_err(conv(x), two_model(x)) <= 1e-9
