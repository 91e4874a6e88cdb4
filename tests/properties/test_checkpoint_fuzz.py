"""Fuzzing what a shared checkpoint can hold (issue 29 item 4): real `normfold.json` reports (Pre-RMSNorm,
Pre-CRMSNorm, UnifiedNorm) and a real shard index are mutated (fields deleted, renamed, retyped, set out of
range or to another field's value, traversal paths, symlinks in and out of the directory, truncated text),
and every outcome must be a clean load or a `NormfoldError`: never another exception, never a file written.

The default run is short (NORMFOLD_FUZZ_EXAMPLES, default 60 per test). The long run is slow-marked and runs
only when asked for (slow tests run by default here, and it takes minutes):

    NORMFOLD_FUZZ_LONG=5000 python -m pytest -q -s -m slow tests/properties/test_checkpoint_fuzz.py

(5,000 per test, 10,000 in all; docs/safety.md has its count and time).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
transformers = pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import normfold  # noqa: E402
from helpers import perturb_norms  # noqa: E402
from normfold import checkpoint_guard  # noqa: E402
from normfold.cli import main  # noqa: E402
from normfold.errors import NormfoldError  # noqa: E402
from normfold.stream.blockverify import CheckpointReader  # noqa: E402
from normfold.stream.executor import open_source  # noqa: E402

SHORT = int(os.environ.get("NORMFOLD_FUZZ_EXAMPLES", "60"))
LONG = int(os.environ.get("NORMFOLD_FUZZ_LONG", "0"))
long_run = pytest.mark.skipif(LONG <= 0, reason="the long fuzz run: set NORMFOLD_FUZZ_LONG=5000 (cases per test)")
INDEX = "model.safetensors.index.json"
REPORT = "normfold.json"


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# ---- the real files ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A sharded GPT-2 source, its Pre-RMSNorm / Pre-CRMSNorm / UnifiedNorm conversions, and a file outside."""
    root = tmp_path_factory.mktemp("fuzz")
    src = root / "src"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    perturb_norms(GPT2LMHeadModel(cfg).eval()).save_pretrained(src, max_shard_size="12KB")
    (src / "tokenizer.json").write_text("{}")
    outs = {}
    for to in ("rmsnorm", "crmsnorm", "un"):
        outs[to] = root / to
        assert main(["convert", str(src), "--to", to, "--out", str(outs[to]), "--stream", "never", "-q"]) == 0
    secret = root / "outside" / "secret.json"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"weight_map": {}, "format_version": 2, "variant": "rmsnorm"}))
    return {"root": root, "src": src, "outside": secret, **outs,
            "reports": {k: json.loads((v / REPORT).read_text()) for k, v in outs.items()},
            "index": json.loads((src / INDEX).read_text())}


def snapshot(root: Path) -> dict:
    """Every path under `root` with its size and whether it is a link (what 'nothing written' compares)."""
    return {str(p.relative_to(root)): (p.is_symlink(), p.lstat().st_size if not p.is_dir() else None)
            for p in root.rglob("*")}


# ---- mutations of a JSON document ----------------------------------------------------------------------------

HOSTILE = ["", ".", "..", "../../etc/passwd", "/etc/passwd", "../outside/secret.json", "transformer.__class__.forward",
           "__class__", "transformer.h.0.__dict__", "transformer.h.9.ln_1", "transformer.h.0.attn", "lm_head",
           "transformer.wte", "transformer.wte.weight", "transformer.h.0.ln_1", "transformer.h.1.ln_2",
           "RMSNorm", "CRMSNorm", "StreamCRMSNorm", "UnifiedNorm", "OfflineNorm", "FoldedNorm", "FixedAffine", "bn",
           "float64", "bfloat16", "model.safetensors", "normfold_model.safetensors", "config.json", "\x00", "x" * 300,
           "link-out.safetensors", "link-in.safetensors", "subdir", "0" * 64]
NUMBERS = [0, 1, -1, 2, 15, 16, 17, 191, 10**12, -(10**12), 2**53 + 1, 2**63, 10**400 // 10**300, 0.5, -0.0, 1e-5,
           1e308, float("nan"), float("inf"), float("-inf")]

scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(HOSTILE))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(HOSTILE[:20]) | st.text(max_size=6),
                                                                       inner, max_size=3)), max_leaves=6)


def nodes(doc, path=()):
    """Every (path) to a value in the document, the root excluded."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for k, v in items:
        out.append(path + (k,))
        out.extend(nodes(v, path + (k,)))
    return out


def _at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def mutate(doc, data):
    """One mutation at a random place of `doc` (in place); returns the document (the root may be replaced)."""
    places = nodes(doc)
    op = data.draw(st.sampled_from(["delete", "rename", "retype", "nudge", "copy", "dup", "root"]))
    if op == "root" or not places:
        return data.draw(values)
    path = data.draw(st.sampled_from(places))
    parent, key = _at(doc, path[:-1]), path[-1]
    if op == "delete":
        del parent[key]
    elif op == "rename" and isinstance(parent, dict):
        new = data.draw(st.sampled_from(HOSTILE) | st.sampled_from([p[-1] for p in places if isinstance(p[-1], str)]))
        parent[new] = parent.pop(key)
    elif op == "nudge" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = data.draw(st.sampled_from([parent[key] + 1, parent[key] - 1, parent[key] * 1000, -parent[key],
                                                 float(parent[key])]))
    elif op == "copy":  # another field's (well-formed) value, where it does not belong
        parent[key] = copy.deepcopy(_at(doc, data.draw(st.sampled_from(places))))
    elif op == "dup" and isinstance(parent[key], list) and parent[key]:
        parent[key].append(copy.deepcopy(parent[key][0]))
    else:
        parent[key] = data.draw(values)
    return doc


def draw_text(doc, data) -> str:
    for _ in range(data.draw(st.integers(1, 3))):
        doc = mutate(doc, data)
    text = json.dumps(doc, allow_nan=True)
    if data.draw(st.integers(0, 9)) == 0:  # truncated, or junk appended
        text = data.draw(st.sampled_from([text[: len(text) // 2], text + "}", text.replace('"', "'", 1)]))
    return text


def _expect_clean(fn) -> bool:
    """Run `fn`: True if it returned, False on a NormfoldError; any other exception fails the test."""
    try:
        fn()
        return True
    except NormfoldError as exc:
        assert str(exc).strip(), "a NormfoldError without a message"
        return False


# ---- reports ---------------------------------------------------------------------------------------------------

def _check_report(world, data):
    which = data.draw(st.sampled_from(["rmsnorm", "crmsnorm", "un"]))
    d = world[which]
    text = draw_text(copy.deepcopy(world["reports"][which]), data)
    before = snapshot(world["root"])
    secret = world["outside"].read_text()
    report = d / REPORT
    link = data.draw(st.integers(0, 19)) == 0  # the report (or the tokenizer) a link out of the directory
    try:
        if link:
            world["outside"].write_text(text)
            report.unlink()
            victim = data.draw(st.sampled_from([REPORT, "tokenizer.json"]))
            if victim != REPORT:
                report.write_text(text)
                shutil.move(d / victim, d.parent / f"{which}.{victim}.bak")
            (d / victim).symlink_to(world["outside"])
        else:
            report.write_text(text)
        loaded = _expect_clean(lambda: normfold.load(d))
        if link:
            assert not loaded, "a report or tokenizer outside the directory was read"
    finally:
        world["outside"].write_text(secret)
        for name in (REPORT, "tokenizer.json"):
            if (d / name).is_symlink():
                (d / name).unlink()
        bak = d.parent / f"{which}.tokenizer.json.bak"
        if bak.exists():
            shutil.move(bak, d / "tokenizer.json")
        report.write_text(json.dumps(world["reports"][which], indent=2) + "\n")
    after = snapshot(world["root"])
    assert after == before, "a file was written"
    return loaded


def _run_reports(world, n: int) -> list[bool]:
    outcomes: list[bool] = []

    @fuzz_settings(n)
    @given(data=st.data())
    def run(data):
        outcomes.append(_check_report(world, data))

    run()
    return outcomes


def test_fuzzed_reports_load_or_refuse(world):
    outcomes = _run_reports(world, SHORT)
    # the mutations reach past the JSON parser: some still load (a free-text field changed), most are refused
    assert 0 < sum(outcomes) < len(outcomes), (sum(outcomes), len(outcomes))


@pytest.mark.slow
@long_run
def test_fuzzed_reports_long(world):
    outcomes = _run_reports(world, LONG)
    print(f"\nfuzzed reports: {len(outcomes)} cases, {sum(outcomes)} loaded, {len(outcomes) - sum(outcomes)} refused "
          "with a NormfoldError, 0 other exceptions")


# ---- shard indexes ------------------------------------------------------------------------------------------------

def _names_outside(text: str, d: Path) -> bool:
    """An independent oracle: does the index's weight_map name a file that is not a regular file inside `d`
    (a path, a traversal, a link that leads out)?"""
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        return False
    root = d.resolve()
    for v in wm.values():
        if not isinstance(v, str):
            continue
        if "\x00" in v:  # no file has that name
            return True
        p = Path(os.path.normpath(os.path.join(str(d), v)))
        real = Path(os.path.realpath(p))
        if p.parent != d or root not in real.parents:
            return True
    return False


def _check_index(world, data):
    d = world["src"]
    doc = copy.deepcopy(world["index"])
    shards = sorted(set(doc["weight_map"].values()))
    extra = []
    original = (d / INDEX).read_text()
    before = snapshot(world["root"])
    try:
        if data.draw(st.booleans()):  # point an entry at a traversal path, an absolute path or a link
            target = data.draw(st.sampled_from(["../outside/secret.json", "/etc/passwd", str(world["outside"]),
                                                "link-out.safetensors", "link-in.safetensors", "subdir",
                                                "missing.safetensors", "./" + shards[0], shards[0] + "/", "..", ""]))
            if target == "link-out.safetensors":
                shutil.copy(d / shards[0], world["outside"].parent / "shard.safetensors")
                extra.append(world["outside"].parent / "shard.safetensors")
                (d / target).symlink_to(world["outside"].parent / "shard.safetensors")
                extra.append(d / target)
            elif target == "link-in.safetensors":
                (d / target).symlink_to(shards[0])
                extra.append(d / target)
            elif target == "subdir":
                (d / target).mkdir()
                extra.append(d / target)
            key = data.draw(st.sampled_from(sorted(doc["weight_map"])))
            doc["weight_map"][key] = target
        text = draw_text(doc, data) if data.draw(st.booleans()) else json.dumps(doc)
        during = snapshot(world["root"])
        (d / INDEX).write_text(text)
        results = [_expect_clean(lambda: checkpoint_guard.inspect_checkpoint(d)),
                   _expect_clean(lambda: open_source(d)), _expect_clean(lambda: CheckpointReader(d))]
        if _names_outside(text, d):
            assert not any(results), "a shard outside the directory was accepted"
        (d / INDEX).write_text(original)
        assert snapshot(world["root"]) == during, "a file was written"
        return all(results)
    finally:
        (d / INDEX).write_text(original)
        for p in reversed(extra):
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        assert snapshot(world["root"]) == before


def _run_indexes(world, n: int) -> list[bool]:
    outcomes: list[bool] = []

    @fuzz_settings(n)
    @given(data=st.data())
    def run(data):
        outcomes.append(_check_index(world, data))

    run()
    return outcomes


def test_fuzzed_indexes_read_or_refuse(world):
    outcomes = _run_indexes(world, SHORT)
    assert 0 < sum(outcomes) < len(outcomes), (sum(outcomes), len(outcomes))


@pytest.mark.slow
@long_run
def test_fuzzed_indexes_long(world):
    outcomes = _run_indexes(world, LONG)
    print(f"\nfuzzed indexes: {len(outcomes)} cases, {sum(outcomes)} read by all three readers, "
          f"{len(outcomes) - sum(outcomes)} refused with a NormfoldError, 0 other exceptions")
