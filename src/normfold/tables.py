"""Plain-text tables and number formatting shared by reports and the command line (base layer: the
analysis report prints with it, so it cannot live in cli/)."""

from __future__ import annotations


def table(rows: list[list[str]], header: list[str] | None = None, indent: str = "  ") -> str:
    """Left-aligned columns (plain text, no box drawing, safe to paste into issues)."""
    all_rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) if i < len(r) else 0 for r in all_rows) for i in range(max(map(len, all_rows)))]
    lines = []
    for j, r in enumerate(all_rows):
        lines.append(indent + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if header and j == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sci(x: float | None) -> str:
    if x is None:
        return "-"
    if x == float("inf"):
        return "inf"
    return f"{x:.2e}"
