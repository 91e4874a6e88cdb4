"""Shared checkpoints are untrusted input (issue 29): the report schema, the path policy for every file read
from a model directory (Hugging Face cache snapshots still work), and the weight files' SHA-256 in the report.

Each refusal: a NormfoldError from the Python API; exit code 2 from the CLI with one paragraph naming the
problem, no traceback, and nothing written (the listing of tmp_path is the same before and after)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import normfold
from helpers import perturb_norms
from normfold.cli import main
from normfold.errors import NormfoldError, ReportSchemaError, UnsafePathError

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

REPORT = "normfold.json"


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refuse(args, capsys, root, pattern, code=2):
    """Run the CLI: exit code, message, no traceback, nothing new under `root`."""
    before = _listing(root)
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert rc == code, err + out
    assert pattern in err + out, err + out
    assert "Traceback" not in err and "internal error" not in err, err
    assert _listing(root) == before
    return err


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny GPT-2 with a tokenizer file, saved in 3 shards."""
    d = tmp_path_factory.mktemp("src") / "gpt2"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)
    perturb_norms(GPT2LMHeadModel(cfg).eval()).save_pretrained(d, max_shard_size="20KB")
    (d / "tokenizer.json").write_text('{"the": "tokenizer"}')
    assert (d / "model.safetensors.index.json").is_file()
    return d


@pytest.fixture(scope="module")
def crms(source, tmp_path_factory):
    """A Pre-CRMSNorm conversion of `source` (normfold_model.safetensors + a report with options and widths)."""
    out = tmp_path_factory.mktemp("conv") / "crms"
    assert main(["convert", str(source), "--to", "crmsnorm", "--out", str(out), "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def rms(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "rms"
    assert main(["convert", str(source), "--out", str(out), "--stream", "never", "-q"]) == 0
    return out


def copy_of(d: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / "work" / name
    shutil.copytree(d, dst, symlinks=True)
    return dst


# ---- the seven tampered reports of issue 29 ------------------------------------------------------------

def _first_norm(r):
    return r["structure"]["norms"][0]


def _set(fn):
    def edit(text):
        r = json.loads(text)
        fn(r)
        return json.dumps(r)
    return edit


TAMPERED = {
    "not-json": (lambda text: text[: len(text) // 2], "not JSON"),
    "class-forward-path": (_set(lambda r: _first_norm(r).update(name="transformer.__class__.forward")),
                           "transformer.__class__.forward"),
    "unknown-norm-type": (_set(lambda r: _first_norm(r).update(type="EvilNorm")), "EvilNorm"),
    "path-not-in-model": (_set(lambda r: _first_norm(r).update(name="transformer.h.7.ln_1")), "transformer.h.7.ln_1"),
    "norms-not-a-list": (_set(lambda r: r["structure"].update(norms="abc")), "structure.norms"),
    "unknown-option": (_set(lambda r: _first_norm(r)["options"].update(evil=1)), "evil"),
    "huge-width": (_set(lambda r: _first_norm(r)["options"].update(width=10**12)), "width"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_report_refused_everywhere(case, crms, source, tmp_path, capsys):
    edit, pattern = TAMPERED[case]
    d = copy_of(crms, tmp_path)
    (d / REPORT).write_text(edit((d / REPORT).read_text()))
    with pytest.raises(NormfoldError, match=None) as info:
        normfold.load(d)
    assert pattern in str(info.value)
    refuse(["verify", source, d, "--no-blockwise", "-q"], capsys, tmp_path, pattern)
    refuse(["verify", source, d, "--blockwise", "-q"], capsys, tmp_path, pattern)
    refuse(["verify", d, "-q"], capsys, tmp_path, pattern)
    refuse(["convert", d, "--to", "layernorm", "--out", tmp_path / "out", "-q"], capsys, tmp_path, pattern)
    refuse(["fuse", d, "--out", tmp_path / "fused", "-q"], capsys, tmp_path, pattern)


def test_untampered_checkpoints_load_and_verify(crms, rms, source, capsys):
    for d in (crms, rms):
        model = normfold.load(d)
        assert model.normfold_report.weight_files
        assert main(["verify", str(source), str(d), "--no-blockwise", "-q"]) == 0
        assert main(["verify", str(source), str(d), "--blockwise", "-q"]) == 0
        assert main(["verify", str(d), "-q"]) == 0
    capsys.readouterr()


def test_report_disagreeing_with_config_or_weights(crms, rms, tmp_path):
    cases = {
        "architecture": (crms, lambda r: r.update(architecture="BertModel"), "BertModel"),
        "dtype": (crms, lambda r: r.update(dtype="float64"), "float64"),
        "compressed-shape": (crms, lambda r: r["structure"]["compression"]["shapes"].update(
            {"transformer.wte.weight": [97, 20]}), "transformer.wte.weight"),
        "recenter-path": (rms, lambda r: r["structure"]["recenter_after"].append("transformer.h.0.__class__"),
                          "transformer.h.0.__class__"),
        "not-a-norm": (rms, lambda r: _first_norm(r).update(name="transformer.h.0.attn"), "not a norm"),
        "negative-eps": (rms, lambda r: _first_norm(r).update(eps=-1.0), "eps"),
        "future-format": (rms, lambda r: r.update(format_version=99, normfold_version="9.0"), "normfold 9.0"),
        "no-format": (rms, lambda r: r.pop("format_version"), "format_version"),
        "unknown-top-level": (rms, lambda r: r.update(payload="x"), "payload"),
        "digest-not-hex": (rms, lambda r: r["weight_files"]["model.safetensors"].update(sha256="zz"), "SHA-256"),
        "digest-path": (rms, lambda r: r.update(weight_files={"../x": {"sha256": "0" * 64, "bytes": 1}}), "../x"),
    }
    for name, (base, fn, pattern) in cases.items():
        d = copy_of(base, tmp_path, name)
        (d / REPORT).write_text(_set(fn)((d / REPORT).read_text()))
        with pytest.raises(NormfoldError) as info:
            normfold.load(d)
        assert pattern in str(info.value), (name, str(info.value))
    assert not list(tmp_path.glob("work/*/.*tmp*"))


def test_format_1_report_still_loads(rms, tmp_path, capsys):
    d = copy_of(rms, tmp_path)
    r = json.loads((d / REPORT).read_text())
    r["format_version"] = 1
    r.pop("weight_files")
    (d / REPORT).write_text(json.dumps(r))
    model = normfold.load(d)
    assert model.normfold_report.weight_files == {}
    err = refuse(["verify", d, "-q"], capsys, tmp_path, "records no weight-file digests")
    r["weight_files"] = {}
    (d / REPORT).write_text(json.dumps(r))
    with pytest.raises(ReportSchemaError, match="not part of report format 1"):
        normfold.load(d)
    assert "format 2" in err


# ---- tamper evidence ------------------------------------------------------------------------------------

def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("stream", ["never", "always"])
def test_digests_recorded_and_checked(stream, source, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(source), "--out", str(out), "--stream", stream, "-q"]) == 0
    recorded = json.loads((out / REPORT).read_text())["weight_files"]
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(recorded) == files and len(files) >= (2 if stream == "always" else 1)
    for name, entry in recorded.items():  # an independent hash of the file on disk
        assert entry == {"sha256": _sha(out / name), "bytes": (out / name).stat().st_size}
    assert main(["verify", str(out), "-q"]) == 0
    capsys.readouterr()
    victim = out / files[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    victim.write_bytes(bytes(data))
    refuse(["verify", out, "-q"], capsys, tmp_path, f"{files[-1]} changed", code=1)
    assert main(["verify", str(out), "-q", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["files"]
    assert [r["file"] for r in rows if r["status"] != "ok"] == [files[-1]]


# ---- the path policy ------------------------------------------------------------------------------------

@pytest.fixture
def outside(tmp_path):
    f = tmp_path / "elsewhere" / "secret.json"
    f.parent.mkdir()
    f.write_text('{"secret": "not yours to upload"}')
    return f


@pytest.mark.parametrize("stream", ["never", "always"])
def test_symlinked_tokenizer_outside_is_refused(stream, source, outside, tmp_path, capsys):
    d = copy_of(source, tmp_path)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(outside)
    err = refuse(["convert", d, "--out", tmp_path / "out", "--stream", stream, "-q"], capsys, tmp_path,
                 "tokenizer.json")
    assert str(outside) in err and "outside the model directory" in err


def test_symlinks_outside_refused_for_every_reader(source, rms, outside, tmp_path, capsys):
    shard = sorted(p.name for p in source.glob("model-*.safetensors"))[0]
    for name in ("config.json", "tokenizer.json", shard):
        d = copy_of(source, tmp_path, name)
        real = d / name
        if name.endswith(".safetensors"):  # a shard that lives elsewhere, linked in
            shutil.move(real, outside.parent / name)
            real.symlink_to(outside.parent / name)
        else:
            real.unlink()
            real.symlink_to(outside)
        for args in (["convert", d, "--out", tmp_path / "out", "-q"], ["analyze", d],
                     ["verify", d, rms, "--no-blockwise", "-q"], ["verify", d, rms, "--blockwise", "-q"]):
            refuse(args, capsys, tmp_path, "outside the model directory")
    c = copy_of(rms, tmp_path, "converted")
    (c / "tokenizer.json").unlink()
    (c / "tokenizer.json").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="tokenizer.json"):
        normfold.load(c)
    refuse(["verify", c, "-q"], capsys, tmp_path, "outside the model directory")
    refuse(["fuse", c, "--out", tmp_path / "fused", "-q"], capsys, tmp_path, "outside the model directory")


def test_index_entry_outside_refused_by_every_reader(source, rms, tmp_path, capsys):
    """Issue 26: `verify --blockwise` used to follow `../elsewhere/model-00001-of-00007.safetensors` and pass."""
    d = copy_of(source, tmp_path)
    elsewhere = tmp_path / "work" / "elsewhere"
    elsewhere.mkdir()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(d / first, elsewhere / first)
    index["weight_map"] = {k: (f"../elsewhere/{v}" if v == first else v) for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    pattern = f"../elsewhere/{first}"
    for args in (["convert", d, "--out", tmp_path / "out", "--stream", "never", "-q"],
                 ["convert", d, "--out", tmp_path / "out", "--stream", "always", "-q"],
                 ["verify", d, rms, "--blockwise", "-q"], ["verify", d, rms, "--no-blockwise", "-q"],
                 ["analyze", d], ["bench", "model", d, "--quick", "--out", tmp_path / "bench", "-q"]):
        refuse(args, capsys, tmp_path, pattern)
    # the same shard linked into the directory by name: the link is followed and refused
    index["weight_map"] = {k: (v.replace("../elsewhere/", "")) for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / first).unlink()
    (d / first).symlink_to(elsewhere / first)
    refuse(["verify", d, rms, "--blockwise", "-q"], capsys, tmp_path, str(elsewhere / first))
    refuse(["convert", d, "--out", tmp_path / "out", "--stream", "always", "-q"], capsys, tmp_path,
           str(elsewhere / first))


def _as_hf_cache(d: Path, root: Path) -> Path:
    """`d` laid out as huggingface_hub caches it: models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/SHA."""
    repo = root / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for f in sorted(d.iterdir()):
        blob = repo / "blobs" / _sha(f)
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_hugging_face_cache_layout_converts_and_verifies(source, tmp_path, capsys):
    snap = _as_hf_cache(source, tmp_path)
    assert all((snap / f).is_symlink() for f in os.listdir(snap))
    for stream in ("never", "always"):
        out = tmp_path / f"out-{stream}"
        assert main(["convert", str(snap), "--out", str(out), "--stream", stream, "-q"]) == 0
        assert (out / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
        assert not (out / "tokenizer.json").is_symlink()
        for mode in ("--blockwise", "--no-blockwise"):
            assert main(["verify", str(snap), str(out), mode, "-q"]) == 0
    # a converted checkpoint shared through the hub cache loads and verifies too
    conv = _as_hf_cache(tmp_path / "out-never", tmp_path / "conv-cache")
    assert isinstance(normfold.load(conv), GPT2LMHeadModel)
    assert main(["verify", str(conv), "-q"]) == 0
    capsys.readouterr()
    # a snapshot file linked to another repository's blobs is refused
    other = _as_hf_cache(source, tmp_path / "other-cache")
    bad = snap / "tokenizer.json"
    bad.unlink()
    bad.symlink_to(other / "tokenizer.json")
    refuse(["convert", snap, "--out", tmp_path / "out-bad", "-q"], capsys, tmp_path, "outside the model directory")
