"""Terminal output helpers shared by the subcommands: progress steps on stderr, aligned tables."""

from __future__ import annotations

import sys
import time


class Steps:
    """Prints '[k/N] what ...' on stderr as work starts, and the elapsed time when it ends."""

    def __init__(self, total: int, quiet: bool = False, stream=None) -> None:
        self.total, self.k, self.quiet = total, 0, quiet
        self.stream = stream or sys.stderr
        self.times: dict[str, float] = {}
        self._t = None
        self._name = None

    def start(self, name: str, what: str) -> None:
        self.end()
        self.k += 1
        self._name, self._t = name, time.perf_counter()
        if not self.quiet:
            print(f"[{self.k}/{self.total}] {what} ...", file=self.stream, flush=True)

    def note(self, msg: str) -> None:
        if not self.quiet:
            print(f"      {msg}", file=self.stream, flush=True)

    def end(self) -> None:
        if self._name is not None:
            self.times[self._name] = time.perf_counter() - self._t
            self._name = None


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
