"""Render the README's results table from the result files under benchmarks/.

    python benchmarks/render_readme.py          # rewrite the table in README.md
    python benchmarks/render_readme.py --check  # exit 1 (and print a diff) when README.md differs

Every row of the table is one `[[row]]` of benchmarks/readme.toml: a claim, one result file under
benchmarks/<suite>/<machine>-<date>/ and one key into it, a format, the command that reproduces the file and
the docs page with the full table. The machine and date come from the folder name; the machine's description
from the `*.machine.json` beside the file. The table sits in README.md between the two marker comments
START and END below; nothing between them is edited by hand.

Keys: for a JSON file, a dotted path (`verification.fp64.max_rel_error`; list items by index). For a CSV file,
a column name plus `where = {column = "value", ...}`, which must select exactly one row. A format is a Python
format string applied to the number (`"{:.2f}"`, `"{:.1e}"`, `"{:+,d}"` for an integer, `"{:.0%}"`); an optional
`verdict` names a second column of the same CSV row, shown in parentheses (the paired timing's faster / same / slower);
an optional `also` lists more keys of the same file for a format with several fields (a value and its bound).
Adding a result to the README: put the file in its suite folder and add one `[[row]]`.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import re
import sys
import tomllib
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
README = ROOT / "README.md"
SPEC = BENCH / "readme.toml"
START = "<!-- results: rendered by `python benchmarks/render_readme.py` from benchmarks/readme.toml; do not edit -->"
END = "<!-- results: end -->"
FOLDER = re.compile(r"^(?P<machine>[a-z0-9]+(?:-[a-z0-9]+)*)-(?P<date>\d{4}-\d{2}-\d{2})$")


class RenderError(Exception):
    pass


def _value(path: Path, row: dict, key: str):
    if path.suffix == ".json":
        value = json.loads(path.read_text())
        for part in key.split("."):
            value = value[int(part)] if isinstance(value, list) else value[part]
        return value
    if path.suffix == ".csv":
        where = row.get("where", {})
        with open(path, newline="") as f:
            hits = [r for r in csv.DictReader(f) if all(r.get(k) == str(v) for k, v in where.items())]
        if len(hits) != 1:
            raise RenderError(f"{path.relative_to(ROOT)}: where={where} selects {len(hits)} rows, not 1")
        text = hits[0][key]
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text
    raise RenderError(f"{path}: only .json and .csv result files are read")


def _machine(folder: Path) -> tuple[str, str, dict]:
    m = FOLDER.match(folder.name)
    if not m or folder.parent.parent != BENCH:
        raise RenderError(f"{folder.relative_to(ROOT)}: results live in benchmarks/<suite>/<machine>-<YYYY-MM-DD>/")
    infos = sorted(folder.glob("*.machine.json"))
    info = json.loads(infos[0].read_text()) if infos else {}
    return m["machine"], m["date"], info


def describe(info: dict) -> str:
    """Fallback when readme.toml's [machines] has no line for a machine: CPU, cores, torch, GPU if any."""
    parts = [f"{info.get('logical_cores', '?')}-core {info.get('cpu', '?')}"]
    if info.get("gpu"):
        parts.append(info["gpu"])
    parts.append(f"torch {info.get('torch', '?')}")
    return ", ".join(parts)


def render(spec_path: Path = SPEC) -> str:
    """The markdown between the markers (without them)."""
    spec = tomllib.loads(spec_path.read_text())
    lines = ["| claim | result | machine, date | command |", "| --- | --- | --- | --- |"]
    machines: dict[str, str] = {}
    for row in spec["row"]:
        path = BENCH / row["file"]
        if not path.is_file():
            raise RenderError(f"benchmarks/{row['file']}: no such result file")
        machine, date, info = _machine(path.parent)
        machines.setdefault(machine, spec.get("machines", {}).get(machine) or describe(info))
        values = [_value(path, row, k) for k in (row["key"], *row.get("also", []))]
        value = row["format"].format(*values)
        if row.get("verdict"):  # a text column of the same row, e.g. the paired timing's faster / same / slower
            value += f" ({_value(path, row, row['verdict'])})"
        claim = f"[{row['claim']}]({row['docs']})" if row.get("docs") else row["claim"]
        source = f"[{machine}, {date}](benchmarks/{Path(row['file']).parent.as_posix()}/)"
        lines.append(f"| {claim} | {row.get('prefix', '')}{value}{row.get('suffix', '')} | {source} | "
                     f"`{row['command']}` |")
    legend = "; ".join(f"`{name}`: {text}" for name, text in sorted(machines.items()))
    return "\n".join(lines) + f"\n\nMachines: {legend}.\n"


def replace(text: str, table: str) -> str:
    if text.count(START) != 1 or text.count(END) != 1:
        raise RenderError("README.md must hold the START and END markers once each")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when README.md is not what would be rendered")
    args = p.parse_args(argv)
    try:
        old = README.read_text()
        new = replace(old, render())
    except (RenderError, KeyError, ValueError) as e:
        print(f"render_readme: {e}", file=sys.stderr)
        return 2
    if args.check:
        if old != new:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "README.md",
                                                       "rendered"))
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
