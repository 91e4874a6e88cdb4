"""normfold's layers depend one way (docs/architecture.md, issue 27): a module imports only from its own
layer or lower ones, and never a private `_name` defined in another module. Imports made inside functions
count (a deferred import hides an upward dependency from Python, not from the design).

When this test was written it found 9 upward and 16 private imports; all were fixed, so it allows none.
`python tests/test_layers.py` prints every current offender."""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import SRC, _module_name, _resolve

# lowest first; a module belongs to the first layer whose prefix matches it (longest prefix wins)
LAYERS: list[tuple[str, ...]] = [
    ("normfold._version", "normfold.errors", "normfold.options", "normfold.modelinfo", "normfold.forward",
     "normfold.tables"),
    ("normfold.ops",),
    ("normfold.algebra",),
    ("normfold.nn",),
    ("normfold.checkpoint", "normfold.checkpoint_guard"),
    ("normfold.adapters",),
    ("normfold.analysis",),
    ("normfold.report", "normfold.sizes", "normfold.conversion", "normfold.verify", "normfold.io",
     "normfold.fastpath"),
    ("normfold.compress", "normfold.unified", "normfold.train", "normfold.stream", "normfold.rotate",
     "normfold.deploy", "normfold.quant", "normfold.engines"),
    ("normfold.bench",),
    ("normfold.cli",),
    # the package's face
    ("normfold", "normfold.__main__"),
]

def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            # the package itself ("normfold") names only its face: a new module must be placed explicitly
            inside = module.startswith(p + ".") and p != "normfold"
            if (module == p or inside) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def imports() -> list[tuple[str, str, str | None]]:
    """(importer, imported module, imported name or None) for every import of a normfold module."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    out = []
    for mod, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, None) for a in node.names if a.name.startswith("normfold")]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_package, node)
                if not base.startswith("normfold"):
                    continue
                for a in node.names:
                    if f"{base}.{a.name}" in files:
                        out.append((mod, f"{base}.{a.name}", None))
                    else:
                        out.append((mod, base, a.name))
    return out


def is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward() -> set[tuple[str, str]]:
    bad = set()
    for importer, imported, _ in imports():
        # a package's __init__ may gather its own submodules
        if is_within(imported, importer):
            continue
        if layer_of(imported) > layer_of(importer):
            bad.add((importer, imported))
    return bad


def private() -> set[tuple[str, str]]:
    bad = set()
    for importer, imported, name in imports():
        if name is None or not name.startswith("_") or name.startswith("__"):
            continue
        if imported == importer:
            continue
        bad.add((importer, f"{imported}.{name}"))
    return bad


def _module_aliases(mod: str, is_package: bool, tree: ast.AST, files: set[str]) -> set[str]:
    """Names bound in `mod` to another normfold module (`import normfold.x as y`, `from . import x`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("normfold") and a.name != mod:
                    names.add(a.asname or a.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_package, node)
            for a in node.names:
                if f"{base}.{a.name}" in files and f"{base}.{a.name}" != mod:
                    names.add(a.asname or a.name)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def rebinding(sources: dict[str, tuple[bool, str]] | None = None) -> set[tuple[str, str]]:
    """Run-time reach into another normfold module: an attribute assigned (or `setattr`, `delattr`) on a name
    bound to one, and `importlib.import_module` of a normfold module other than the importer's own submodules
    (`f"{__name__}.{name}"`, how a registry loads its parts). Either would let one module patch or reach
    another past the import rules above."""
    if sources is None:  # {module: (is a package, source text)}
        sources = {_module_name(p): (p.name == "__init__.py", p.read_text()) for p in SRC.rglob("*.py")}
    files = {_module_name(p) for p in SRC.rglob("*.py")}
    bad = set()
    for mod, (is_package, text) in sources.items():
        tree = ast.parse(text, mod)
        aliases = _module_aliases(mod, is_package, tree, files)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _root(t) in aliases:
                    bad.add((mod, f"assigns {ast.unparse(t)}"))
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func in ("setattr", "delattr") and node.args and _root(node.args[0]) in aliases:
                bad.add((mod, f"{func}({ast.unparse(node.args[0])}, ...)"))
            if func in ("importlib.import_module", "import_module", "__import__") and node.args:
                arg = node.args[0]
                own = isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.FormattedValue) \
                    and ast.unparse(arg.values[0].value) == "__name__"
                literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                # f"transformers.{name}": a literal prefix outside normfold says where the import goes
                foreign = isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant) \
                    and not str(arg.values[0].value).startswith("normfold")
                if not own and not foreign and (not literal or arg.value.startswith("normfold")):
                    bad.add((mod, f"{func}({ast.unparse(arg)})"))
    return bad


def test_no_module_patches_or_reaches_another_at_run_time():
    bad = sorted(rebinding())
    assert not bad, "run-time reach into another normfold module (pass what it needs instead): " + ", ".join(
        f"{a} {b}" for a, b in bad)


def test_the_run_time_check_sees_a_patch_and_an_import_module():
    patched = """
import importlib
from ..compress import crmsnorm as compress_convert
from .. import errors
_convert = importlib.import_module("normfold.conversion")
_other = importlib.import_module(f"normfold.{name}")
_convert._is_zero = lambda t: True
compress_convert.head_unchanged = None
setattr(errors, "X", 1)
"""
    registry = """
import importlib
mod = importlib.import_module(f"{__name__}.gpt2")
hf = importlib.import_module(f"transformers.{name}")
"""
    assert rebinding({"normfold.stream.plan": (False, patched)}) == {
        ("normfold.stream.plan", 'importlib.import_module(\'normfold.conversion\')'),
        ("normfold.stream.plan", "importlib.import_module(f'normfold.{name}')"),
        ("normfold.stream.plan", "assigns compress_convert.head_unchanged"),
        ("normfold.stream.plan", "setattr(errors, ...)")}
    assert rebinding({"normfold.adapters": (True, registry)}) == set()


def test_layers_cover_every_module():
    for p in SRC.rglob("*.py"):
        layer_of(_module_name(p))


def test_no_upward_import():
    bad = sorted(upward())
    assert not bad, "imports into a higher layer (invert them with a registry, or move the code): " + ", ".join(
        f"{a} -> {b}" for a, b in bad)


def test_no_private_import_across_modules():
    bad = sorted(private())
    assert not bad, "private names imported from another module (give them a public name): " + ", ".join(
        f"{a} imports {b}" for a, b in bad)


def test_the_checks_see_an_upward_and_a_private_import(monkeypatch):
    fake = [("normfold.ops.cpu", "normfold.cli", None), ("normfold.stream.executor", "normfold.conversion", "_kept"),
            ("normfold.cli", "normfold.ops", None)]
    monkeypatch.setattr(__import__(__name__), "imports", lambda: fake)
    assert upward() == {("normfold.ops.cpu", "normfold.cli")}
    assert private() == {("normfold.stream.executor", "normfold.conversion._kept")}


if __name__ == "__main__":
    for a, b in sorted(upward()):
        print(f"upward   {a} -> {b}")
    for a, b in sorted(private()):
        print(f"private  {a} imports {b}")
    for a, b in sorted(rebinding()):
        print(f"reach    {a} {b}")
