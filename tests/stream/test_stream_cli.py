"""`normfold convert --stream`: the streamed CLI path, its output directory handling, the lock, concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normfold.adapters import get_adapter
from normfold.cli import main

from _compare import make_checkpoint, tensors_bytes

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "gpt2"
    return make_checkpoint(get_adapter("gpt2").examples[0], "GPT2LMHeadModel", path, shard="20KB")


def test_always_streams_and_verifies_small_models(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(ckpt), "--out", str(out), "--stream", "always", "-q", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verification"]["passed"] is True and report["verification"]["fp64"]["passed"]
    assert "normfold.stream" in " ".join(report["notes"])
    assert json.loads((out / "normfold.json").read_text())["verification"]["passed"] is True
    # same tensors as the in-memory CLI path
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "mem"), "--stream", "never", "-q"]) == 0
    assert tensors_bytes(out) == tensors_bytes(tmp_path / "mem")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem", "out"]  # no temp dir, no lock left


def test_always_refuses_what_needs_memory(ckpt, tmp_path, capsys):
    code = main(["convert", str(ckpt), "--out", str(tmp_path / "o"), "--stream", "always", "--text", "hi"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--stream always" in err and "--text" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("stream", ["auto", "always"])
def test_rotation_online_streams(ckpt, tmp_path, capsys, stream):
    """Issue 26 item 3: --rotate and --rotate-online stream (tests/stream/test_stream_rotate.py: bytes, block-wise
    verification); auto and always both stream, verified, with `--stream never`'s tensors."""
    flag = ["--rotate", "orthogonal", "--rotate-online"]
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "s"), "--stream", stream, "-q", "--json", *flag]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "normfold.stream" in " ".join(report["notes"]) and report["verification"]["passed"] is True
    assert report["structure"]["rotation"]["kind"] == "orthogonal" and report["structure"]["rotation"]["online"]
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "m"), "--stream", "never", "-q", "--json", *flag]) == 0
    assert "normfold.stream" not in " ".join(json.loads(capsys.readouterr().out)["notes"])
    assert tensors_bytes(tmp_path / "s") == tensors_bytes(tmp_path / "m")


def _streamed_notes(capsys) -> bool:
    return "normfold.stream" in " ".join(json.loads(capsys.readouterr().out)["notes"])


@pytest.mark.parametrize("target", [[], ["--to", "crmsnorm"], ["--to", "crmsnorm", "--pad"]])
def test_auto_streams_every_local_safetensors_checkpoint(ckpt, tmp_path, capsys, target):
    """The default rule (issue 26): a local safetensors checkpoint streams whatever its size, for every
    streamed target; the output is what --stream never writes."""
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "o"), "-q", "--json", *target]) == 0
    assert _streamed_notes(capsys)
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "m"), "-q", "--json", "--stream", "never",
                 *target]) == 0
    assert not _streamed_notes(capsys)
    assert tensors_bytes(tmp_path / "o") == tensors_bytes(tmp_path / "m")


@pytest.mark.parametrize("extra", [["--text", "hello"], ["--option", "x=1"], ["--dtype", "float64"],
                                   ["--dry-run"], ["--to", "un"]])
def test_auto_keeps_in_memory_what_needs_the_model(ckpt, tmp_path, capsys, extra):
    code = main(["convert", str(ckpt), "--out", str(tmp_path / "o"), "-q", "--json", *extra])
    out = capsys.readouterr().out
    assert code in (0, 1, 2)  # whatever the in-memory path makes of the option
    assert "normfold.stream" not in out


def test_auto_converts_normfold_checkpoints_and_odd_sources_in_memory(ckpt, tmp_path, capsys):
    """A normfold checkpoint as MODEL (reverse conversion) and a checkpoint that mixes floating dtypes (which
    `prepare` refuses) go through the in-memory path."""
    from safetensors.torch import load_file, save_file

    # (Pre-CRMSNorm --to rmsnorm / layernorm stream back: tests/stream/test_stream_reverse_cli.py); Pre-RMSNorm
    # --to crmsnorm is a forward conversion of a normfold model, in memory
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "rms"), "-q", "--to", "rmsnorm"]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "rms"), "--to", "crmsnorm", "--out", str(tmp_path / "back"), "-q",
                 "--json"]) == 0
    assert not _streamed_notes(capsys)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in ckpt.iterdir():
        (mixed / f.name).write_bytes(f.read_bytes())
    shard = sorted(mixed.glob("*.safetensors"))[0]
    state = load_file(shard)
    name = sorted(state)[0]
    state[name] = state[name].double()
    save_file(state, shard, metadata={"format": "pt"})
    main(["convert", str(mixed), "--out", str(tmp_path / "mixed-out"), "-q", "--json"])
    assert "normfold.stream" not in capsys.readouterr().out


@pytest.mark.parametrize("stream", ["always", "never"])
def test_locked_output_fails_cleanly(ckpt, tmp_path, capsys, stream):
    lock = tmp_path / ".out.lock"
    lock.write_text(f"{os.getpid()}\n")  # a live process is writing tmp_path/out
    code = main(["convert", str(ckpt), "--out", str(tmp_path / "out"), "--stream", stream, "-q"])
    assert code == 2
    assert "another normfold conversion is writing" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock"]  # nothing written, its lock untouched


def test_stale_lock_of_a_dead_process_is_taken_over(ckpt, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".out.lock").write_text(f"{dead.pid}\n")
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "out"), "-q"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_interrupt_leaves_nothing(ckpt, tmp_path, monkeypatch):
    from normfold.stream import safetensors_io

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors_io, "write_tensor", boom)  # every streamed output writes tensors
    code = main(["convert", str(ckpt), "--out", str(tmp_path / "out"), "--stream", "always", "-q"])
    assert code == 130
    assert not any(tmp_path.iterdir())


def _cli(ckpt, out) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.Popen([sys.executable, "-m", "normfold", "convert", str(ckpt), "--out", str(out),
                             "--stream", "always", "-q"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_processes_two_outputs(ckpt, tmp_path):
    procs = [_cli(ckpt, tmp_path / "a"), _cli(ckpt, tmp_path / "b")]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    assert tensors_bytes(tmp_path / "a") == tensors_bytes(tmp_path / "b")
    files = sorted(f.name for f in (tmp_path / "a").iterdir() if f.suffix == ".safetensors")
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_disk_full_is_a_user_error(ckpt, tmp_path, capsys, monkeypatch):
    import errno

    from normfold.stream import writer as stream_writer_mod

    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stream_writer_mod, "_preallocate", full)
    code = main(["convert", str(ckpt), "--out", str(tmp_path / "out"), "--stream", "always", "-q"])
    assert code == 2
    err = capsys.readouterr().err
    assert "No space left" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("extra", [[], ["--fold-final"], ["--to", "crmsnorm"], ["--to", "crmsnorm", "--pad"],
                                   ["--to", "crmsnorm", "--pad", "--fold-final", "--allow-new-bias"],
                                   ["--to", "crmsnorm", "--fold-final", "--allow-new-bias"]])
def test_large_sources_are_verified_block_by_block(ckpt, tmp_path, capsys, monkeypatch, extra):
    """Above the in-memory threshold the streamed output is verified by normfold.stream.blockverify: same
    verdict and the same float64 level as the in-memory verification of the same conversion. Every streamed
    target passes (issue 26 item 3: `--pad`'s d-wide zero-padded stream too); `--fold-final` leaves the final
    norm's output out (its γ is in the head), as the in-memory check does."""
    from normfold.cli import convert_stream as stream_cli

    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "out"), "--stream", "always", "-q", "--json",
                 *extra]) == 0
    v = json.loads(capsys.readouterr().out)["verification"]
    assert v["passed"] is True and "blockwise" in v and v["fp64"]["passed"] is True
    assert v["blockwise"]["failed_blocks"] == []
    assert "pending" not in json.dumps(v)


def test_blockwise_verification_catches_a_wrong_streamed_tensor(ckpt, tmp_path, capsys, monkeypatch):
    """A streamed conversion that wrote one wrong tensor is refused and nothing is written."""
    from normfold.cli import convert_stream as stream_cli
    from normfold.stream import executor as stream_convert_mod

    real = stream_convert_mod.stream_convert

    def corrupting(source_dir, out_dir, **kw):
        report = real(source_dir, out_dir, **kw)
        from safetensors.torch import load_file, save_file

        for f in sorted(Path(out_dir).glob("*.safetensors")):
            state = load_file(f)
            name = next((k for k in state if k.endswith("h.1.mlp.c_proj.weight")), None)
            if name is not None:
                state[name] = state[name] + 1e-2
                save_file(state, f, metadata={"format": "pt"})
                break
        else:
            raise AssertionError("no tensor to corrupt")
        return report

    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(stream_cli, "stream_convert", corrupting)
    code = main(["convert", str(ckpt), "--out", str(tmp_path / "out"), "--stream", "always", "-q"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "verification failed" in captured.err and "Traceback" not in captured.err
    assert list(tmp_path.iterdir()) == []


def test_a_bad_readahead_setting_is_refused_and_nothing_is_written(ckpt, tmp_path, capsys, monkeypatch):
    """NORMFOLD_VERIFY_READAHEAD other than 0 / 1 (stream.readahead): exit 2, one message naming it, no output,
    no temp dir or lock left."""
    from normfold.cli import convert_stream as stream_cli

    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    monkeypatch.setenv("NORMFOLD_VERIFY_READAHEAD", "yes")
    code = main(["convert", str(ckpt), "--out", str(tmp_path / "out"), "--stream", "always", "-q"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "NORMFOLD_VERIFY_READAHEAD" in captured.err and "Traceback" not in captured.err
    assert list(tmp_path.iterdir()) == []
