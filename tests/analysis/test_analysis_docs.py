"""docs/analyze.md's Python example runs as written (and its conversion verifies)."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "analyze.md"


def test_python_example_runs(capsys):
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    exec(compile(block, str(DOC), "exec"), {})
    assert "5 of 5 LayerNorms are now RMSNorms" in capsys.readouterr().out


def test_rules_table_lists_every_registered_rule_kind():
    from normfold.analysis.rules import RULES

    section = DOC.read_text().split("### The op rules")[1].split("\n\n")[1]
    documented = {line.split("|")[1].strip().lower() for line in section.splitlines()[2:]}
    registered = {r.kind.replace(" (eval)", "").lower() for r in RULES.values()}
    assert registered <= documented, registered - documented
