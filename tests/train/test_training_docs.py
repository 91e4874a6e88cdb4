"""The python examples of docs/training.md run as written (in order, one namespace)."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def test_doc_examples_run(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "prepared for rmsnorm training" in out and "loss after 3 steps" in out
    assert "True" in out and "PreparedLayerNorm" not in out


def test_readme_example_runs(capsys):
    """The README's Python example (convert, save, load, stock reload, analyze, train with θ) runs as written."""
    pytest.importorskip("transformers")
    readme = (DOC.parents[1] / "README.md").read_text()
    section = readme.split("## Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    from normfold import train

    assert namespace["report"].verification["passed"] and "True" in capsys.readouterr().out
    assert not train.is_prepared(namespace["model"])
