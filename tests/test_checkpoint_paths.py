"""The path policy (normfold.checkpoint.ModelDir) on its own: what resolves inside a model directory (or a
Hugging Face cache snapshot's blobs/) is handed out, everything else is an UnsafePathError."""

import os

import pytest

from normfold.checkpoint import ModelDir, hf_cache_blobs, weight_files
from normfold.errors import CheckpointError, UnsafePathError


def test_inside_outside_and_odd_names(tmp_path):
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "real.json").write_text("{}")
    (tmp_path / "secret").write_text("x")
    (d / "inner-link.json").symlink_to("sub/real.json")
    (d / "outer-link.json").symlink_to(tmp_path / "secret")
    (d / "dotdot-link.json").symlink_to("../secret")
    (d / "dangling.json").symlink_to(tmp_path / "nowhere")
    (d / "loop-a").symlink_to("loop-b")
    (d / "loop-b").symlink_to("loop-a")
    os.mkfifo(d / "fifo.json")
    m = ModelDir(d)
    assert m.file("config.json") == d / "config.json"
    assert m.file("inner-link.json").read_text() == "{}"
    for name in ("outer-link.json", "dotdot-link.json", "dangling.json"):
        with pytest.raises(UnsafePathError, match="outside the model directory"):
            m.file(name)
    for name in ("../secret", "/etc/passwd", "sub/real.json", "..", ".", "", "a\x00b", "..\\x"):
        with pytest.raises(UnsafePathError, match="not a plain file name"):
            m.check(name)
    with pytest.raises(UnsafePathError):
        m.file("loop-a")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        m.file("fifo.json")  # would block a reader
    with pytest.raises(CheckpointError, match="missing"):
        m.file("absent.json")
    assert m.optional("absent.json") is None


def test_check_all_looks_only_at_files_that_are_read(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (tmp_path / "secret").write_text("x")
    (d / "README.md").symlink_to(tmp_path / "secret")  # never read by normfold or transformers
    ModelDir(d).check_all()
    (d / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(UnsafePathError, match="tokenizer.json"):
        ModelDir(d).check_all()
    with pytest.raises(UnsafePathError, match="tokenizer.json"):
        ModelDir(d).auxiliary_files()


def _cache(root, repo="models--org--tiny"):
    r = root / repo
    snap = r / "snapshots" / "0123abcd"
    (snap / "text_encoder").mkdir(parents=True)
    (r / "blobs").mkdir()
    (r / "blobs" / "aaaa").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/aaaa")
    (snap / "text_encoder" / "config.json").symlink_to("../../../blobs/aaaa")
    return r, snap


def test_hugging_face_cache_snapshots(tmp_path):
    repo, snap = _cache(tmp_path)
    other, other_snap = _cache(tmp_path, "models--org--other")
    assert hf_cache_blobs(snap.resolve()) == (repo / "blobs").resolve()
    assert ModelDir(snap).file("config.json").read_text() == "{}"
    assert ModelDir(snap / "text_encoder").file("config.json").read_text() == "{}"  # a subfolder of a snapshot
    (snap / "tokenizer.json").symlink_to(other / "blobs" / "aaaa")  # another repository's blob
    with pytest.raises(UnsafePathError, match="outside"):
        ModelDir(snap).file("tokenizer.json")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").symlink_to(repo / "blobs" / "aaaa")  # not a snapshot: blobs are outside
    with pytest.raises(UnsafePathError):
        ModelDir(plain).file("config.json")


def test_index_names_checked_once(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "a.safetensors").write_bytes(b"x")
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}')
    assert weight_files(d, "model.safetensors.index.json", "model.safetensors") == ([d / "a.safetensors"], True)
    for bad, pattern in (('"../a.safetensors"', "not a file name inside"), ('"/etc/passwd"', "not a file name"),
                         ("7", "not a file name"), ('"b.safetensors"', "missing")):
        (d / "model.safetensors.index.json").write_text('{"weight_map": {"w": %s}}' % bad)
        with pytest.raises(CheckpointError, match=pattern):
            weight_files(d, "model.safetensors.index.json", "model.safetensors")
    (d / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(CheckpointError, match="not a valid shard index"):
        weight_files(d, "model.safetensors.index.json", "model.safetensors")
