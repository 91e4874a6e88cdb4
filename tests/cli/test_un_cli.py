"""`normfold convert MODEL --to un` -> fine-tune -> `normfold fuse DIR --out DIR2`, and every error path
of `fuse` (exit code, message, nothing written)."""

import json

import pytest
import torch

import normfold
from helpers import perturb_norms, rel_err
from normfold.cli import main
from normfold.nn import FoldedNorm, UnifiedNorm

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)
    perturb_norms(GPT2LMHeadModel(cfg).eval()).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def trained_un_dir(tiny_dir, tmp_path_factory):
    """convert --to un, load, fine-tune a few steps, save: what a user hands to `normfold fuse`."""
    root = tmp_path_factory.mktemp("un")
    code = main(["convert", str(tiny_dir), "--to", "un", "--out", str(root / "un"), "-q",
                 "--option", "warmup=2", "--option", "M=3", "--option", "M_grad=2"])
    assert code == 0
    model = normfold.load(root / "un").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        ids = torch.randint(0, 97, (4, 12), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    normfold.save(model.eval(), model.normfold_report, root / "trained")
    return root


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


IDS = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(3))


def test_convert_to_un_writes_a_loadable_unverified_checkpoint(tiny_dir, trained_un_dir, capsys):
    rep = json.loads((trained_un_dir / "un" / "normfold.json").read_text())
    assert rep["variant"] == "un" and rep["stock_reloadable"] is False
    v = rep["verification"]
    assert v["performed"] is False and v["passed"] is None and "not output-exact" in v["reason"]
    assert rep["layernorms"]["converted"] == 5 and rep["layernorms"]["kept"] == []
    assert rep["structure"]["norms"][0]["options"]["M"] == 3
    loaded = normfold.load(trained_un_dir / "un")
    ln = loaded.transformer.h[0].ln_1
    assert isinstance(ln, UnifiedNorm) and (ln.M, ln.M_grad, ln.warmup) == (3, 2, 2)
    stock = GPT2LMHeadModel.from_pretrained(tiny_dir)
    assert torch.equal(ln.weight, stock.transformer.h[0].ln_1.weight)  # initialised from the LN's γ, β
    assert torch.equal(ln.bias, stock.transformer.h[0].ln_1.bias)
    code, out, err = run_cli(["convert", tiny_dir, "--to", "un", "--dry-run"], capsys)
    assert code == 0 and "verification: not performed" in out


def test_trained_state_round_trips_through_save_and_load(trained_un_dir):
    loaded = normfold.load(trained_un_dir / "trained")
    ln = loaded.transformer.h[1].ln_2
    assert int(ln.step) == 6 and int(ln.grad_step) == 6
    assert not torch.equal(ln.running_var, torch.ones_like(ln.running_var))


def test_fuse_writes_a_verified_norm_free_checkpoint(trained_un_dir, capsys):
    out = trained_un_dir / "fused"
    code, stdout, err = run_cli(["fuse", trained_un_dir / "trained", "--out", out], capsys)
    assert code == 0, err
    assert "float64: fused vs unfused" in stdout and "pass" in stdout
    rep = json.loads((out / "normfold.json").read_text())
    assert rep["variant"] == "un-fused" and rep["verification"]["passed"]
    assert rep["verification"]["fp64"]["max_rel_error"] <= 1e-9
    assert {n["type"] for n in rep["structure"]["norms"]} == {"FoldedNorm"}
    assert (out / "normfold_model.safetensors").exists() and not (out / "model.safetensors").exists()
    fused = normfold.load(out)
    unfused = normfold.load(trained_un_dir / "trained")
    assert isinstance(fused.transformer.ln_f, FoldedNorm)
    assert not any(isinstance(m, (torch.nn.LayerNorm, UnifiedNorm)) for m in fused.modules())
    with torch.no_grad():
        assert rel_err(fused(input_ids=IDS).logits, unfused(input_ids=IDS).logits) < 1e-5


def test_fuse_keep_final_and_force(trained_un_dir, capsys):
    out = trained_un_dir / "fused-keep"
    assert run_cli(["fuse", trained_un_dir / "trained", "--out", out, "--keep-final", "-q"], capsys)[0] == 0
    rep = json.loads((out / "normfold.json").read_text())
    types = {n["name"]: n["type"] for n in rep["structure"]["norms"]}
    assert types["transformer.ln_f"] == "FixedAffine"
    loaded = normfold.load(out)
    with torch.no_grad():
        ref = normfold.load(trained_un_dir / "trained")
        assert rel_err(loaded(input_ids=IDS).logits, ref(input_ids=IDS).logits) < 1e-5
    code, _, err = run_cli(["fuse", trained_un_dir / "trained", "--out", out, "-q"], capsys)
    assert code == 2 and "already exists" in err and "Traceback" not in err
    assert run_cli(["fuse", trained_un_dir / "trained", "--out", out, "--force", "-q"], capsys)[0] == 0
    assert {n["type"] for n in json.loads((out / "normfold.json").read_text())["structure"]["norms"]} == {"FoldedNorm"}


@pytest.mark.parametrize("case", ["missing", "not-normfold", "no-offline-norms"])
def test_fuse_errors_exit_2_with_a_message_and_write_nothing(case, tiny_dir, tmp_path, capsys):
    if case == "missing":
        src, expect = tmp_path / "nope", "no such directory"
    elif case == "not-normfold":
        src, expect = tiny_dir, "not a normfold checkpoint"
    else:
        src = tmp_path / "rms"
        assert main(["convert", str(tiny_dir), "--out", str(src), "-q"]) == 0
        expect = "no offline norms"
    out = tmp_path / "out"
    code, _, err = run_cli(["fuse", src, "--out", out], capsys)
    assert code == 2 and expect in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("option,expect", [("window=3", "unknown option"), ("M=two", "must be int"),
                                           ("M=1", "cannot build UnifiedNorm"), ("warmup", "KEY=VALUE")])
def test_convert_un_option_errors(option, expect, tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", tiny_dir, "--to", "un", "--out", out, "--option", option], capsys)
    assert code == 2 and expect in err and "Traceback" not in err, err
    assert not out.exists()
