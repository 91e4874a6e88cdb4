"""Streamed reverse conversion (issue 26 item 3): a Pre-RMSNorm or Pre-CRMSNorm checkpoint written by normfold, streamed back
`--to layernorm` (normfold.stream.reverse), holds the same tensors as `normfold.load` + `normfold.convert(model,
to="layernorm")` + `normfold.save`, reloads in stock transformers and computes the original model's outputs;
a Pre-CRMSNorm checkpoint streams `--to rmsnorm` too (decompress only), and a tied head holding a folded γ or an
added bias is untied as (E' + μ1ᵀ)·diag γ; the directions that do not stream (a rotated checkpoint, options) are
refused with StreamUnsupportedError."""

from __future__ import annotations

import importlib

import pytest
import torch

import normfold
from normfold.adapters import get_adapter
from normfold.adapters.base import get
from normfold.compress.reverse import source_variant
from normfold.stream import stream_convert
from normfold.stream.executor import prepare
from normfold.stream.source import StreamUnsupportedError

from _compare import header_and_data, make_checkpoint, tensors_bytes, weight_files

FAMILIES = [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM"), ("vit", None)]


def _source(tmp_path, family, head):
    example = get_adapter(family).examples[0]
    return make_checkpoint(example, head or example.heads[0], tmp_path / "src", shard="20KB")


def _forward(tmp_path, src, streamed: bool, **kw):
    out = tmp_path / "rms"
    if streamed:
        out.mkdir()
        stream_convert(src, out, to="rmsnorm", **kw)
    else:
        model, _ = normfold.io.load_source(src)
        conv, report = normfold.convert(model, to="rmsnorm", verify=False, **kw)
        normfold.save(conv, report, out, source_dir=src)
    return out


def _reverse_both(tmp_path, rms):
    model = normfold.load(rms)
    back, mem_report = normfold.convert(model, to="layernorm", verify=False)
    normfold.save(back, mem_report, tmp_path / "mem", source_dir=rms)
    (tmp_path / "st").mkdir()
    report = stream_convert(rms, tmp_path / "st", to="layernorm")
    return mem_report, report


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("streamed_forward", [False, True], ids=["memory-fwd", "stream-fwd"])
@pytest.mark.parametrize("family,head", FAMILIES)
def test_streamed_reverse_equals_in_memory_and_reloads_stock(tmp_path, family, head, streamed_forward):
    import transformers

    src = _source(tmp_path, family, head)
    rms = _forward(tmp_path, src, streamed_forward)
    mem_report, report = _reverse_both(tmp_path, rms)
    mem, st = tmp_path / "mem", tmp_path / "st"

    # the same tensors, bit for bit (names, dtypes, shapes, bytes), and the same config
    assert tensors_bytes(mem) == tensors_bytes(st)
    if len(weight_files(st)) == 1:
        (hx, dx), (hy, dy) = header_and_data(weight_files(mem)[0]), header_and_data(weight_files(st)[0])
        assert hx == hy and dx == dy
    assert (mem / "config.json").read_text() == (st / "config.json").read_text()
    a, b = mem_report.to_dict(), report.to_dict()
    for key in ("variant", "structure", "stock_reloadable", "dtype", "centered_outputs", "adapter"):
        assert a[key] == b[key], key
    assert report.stock_reloadable and report.verification["performed"] is False

    # stock transformers reloads it and computes the original model's outputs
    original, _ = normfold.io.load_source(src)
    cls = getattr(transformers, type(original).__name__)
    reloaded = cls.from_pretrained(st).eval()
    assert not any(type(m).__module__.startswith("normfold") for m in reloaded.modules())
    inputs = get_adapter(family).example_inputs(original, torch.Generator().manual_seed(0))
    ref, got = _outputs(original.eval(), inputs), _outputs(reloaded, inputs)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("old_form", [False, True], ids=["recenter-form", "tiedhead-form"])
def test_streamed_reverse_restores_the_stock_tie(tmp_path, monkeypatch, old_form):
    """From the default form (original table, Recenter after wte) and from checkpoints of the older form (a
    head kept tied to the centred table, nn.TiedHead): the stock tie, equal bytes streamed and in memory."""
    src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
    with monkeypatch.context() as m:
        if old_form:
            m.setattr(importlib.import_module("normfold.conversion"), "recentre_tied_tables",
                      lambda model, plan, options: plan)
        rms = _forward(tmp_path, src, False)
    structure = normfold.io.read_report(rms).structure
    assert bool(structure.tied_heads) == old_form and ("transformer.wte" in structure.recenter_after) != old_form
    mem_report, report = _reverse_both(tmp_path, rms)
    assert tensors_bytes(tmp_path / "mem") == tensors_bytes(tmp_path / "st")
    names = set(tensors_bytes(tmp_path / "st"))
    assert "lm_head.mean" not in names and "lm_head.weight" not in names and "transformer.wte.weight" in names


def test_reverse_directions_that_do_not_stream_are_refused(tmp_path):
    src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
    model, _ = normfold.io.load_source(src)
    conv, report = normfold.convert(model, to="crmsnorm", verify=False)
    normfold.save(conv, report, tmp_path / "crms", source_dir=src)
    # (Pre-CRMSNorm --to layernorm and --to rmsnorm stream: test_streamed_crmsnorm_way_back_equals_in_memory,
    # test_streamed_crmsnorm_to_rmsnorm_equals_in_memory); with options it does not
    out = tmp_path / "out-crms-pad"
    out.mkdir()
    with pytest.raises(StreamUnsupportedError, match="in memory"):
        stream_convert(tmp_path / "crms", out, to="rmsnorm", pad=True)
    assert not any(out.iterdir())
    # a stream rotated through explicit x·Q ops (BLOOM's stem): the reverse conversions refuse it in memory too
    bloom = make_checkpoint(get_adapter("bloom").examples[0], "BloomForCausalLM", tmp_path / "bloom", shard="20KB")
    model, _ = normfold.io.load_source(bloom)
    conv, report = normfold.convert(model, rotate="hadamard", verify=False)
    assert report.structure.rotation.get("explicit")
    normfold.save(conv, report, tmp_path / "bloom-rot", source_dir=bloom)
    out = tmp_path / "out-bloom-rot"
    out.mkdir()
    with pytest.raises(StreamUnsupportedError, match="explicit / online rotation"):
        stream_convert(tmp_path / "bloom-rot", out, to="layernorm")
    assert not any(out.iterdir())
    with pytest.raises(normfold.NormfoldError, match="explicit / online rotation"):
        normfold.convert(normfold.load(tmp_path / "bloom-rot"), to="layernorm", verify=False)
    rms = _forward(tmp_path, src, False)
    for kw in ({"to": "crmsnorm"}, {"to": "rmsnorm"}, {"to": "layernorm", "fold_final": True}):
        out = tmp_path / ("o" + "-".join(map(str, kw.values())))
        out.mkdir()
        with pytest.raises(StreamUnsupportedError, match="in memory"):
            stream_convert(rms, out, **kw)
    # the CLI's --stream auto asks prepare: a normfold checkpoint converts in memory there
    with pytest.raises(StreamUnsupportedError, match="normfold checkpoint"):
        prepare(rms, to="layernorm")


def _zero_final_bias_source(tmp_path, family, head, dtype=torch.float32):
    """A checkpoint whose final norm has β = 0, so that --fold-final folds its γ into the tied head without adding
    a bias (nn.TiedHead with a scale and no bias)."""
    src = _source(tmp_path, family, head)
    model, _ = normfold.io.load_source(src)
    plan = get_adapter(family).plan(model)
    with torch.no_grad():
        for stream in plan.streams:
            for site in stream.norms:
                if site.final:
                    get(model, site.path).bias.zero_()
    model = model.to(dtype)
    model.save_pretrained(tmp_path / "src0", max_shard_size="20KB")
    return tmp_path / "src0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True], ids=["folded-scale", "scale-and-added-bias"])
@pytest.mark.parametrize("family,head", [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM")])
def test_tied_head_with_a_folded_scale_or_added_bias_streams(tmp_path, monkeypatch, family, head, bias, dtype):
    """A head kept tied to the centred table but holding the final norm's γ (and, with --allow-new-bias, an
    added bias) is untied on the way back as (E' + μ1ᵀ)·diag γ: streamed in small row chunks, the in-memory
    bytes, float64 against the stored tensors, and (no added bias) a stock checkpoint with the original's outputs."""
    from normfold.stream import reverse

    monkeypatch.setattr(reverse, "CHUNK_BYTES", 8 * 32 * 3)  # a few rows per chunk
    if bias:  # the final norm's β != 0: folding it adds a bias to the tied head
        src = make_checkpoint(get_adapter(family).examples[0], head, tmp_path / "src0", dtype=dtype, shard="20KB")
        kw = {"fold_final": True, "allow_new_bias": True}
    else:
        src = _zero_final_bias_source(tmp_path, family, head, dtype)
        kw = {"fold_final": True}
    rms = _forward(tmp_path, src, False, **kw)
    structure = normfold.io.read_report(rms).structure
    (tie,) = structure.tied_heads
    assert tie["scale"] and (tie["head"] in structure.added_bias) == bias
    mem_report, report = _reverse_both(tmp_path, rms)
    mem, st = tensors_bytes(tmp_path / "mem"), tensors_bytes(tmp_path / "st")
    assert mem == st
    assert (tmp_path / "mem" / "config.json").read_text() == (tmp_path / "st" / "config.json").read_text()
    a, b = mem_report.to_dict(), report.to_dict()
    for key in ("variant", "structure", "stock_reloadable", "dtype", "centered_outputs", "adapter", "size"):
        assert a[key] == b[key], key
    assert f"{tie['head']}.weight" in report.structure.untied and report.stock_reloadable == (not bias)
    assert {v[0] for v in st.values()} == {"F32" if dtype == torch.float32 else "BF16"}

    # the untied head from the stored tensors, float64, rounded once: (E' + μ1ᵀ)·diag γ
    stored = tensors_bytes(rms)

    def tensor(name):
        dt, shape, raw = stored[name]
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)

    table, mean, scale = (tensor(f"{tie['table']}.weight"), tensor(f"{tie['head']}.mean"),
                          tensor(f"{tie['head']}.scale"))
    want = ((table.double() + mean.double()[:, None]) * scale.double()[None, :]).to(dtype)
    dt, shape, raw = st[f"{tie['head']}.weight"]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape), want)
    assert st[f"{tie['table']}.weight"] == stored[f"{tie['table']}.weight"]  # the table stays E'
    if bias:
        assert st[f"{tie['head']}.bias"] == stored[f"{tie['head']}.bias"]
    elif dtype == torch.float32:  # stock transformers reloads it and computes the original model's outputs
        import transformers

        original, _ = normfold.io.load_source(src)
        reloaded = getattr(transformers, head).from_pretrained(tmp_path / "st").eval()
        inputs = get_adapter(family).example_inputs(original, torch.Generator().manual_seed(0))
        ref, got = _outputs(original.eval(), inputs), _outputs(reloaded, inputs)
        assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("pad", [False, True], ids=["d-1", "padded"])
@pytest.mark.parametrize("family,head", [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM"),
                                         ("gpt_neox", "GPTNeoXForCausalLM"), ("whisper", None),
                                         ("bloom", "BloomForCausalLM")])
def test_streamed_crmsnorm_to_rmsnorm_equals_in_memory(tmp_path, monkeypatch, family, head, pad, dtype):
    """A Pre-CRMSNorm checkpoint streamed --to rmsnorm (decompress only, in small row chunks): the bytes, config and
    report of `normfold.load` + `normfold.convert(to="rmsnorm")` + `normfold.save`, a normfold Pre-RMSNorm checkpoint
    that loads back and computes the in-memory decompressed model's outputs."""
    from normfold.stream import compute as stream_compute
    from normfold.stream import reverse

    monkeypatch.setattr(stream_compute, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(reverse, "CHUNK_BYTES", 1024)
    example = get_adapter(family).examples[0]
    src = make_checkpoint(example, head or example.heads[0], tmp_path / "src", dtype=dtype, shard="20KB")
    crms = tmp_path / "crms"
    crms.mkdir()
    stream_convert(src, crms, to="crmsnorm", pad=pad)
    model = normfold.load(crms)
    back, mem_report = normfold.convert(model, to="rmsnorm", verify=False)
    normfold.save(back, mem_report, tmp_path / "mem", source_dir=crms)
    (tmp_path / "st").mkdir()
    report = stream_convert(crms, tmp_path / "st", to="rmsnorm")
    mem, st = tensors_bytes(tmp_path / "mem"), tensors_bytes(tmp_path / "st")
    assert mem == st
    assert {v[0] for v in st.values()} == {"F32" if dtype == torch.float32 else "BF16"}
    assert (tmp_path / "mem" / "config.json").read_text() == (tmp_path / "st" / "config.json").read_text()
    a, b = mem_report.to_dict(), report.to_dict()
    for key in ("variant", "structure", "stock_reloadable", "dtype", "centered_outputs", "adapter", "size", "layernorms"):
        assert a[key] == b[key], key
    assert report.variant == "rmsnorm" and "decompress" in " ".join(report.notes)
    assert "layernorm" not in report.notes[0].rpartition(":")[2]
    # it loads back as a normfold Pre-RMSNorm model computing the in-memory result's outputs (float64 runs of both)
    loaded = normfold.load(tmp_path / "st")
    assert source_variant(loaded) == "rmsnorm"
    back64, loaded64 = back.double().eval(), loaded.double().eval()
    inputs = get_adapter(family).example_inputs(back, torch.Generator().manual_seed(0))
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        x, y = back64(**inputs), loaded64(**inputs)
    compared = 0
    for k in x.keys():
        if isinstance(x[k], torch.Tensor) and x[k].is_floating_point():
            assert (x[k] - y[k]).abs().max().item() <= 1e-9 * max(1.0, x[k].abs().max().item()), k
            compared += 1
    assert compared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streamed_reverse_keeps_16bit(tmp_path, dtype):
    example = get_adapter("gpt2").examples[0]
    src = make_checkpoint(example, "GPT2LMHeadModel", tmp_path / "src", dtype=dtype, shard="20KB")
    rms = _forward(tmp_path, src, False)
    _reverse_both(tmp_path, rms)
    got = tensors_bytes(tmp_path / "st")
    assert got == tensors_bytes(tmp_path / "mem")
    assert {d for d, _, _ in got.values()} == {"BF16" if dtype == torch.bfloat16 else "F16"}


def test_restored_table_in_row_chunks_and_sharded_output(tmp_path, monkeypatch):
    """Small row chunks (many per table) give the whole-table bytes; a sharded stock-reloadable Pre-RMS source
    keeps its sharding."""
    from normfold.stream import reverse

    monkeypatch.setattr(reverse, "CHUNK_BYTES", 8 * 64 * 3)
    src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
    rms = _forward(tmp_path, src, False)
    _reverse_both(tmp_path, rms)
    assert tensors_bytes(tmp_path / "st") == tensors_bytes(tmp_path / "mem")

    src2 = _source(tmp_path / "b", "vit", None)
    rms2 = _forward(tmp_path / "b", src2, True)
    assert len(weight_files(rms2)) > 1
    _reverse_both(tmp_path / "b", rms2)
    assert len(weight_files(tmp_path / "b" / "st")) > 1
    assert tensors_bytes(tmp_path / "b" / "st") == tensors_bytes(tmp_path / "b" / "mem")


@pytest.mark.parametrize("kw", [{"keep_affine": True}, {"untie": True}, {"fold_final": True},
                                {"fold_final": True, "allow_new_bias": True}],
                         ids=lambda k: "-".join(k))
@pytest.mark.parametrize("family,head", FAMILIES + [("bloom", "BloomForCausalLM"), ("gpt_neox", "GPTNeoXForCausalLM")])
def test_streamed_reverse_after_forward_options(tmp_path, family, head, kw):
    """Sources converted with each forward option (kept affines, untied heads, folded final norms, added head
    biases): the streamed reverse gives the in-memory bytes (a tied head holding a folded γ or an added bias
    untied as (E' + μ1ᵀ)·diag γ)."""
    src = _source(tmp_path, family, head)
    rms = _forward(tmp_path, src, False, **kw)
    mem_report, report = _reverse_both(tmp_path, rms)
    assert tensors_bytes(tmp_path / "mem") == tensors_bytes(tmp_path / "st")
    assert (tmp_path / "mem" / "config.json").read_text() == (tmp_path / "st" / "config.json").read_text()
    assert mem_report.to_dict()["structure"] == report.to_dict()["structure"]
    assert mem_report.stock_reloadable == report.stock_reloadable


@pytest.mark.parametrize("kw", [{}, {"pad": True}, {"fold_final": True}, {"fold_final": True, "allow_new_bias": True}],
                         ids=lambda k: "-".join(k) or "plain")
@pytest.mark.parametrize("family,head", FAMILIES + [("bloom", "BloomForCausalLM"), ("gpt_neox", "GPTNeoXForCausalLM")])
def test_streamed_crmsnorm_way_back_equals_in_memory(tmp_path, family, head, kw):
    """A Pre-CRMSNorm checkpoint (d-1, or zero-padded) streams back --to layernorm: decompress's values per tensor
    (writers' last output restored as minus the sum, readers' zero input column, a tied compressed head untied as
    the restored table plus its row means), the in-memory bytes, config and report."""
    src = _source(tmp_path, family, head)
    crms = tmp_path / "crms"
    crms.mkdir()
    stream_convert(src, crms, to="crmsnorm", **kw)
    mem_report, report = _reverse_both(tmp_path, crms)
    assert tensors_bytes(tmp_path / "mem") == tensors_bytes(tmp_path / "st")
    assert (tmp_path / "mem" / "config.json").read_text() == (tmp_path / "st" / "config.json").read_text()
    a, b = mem_report.to_dict(), report.to_dict()
    for key in ("variant", "structure", "stock_reloadable", "dtype", "centered_outputs", "adapter", "size"):
        assert a[key] == b[key], key
    assert "decompress -> layernorm" in " ".join(report.notes)


def test_streamed_crmsnorm_way_back_in_row_chunks_16bit(tmp_path, monkeypatch):
    """Tiny chunks over the restored tables (the last-axis writers and the tied compressed head), bfloat16: the
    bytes of decompress's whole-tensor passes."""
    from normfold.stream import compute as stream_compute
    from normfold.stream import reverse as stream_reverse_mod

    monkeypatch.setattr(stream_compute, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(stream_reverse_mod, "CHUNK_BYTES", 1024)
    example = get_adapter("gpt2").examples[0]
    src = make_checkpoint(example, "GPT2LMHeadModel", tmp_path / "src", dtype=torch.bfloat16, shard="20KB")
    crms = tmp_path / "crms"
    crms.mkdir()
    stream_convert(src, crms, to="crmsnorm")
    _reverse_both(tmp_path, crms)
    assert tensors_bytes(tmp_path / "mem") == tensors_bytes(tmp_path / "st")
    assert {v[0] for v in tensors_bytes(tmp_path / "st").values()} == {"BF16"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("family,head", FAMILIES + [("gpt_neox", "GPTNeoXForCausalLM")])
def test_streamed_rotated_way_back_equals_in_memory(tmp_path, monkeypatch, family, head, kind, dtype):
    """A checkpoint rotated through its weights (--rotate, streamed) comes back --to layernorm as the in-memory
    reverse makes it: every RMSNorm a LayerNorm (γ = 1, β = 0: the rotation folded them into the readers), the
    weights kept in the rotated basis (the LayerNorm of the rotated zero-mean stream is its RMSNorm), the
    rotation record dropped; the same bytes, a stock checkpoint computing the original's outputs; --to rmsnorm
    from it is refused (it already is one)."""
    import transformers

    from normfold.stream import compute as stream_compute

    monkeypatch.setattr(stream_compute, "CHUNK_BYTES", 1024)
    example = get_adapter(family).examples[0]
    src = make_checkpoint(example, head or example.heads[0], tmp_path / "src", dtype=dtype, shard="20KB")
    rot = tmp_path / "rot"
    rot.mkdir()
    stream_convert(src, rot, to="rmsnorm", rotate=kind, rotate_seed=3)
    assert normfold.io.read_report(rot).structure.rotation
    mem_report, report = _reverse_both(tmp_path, rot)
    mem, st = tensors_bytes(tmp_path / "mem"), tensors_bytes(tmp_path / "st")
    assert mem == st
    assert {v[0] for v in st.values()} == {"F32" if dtype == torch.float32 else "BF16"}
    assert (tmp_path / "mem" / "config.json").read_text() == (tmp_path / "st" / "config.json").read_text()
    a, b = mem_report.to_dict(), report.to_dict()
    for key in ("variant", "structure", "stock_reloadable", "dtype", "centered_outputs", "adapter", "size"):
        assert a[key] == b[key], key
    assert not report.structure.rotation and report.stock_reloadable
    rotated = tensors_bytes(rot)
    copied = [k for k in st if k in rotated]
    assert copied and all(st[k] == rotated[k] for k in copied)  # the rotated weights, byte for byte
    # stock transformers reloads it: the original model's logits (float64 runs of both; a model whose output is
    # the final norm's, in the rotated basis without its γ/β, has no logits to compare)
    original, _ = normfold.io.load_source(src)
    reloaded = getattr(transformers, type(original).__name__).from_pretrained(tmp_path / "st").double().eval()
    original = original.double().eval()
    inputs = get_adapter(family).example_inputs(original, torch.Generator().manual_seed(0))
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        ref, got = original(**inputs), reloaded(**inputs)
    if getattr(ref, "logits", None) is not None:
        tol = 1e-5 if dtype == torch.float32 else 5e-2  # the weights rounded to the stored dtype after rotating
        err = (got.logits - ref.logits).abs().max().item()
        assert err <= tol * max(1.0, ref.logits.abs().max().item())
    out = tmp_path / "st-rms"
    out.mkdir()
    with pytest.raises(StreamUnsupportedError, match="in memory"):
        stream_convert(rot, out, to="rmsnorm")


@pytest.mark.parametrize("scale", [False, True], ids=["retied", "untied-with-scale"])
def test_nan_in_a_table_the_way_back_computes_is_refused(tmp_path, scale):
    """A NaN in the table that the way back recomputes (E' + μ1ᵀ, or (E' + μ1ᵀ)·diag γ) is refused with
    NonFiniteWeightsError naming the tensor, as the in-memory path's input check refuses it."""
    from safetensors.torch import load_file, save_file

    from normfold.errors import NonFiniteWeightsError

    with pytest.MonkeyPatch.context() as m:
        if not scale:  # the older form: a head kept tied to the centred table, nn.TiedHead without γ
            m.setattr(importlib.import_module("normfold.conversion"), "recentre_tied_tables",
                      lambda model, plan, options: plan)
            src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
            rms = _forward(tmp_path, src, False)
        else:
            src = _zero_final_bias_source(tmp_path, "gpt2", "GPT2LMHeadModel")
            rms = _forward(tmp_path, src, False, fold_final=True)
    (tie,) = normfold.io.read_report(rms).structure.tied_heads
    assert bool(tie["scale"]) == scale
    (f,) = weight_files(rms)
    state = load_file(f)
    state["transformer.wte.weight"][5, 3] = float("nan")
    save_file(state, f, metadata={"format": "pt"})
    (tmp_path / "st").mkdir()
    with pytest.raises(NonFiniteWeightsError, match="transformer.wte.weight"):
        stream_convert(rms, tmp_path / "st", to="layernorm")
