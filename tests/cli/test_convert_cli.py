"""`normfold convert` / `normfold verify` from the command line: outputs, exit codes and every
error path (message checked, nothing written, no traceback)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import perturb_norms
from normfold.cli import main

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)
    perturb_norms(GPT2LMHeadModel(cfg).eval()).save_pretrained(d)
    return d


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code, err, expected_code, pattern):
    assert code == expected_code
    assert pattern in err, err
    assert "Traceback" not in err


def test_convert_writes_a_verified_checkpoint(tiny_dir, tmp_path, capsys):
    out = tmp_path / "rms"
    code, stdout, err = run_cli(["convert", tiny_dir, "--out", out], capsys)
    assert code == 0, err
    assert "float64: converted vs original" in stdout and "pass" in stdout
    assert "[1/2] converting" in err and "[2/2] verifying" in err  # progress on stderr (streamed: issue 26)
    rep = json.loads((out / "normfold.json").read_text())
    assert rep["verification"]["passed"] and rep["verification"]["fp64"]["max_rel_error"] <= 1e-9
    assert rep["source"]["model"] == str(tiny_dir)
    # the tiny GPT-2 is tied: the head stays tied to the original table (a Recenter after wte); stock
    # transformers reloads it too (its LayerNorms re-centre their input)
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert "transformer.wte" in rep["structure"]["recenter_after"]
    assert "stock transformers: yes (from_pretrained); normfold.load: yes (tied head kept as one tensor)" in stdout
    assert "parameters" in stdout and "weight bytes" in stdout and "on disk" in stdout


def test_json_output(tiny_dir, capsys):
    code, stdout, _ = run_cli(["convert", tiny_dir, "--dry-run", "--json", "-q"], capsys)
    assert code == 0
    rep = json.loads(stdout)
    assert rep["layernorms"]["converted"] == 5 and rep["variant"] == "rmsnorm"


def test_missing_model_path(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", tmp_path / "does-not-exist", "--out", out], capsys)
    assert_clean_error(code, err, 2, "no such directory")
    assert not out.exists()


def test_directory_without_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", tmp_path / "empty", "--out", out], capsys)
    assert_clean_error(code, err, 2, "no config.json")
    assert not out.exists()


def test_a_file_is_not_a_model(tmp_path, capsys):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    code, _, err = run_cli(["convert", f, "--out", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "is a file")
    assert not (tmp_path / "out").exists()


def test_broken_config_is_not_a_model(tmp_path, capsys):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{ not json")
    code, _, err = run_cli(["convert", d, "--out", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "could not be loaded")
    assert not (tmp_path / "out").exists()


def test_config_without_weights(tmp_path, tiny_dir, capsys):
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((tiny_dir / "config.json").read_text())
    code, _, err = run_cli(["convert", d, "--out", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "could not be loaded")
    assert not (tmp_path / "out").exists()


def test_existing_output_directory(tiny_dir, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(["convert", tiny_dir, "--out", out], capsys)
    assert_clean_error(code, err, 2, "already exists")
    assert "--force" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, _, err = run_cli(["convert", tiny_dir, "--out", out, "--force", "-q"], capsys)
    assert code == 0 and not (out / "keep.txt").exists() and (out / "normfold.json").exists()


def test_unsupported_architecture(tmp_path, capsys):
    """No adapter: the analysis' plan is tried (issue 13); a Post-LN XLNet with trained-looking γ/β has no
    LayerNorm that can be converted, so it is refused with the analysis' reasons."""
    from transformers import XLNetConfig, XLNetModel

    d = tmp_path / "xlnet"
    torch.manual_seed(0)
    perturb_norms(XLNetModel(XLNetConfig(vocab_size=50, d_model=16, n_layer=1, n_head=2, d_inner=32))).save_pretrained(d)
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", d, "--out", out], capsys)
    assert_clean_error(code, err, 2, "no LayerNorm of XLNetModel can be converted")
    assert "0 of 2 foldable" in err and "normfold analyze" in err
    assert not out.exists()


def test_verification_failure_exits_1_and_writes_nothing(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(["convert", tiny_dir, "--out", out, "--fp64-tol", "0"], capsys)
    assert_clean_error(code, err, 1, "verification failed")
    assert "FAIL" in stdout and "nothing was written" in err
    assert not out.exists()
    code, _, err = run_cli(["convert", tiny_dir, "--out", out, "--fp64-tol", "0", "--save-failed", "-q"], capsys)
    assert code == 1 and json.loads((out / "normfold.json").read_text())["verification"]["passed"] is False


def test_out_is_required_without_dry_run(tiny_dir, capsys):
    code, _, err = run_cli(["convert", tiny_dir], capsys)
    assert_clean_error(code, err, 2, "--out DIR is required")


def test_bad_option_value(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--to", "nonsense", "--out", "x"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "zero-mean" in top and "exit codes" in top and "normfold convert --out" in top
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    sub = capsys.readouterr().out
    for word in ("--keep-affine", "--force", "float64", "bundled", "stock_reloadable", "exit codes"):
        assert word in sub


def test_verify_command(tiny_dir, tmp_path, capsys):
    out = tmp_path / "rms"
    assert run_cli(["convert", tiny_dir, "--out", out, "-q"], capsys)[0] == 0
    code, stdout, _ = run_cli(["verify", tiny_dir, out, "-q"], capsys)
    assert code == 0 and "PASS" in stdout
    code, stdout, _ = run_cli(["verify", tiny_dir, out, "-q", "--json"], capsys)
    assert json.loads(stdout)["passed"] is True
    # a corrupted conversion is caught
    from safetensors.torch import load_file, save_file

    weights = out / "model.safetensors"  # tied head kept, in the stock layout
    sd = load_file(weights)
    sd["transformer.h.1.mlp.c_proj.weight"] += 0.01
    save_file(sd, weights)
    code, stdout, _ = run_cli(["verify", tiny_dir, out, "-q"], capsys)
    assert code == 1 and "FAIL" in stdout


def test_console_entry_point_runs(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "normfold", "--version"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("normfold ")
    proc = subprocess.run([sys.executable, "-m", "normfold", "convert", str(tmp_path / "nope"), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr
    assert not Path(tmp_path / "o").exists()


def test_options_are_refused_by_targets_that_take_none(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", tiny_dir, "--out", out, "--option", "warmup=5"], capsys)
    assert_clean_error(code, err, 2, "--to rmsnorm takes no options")
    assert "un" in err and not out.exists()
