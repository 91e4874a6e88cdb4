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
    ("normfold.analysis", "normfold.autoplan"),
    ("normfold.report", "normfold.sizes", "normfold.convert", "normfold.verify", "normfold.io",
     "normfold.fastpath"),
    ("normfold.compress", "normfold.unified", "normfold.train", "normfold.stream", "normfold.rotate",
     "normfold.deploy", "normfold.quant", "normfold.engines"),
    ("normfold.bench",),
    ("normfold.cli",),
    # the package's face, and the old module names kept for one release (they re-export a moved module)
    ("normfold", "normfold.__main__", "normfold.un", "normfold.fuse", "normfold.autoplan"),
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
    fake = [("normfold.ops.cpu", "normfold.cli", None), ("normfold.stream.convert", "normfold.convert", "_kept"),
            ("normfold.cli", "normfold.ops", None)]
    monkeypatch.setattr(__import__(__name__), "imports", lambda: fake)
    assert upward() == {("normfold.ops.cpu", "normfold.cli")}
    assert private() == {("normfold.stream.convert", "normfold.convert._kept")}


if __name__ == "__main__":
    for a, b in sorted(upward()):
        print(f"upward   {a} -> {b}")
    for a, b in sorted(private()):
        print(f"private  {a} imports {b}")
