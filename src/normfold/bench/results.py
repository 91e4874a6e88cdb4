"""Benchmark outputs: CSV + markdown (+ PNG when matplotlib is installed), with the machine info."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def machine_tag(machine: dict) -> str:
    """A short name for the machine in result folder names: the CPU family and normfold's kernel path
    ("epyc-avx2", "xeon-avx512"), "+gpu" where a GPU was used."""
    cpu = (machine.get("cpu") or "").lower()
    family = next((f for f in ("epyc", "xeon", "ryzen", "core", "neoverse", "graviton", "apple") if f in cpu), None)
    if family is None:
        family = "".join(ch for ch in (cpu.split() or ["cpu"])[0] if ch.isalnum()) or "cpu"
    tag = f"{family}-{machine.get('normfold_cpu_isa') or 'portable'}"
    return tag + ("+gpu" if machine.get("gpu") else "")


def default_out(suite: str, machine: dict, date: str | None = None) -> Path:
    """Where a suite's results go unless --out says otherwise: benchmarks/<suite>/<machine>-<date>
    (benchmarks/README.md)."""
    import datetime

    date = date or datetime.date.today().isoformat()
    return Path("benchmarks") / suite / f"{machine_tag(machine)}-{date}"


def write(rows: list[dict], name: str, out_dir: str | Path, machine: dict, columns: list[str],
          title: str, plot=None, extra: str | None = None) -> dict[str, Path]:
    """`extra`: more markdown (a summary table, notes) appended after the main table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / f"{name}.csv", "md": out / f"{name}.md", "json": out / f"{name}.machine.json"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else columns)
        w.writeheader()
        w.writerows(rows)
    paths["json"].write_text(json.dumps(machine, indent=2) + "\n")
    paths["md"].write_text(markdown(rows, columns, title, machine) + (f"\n{extra}" if extra else ""))
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            paths["png"] = out / f"{name}.png"
            plot(rows, paths["png"], machine)
        except ImportError:
            pass
    return paths


def markdown(rows: list[dict], columns: list[str], title: str, machine: dict) -> str:
    head = f"### {title}\n\nMachine: {machine_line(machine)}\n\n"
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return head + "\n".join(lines) + "\n"


def machine_line(m: dict) -> str:
    parts = [m.get("cpu", "?"), f"{m.get('logical_cores')} cores", f"torch {m.get('torch')}",
             f"{m.get('torch_threads')} threads"]
    if m.get("gpu"):
        parts.insert(0, f"{m['gpu']} (CUDA {m.get('cuda')})")
    return ", ".join(str(p) for p in parts)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)
