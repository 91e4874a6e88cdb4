"""normfold.fastpath takes its fused blocks from the family registry (normfold.adapters.families): every module
of normfold.fastpath.families is named by exactly one family's `fused`, defines `BLOCKS` (and `STACKS` where it
hands off) and registers nothing itself, and what is registered is exactly what those modules define.

Generic check for every family with fused blocks: each tiny example (first head class),
converted to rmsnorm, saved and loaded fast and with fast=False, gives float64 outputs <= 1e-12 apart and
<= 1e-9 from the original; the blocks it fuses are the family's own, and at least one example fuses.
(Kernel path, generate(), export and training: tests/fastpath/test_fused_families.py.)"""

from __future__ import annotations

import ast
import fnmatch
import importlib
from pathlib import Path

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold import fastpath
from normfold.adapters import FAMILIES, example_inputs, family_examples, get_adapter
from normfold.fastpath import blocks, handoff
from normfold.fastpath import families as fused_families

pytest.importorskip("transformers")

FUSED_DIR = Path(fused_families.__file__).parent


def _module(name):
    return importlib.import_module(f"normfold.fastpath.families.{name}")


def test_every_fused_module_is_named_by_exactly_one_family():
    modules = sorted(p.stem for p in FUSED_DIR.glob("*.py") if not p.stem.startswith("_"))
    named = [m for f in FAMILIES for m in f.fused]
    assert sorted(named) == modules
    assert list(fused_families.REGISTERED) == named


def test_fused_modules_define_blocks_and_register_nothing():
    for f in FAMILIES:
        for name in f.fused:
            tree = ast.parse((FUSED_DIR / f"{name}.py").read_text())
            calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
            assert not calls & {"register", "register_stack", "blocks.register", "handoff.register_stack"}, name
            mod = _module(name)
            assert mod.BLOCKS and all(isinstance(b, blocks.FusedBlock) for b in mod.BLOCKS), name
            assert all(isinstance(s, handoff.Stack) for s in getattr(mod, "STACKS", ())), name


def test_registered_blocks_and_stacks_are_the_registry_modules():
    mods = [_module(m) for f in FAMILIES for m in f.fused]
    specs = [b for m in mods for b in m.BLOCKS]
    assert sorted(map(id, specs)) == sorted(id(s) for v in blocks.FUSED_BLOCKS.values() for s in v)
    stacks = [s for m in mods for s in getattr(m, "STACKS", ())]
    assert sorted(map(id, stacks)) == sorted(map(id, handoff.STACKS.values()))


def _prep(t, name, patterns):
    """A stream output is returned recentred (the report's centered_outputs): compare it centred."""
    t = t.double()
    return t - t.mean(-1, keepdim=True) if any(fnmatch.fnmatchcase(name, p) for p in patterns) else t


def _family_block_names(family):
    return {b.class_name for m in family.fused for b in _module(m).BLOCKS}


FUSED = [f for f in FAMILIES if f.fused]


@pytest.mark.parametrize("family", FUSED, ids=[f.name for f in FUSED])
def test_family_examples_fuse_their_own_blocks_exactly(tmp_path, family):
    own = _family_block_names(family)
    fused_any = 0
    for i, example in enumerate(family_examples(family.name)):
        if family.adapter is not None and "rmsnorm" not in get_adapter(family.name).capabilities.variants:
            continue
        torch.manual_seed(0)
        model = realistic(example.build(example.heads[0], torch.float64))
        inputs = example_inputs(model, torch.Generator().manual_seed(0))  # the adapter's, or from the config
        conv, report = normfold.convert(model, verify=False)
        normfold.save(conv, report, tmp_path / str(i))
        fast = normfold.load(tmp_path / str(i)).double()
        plain = normfold.load(tmp_path / str(i), fast=False).double()
        fused = {type(m).__name__ for m in fast.modules() if fastpath.is_fused(m)}
        assert fused <= own, (example.name, fused - own)
        assert not any(fastpath.is_fused(m) for m in plain.modules())
        fused_any += bool(fused)
        ref, slow, got = run_flat(model, inputs), run_flat(plain, inputs), run_flat(fast, inputs)
        assert ref and set(got) == set(slow)
        for name in slow:
            assert rel_err(got[name], slow[name]) <= 1e-12, (example.name, name)
            pats = report.centered_outputs
            assert rel_err(_prep(got[name], name, pats), _prep(ref[name], name, pats)) <= 1e-9, (example.name, name)
    assert fused_any, f"no tiny example of {family.name} runs its fused blocks"
