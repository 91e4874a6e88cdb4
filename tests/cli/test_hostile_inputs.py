"""Broken and hostile inputs (issue 11 item 3): each is refused with exit code 2, a message saying what is
wrong and what to do, no traceback, nothing executed from the checkpoint, and nothing written at --out
or beside it."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import perturb_norms
from normfold.cli import main

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "good"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)
    perturb_norms(GPT2LMHeadModel(cfg).eval()).save_pretrained(d)
    return d


def variant(good, tmp_path, edit) -> Path:
    d = tmp_path / "model"
    shutil.copytree(good, d)
    edit(d)
    return d


def refuse(args, capsys, tmp_path, pattern, code=2):
    """Run the CLI; check the exit code, the message, no traceback and that nothing appeared in tmp_path."""
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = main([str(a) for a in args])
    _, err = capsys.readouterr()
    assert rc == code, err
    assert pattern in err, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no --out, no temp dir beside it
    return err


def _rewrite(d, fn):
    f = d / WEIGHTS
    f.write_bytes(fn(f.read_bytes()))


def _header_json(b):
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8:8 + n]), b[8 + n:]


def _with_header(header, data):
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _shift_offsets(b):  # first tensor's end moved past the data section
    header, data = _header_json(b)
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] = len(data) + 100
    return _with_header(header, data)


def _overlap(b):
    header, data = _header_json(b)
    names = [k for k in header if k != "__metadata__"]
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
    header[names[1]]["shape"] = list(header[names[0]]["shape"])
    header[names[1]]["dtype"] = header[names[0]]["dtype"]
    return _with_header(header, data)


def _bad_dtype(b):
    header, data = _header_json(b)
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "F128"
    return _with_header(header, data)


BROKEN_SAFETENSORS = {
    "truncated": (lambda b: b[: len(b) // 2], "truncated"),
    "absurd-header-length": (lambda b: struct.pack("<Q", 2 ** 60) + b[8:], "corrupted safetensors header"),
    "header-not-json": (lambda b: b[:8] + b"{not json" + b[17:], "invalid JSON"),
    "offsets-outside-file": (_shift_offsets, "truncated"),
    "overlapping-tensors": (_overlap, "overlap"),
    "unknown-dtype": (_bad_dtype, "unknown dtype"),
    "empty": (lambda b: b"", "is empty"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_SAFETENSORS))
def test_broken_safetensors_refused(good, tmp_path, capsys, case):
    fn, pattern = BROKEN_SAFETENSORS[case]
    d = variant(good, tmp_path, lambda d: _rewrite(d, fn))
    err = refuse(["convert", d, "--out", tmp_path / "out", "-q"], capsys, tmp_path, pattern)
    assert "re-download" in err


def test_verify_refuses_broken_checkpoint(good, tmp_path, capsys):
    d = variant(good, tmp_path, lambda d: _rewrite(d, lambda b: b[:100]))
    refuse(["verify", good, d], capsys, tmp_path, "model.safetensors")


def test_shard_index_pointing_outside_or_missing(good, tmp_path, capsys):
    def edit(d):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    d = variant(good, tmp_path, edit)
    refuse(["convert", d, "--out", tmp_path / "out", "-q"], capsys, tmp_path, "../../etc/passwd")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    refuse(["convert", d, "--out", tmp_path / "out", "-q"], capsys, tmp_path, "missing")


class _Marker:
    """A pickle payload that would create a file if anything unpickled it with code execution."""

    path = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_pickle_with_code_refused_and_never_executed(good, tmp_path, capsys):
    marker = tmp_path.parent / f"{tmp_path.name}-PWNED"
    payload = _Marker()
    payload.path = str(marker)

    def edit(d):
        state = dict(GPT2LMHeadModel.from_pretrained(d).state_dict())
        (d / WEIGHTS).unlink()
        torch.save({"evil": payload, **state}, d / "pytorch_model.bin")
    d = variant(good, tmp_path, edit)
    err = refuse(["convert", d, "--out", tmp_path / "out", "-q"], capsys, tmp_path, "objects other than tensors")
    assert "weights_only=True" in err
    assert not marker.exists()


def test_clean_pickle_checkpoint_still_converts(good, tmp_path, capsys):
    def edit(d):
        state = dict(GPT2LMHeadModel.from_pretrained(d).state_dict())
        (d / WEIGHTS).unlink()
        torch.save(state, d / "pytorch_model.bin")
    d = variant(good, tmp_path, edit)
    rc = main(["convert", str(d), "--out", str(tmp_path / "out"), "-q"])
    capsys.readouterr()
    assert rc == 0 and (tmp_path / "out" / "normfold.json").is_file()


def test_remote_code_refused_unless_trusted(good, tmp_path, capsys):
    marker = tmp_path.parent / f"{tmp_path.name}-IMPORTED"

    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["auto_map"] = {"AutoConfig": "custom.Cfg", "AutoModelForCausalLM": "custom.Model"}
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                     "from transformers import GPT2Config as Cfg, GPT2LMHeadModel as Model\n")
    d = variant(good, tmp_path, edit)
    err = refuse(["convert", d, "--out", tmp_path / "out", "-q"], capsys, tmp_path, "--trust-remote-code")
    assert "auto_map" in err and not marker.exists()


def test_shapes_disagreeing_with_config(good, tmp_path, capsys):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["n_inner"] = 50
        (d / "config.json").write_text(json.dumps(cfg))
    d = variant(good, tmp_path, edit)
    refuse(["convert", d, "--out", tmp_path / "out", "-q"], capsys, tmp_path, "do not match config.json")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_weights_named(good, tmp_path, capsys, bad):
    from safetensors.torch import load_file, save_file

    def edit(d):
        state = load_file(d / WEIGHTS)
        state["transformer.h.1.mlp.c_fc.weight"][3, 4] = bad
        save_file(state, d / WEIGHTS, metadata={"format": "pt"})
    d = variant(good, tmp_path, edit)
    refuse(["convert", d, "--out", tmp_path / "out", "-q"], capsys, tmp_path, "transformer.h.1.mlp.c_fc.weight")


def test_output_is_a_file_or_under_a_file_or_unwritable(good, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("keep me")
    refuse(["convert", good, "--out", f, "-q"], capsys, tmp_path, "is not a directory")
    refuse(["convert", good, "--out", f, "--force", "-q"], capsys, tmp_path, "is not a directory")
    refuse(["convert", good, "--out", f / "sub", "-q"], capsys, tmp_path, "is a file, not a directory")
    assert f.read_text() == "keep me"
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK) and os.geteuid() == 0:
            target = Path("/proc/normfold-out")  # root writes anywhere else; /proc refuses even root
        else:
            target = ro / "out"
        rc = main(["convert", str(good), "--out", str(target), "-q"])
        _, err = capsys.readouterr()
        assert rc == 2 and "not writable" in err and "Traceback" not in err, err
        assert not target.exists() and list(ro.iterdir()) == []
    finally:
        os.chmod(ro, 0o700)


def _cli(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return [sys.executable, "-m", "normfold", *map(str, args)], env


def test_disk_full_during_write_leaves_nothing(good, tmp_path):
    """RLIMIT_FSIZE makes the first weight file too large to write (EFBIG; Python ignores SIGXFSZ)."""
    resource = pytest.importorskip("resource")
    cmd, env = _cli("convert", good, "--out", tmp_path / "out", "-q")

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "disk is full" in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_interrupt_while_saving_removes_the_temporary_output(good, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    import normfold.checkpoint.writer

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    monkeypatch.setattr(normfold.checkpoint.writer, "write_all", interrupted)  # mid-file, normfold's own writer
    rc = main(["convert", str(good), "--out", str(tmp_path / "out"), "-q"])
    _, err = capsys.readouterr()
    assert rc == 130 and "interrupted; nothing was written" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("phase", ["loading", "converting", "verifying", "writing"])
def test_signal_at_each_phase_leaves_nothing(good, tmp_path, sig, phase):
    """The signal is sent as soon as the progress line of `phase` appears on stderr; the run either stops
    cleanly (exit 130, nothing at --out) or, if it already finished, leaves a complete output."""
    out = tmp_path / "out"
    cmd, env = _cli("convert", good, "--out", out)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if phase in line.lower():
            proc.send_signal(sig)
            break
    rest = proc.stderr.read()
    rc = proc.wait(timeout=300)
    err = "".join(seen) + rest
    assert "Traceback" not in err, err
    if rc == 0:  # finished before the signal landed
        assert (out / "normfold.json").is_file()
    else:
        assert rc == 130, err
        assert "interrupted" in err
        assert list(tmp_path.iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_verify_refuses_remote_code_and_names_its_flag(good, tmp_path, capsys):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["auto_map"] = {"AutoConfig": "custom.Cfg"}
        (d / "config.json").write_text(json.dumps(cfg))
    d = variant(good, tmp_path, edit)
    refuse(["verify", d, good], capsys, tmp_path, "--trust-remote-code")
