"""The family registry (normfold.adapters.families) is the one list of families: every adapter module of the
package is named by exactly one entry, in the order `find_adapter` tries them, the entries' names resolve
(each adapter is called as its family), and every family gives tiny examples (its adapter's, or the entry's
own when the analysis derives its plan). The fused block modules are checked in
tests/fastpath/test_fused_registry.py (fastpath sits above the adapters)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import normfold.adapters as adapters
from normfold.adapters import FAMILIES, Family, family_examples, get_adapter, get_family, list_adapters
from normfold.errors import NormfoldError

ADAPTERS_DIR = Path(adapters.__file__).parent


def _defines_adapter(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id in ("ADAPTER", "ADAPTERS") for t in targets):
            return True
    return False


def test_every_adapter_module_is_named_by_exactly_one_family():
    modules = sorted(p.stem for p in ADAPTERS_DIR.glob("*.py") if _defines_adapter(p))
    named = [f.adapter for f in FAMILIES if f.adapter is not None]
    assert sorted(named) == modules
    assert len(set(named)) == len(named)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


def test_registry_order_is_the_match_order_and_names_agree():
    builtin = [a.name for a in list_adapters()][:sum(f.adapter is not None for f in FAMILIES)]
    assert builtin == [f.name for f in FAMILIES if f.adapter is not None]
    for f in FAMILIES:
        assert isinstance(f, Family) and get_family(f.name) is f
        want = get_adapter(f.name).examples if f.adapter is not None else f.examples
        assert family_examples(f.name) == want and want, f"{f.name}: every family gives tiny examples"


def test_an_adapter_carries_its_own_examples():
    with pytest.raises(ValueError, match="ADAPTER.examples"):
        Family("x", adapter="x", examples=family_examples("dinov2"))


def test_unknown_family_says_what_is_known():
    with pytest.raises(NormfoldError, match="gpt2"):
        get_family("no-such-family")
