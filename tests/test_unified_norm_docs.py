"""The python examples of docs/unified-norm.md run as written (in order, one namespace)."""

import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "unified-norm.md"


def test_doc_examples_run(capsys):
    pytest.importorskip("transformers")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace: dict = {}
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "float64 relative error" in out and "not output-exact" in out
