"""Terminal output helpers shared by the subcommands: progress steps on stderr, aligned tables."""

from __future__ import annotations

import sys
import time

from ..tables import sci, table  # noqa: F401  (re-exported for the subcommands)


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


def skipped_lines(result: dict) -> list[str]:
    """'  not compared: NAMES: WHY', one line per reason, of a verification result's `skipped` outputs."""
    by_why: dict[str, list[str]] = {}
    for name, why in (result.get("skipped") or {}).items():
        by_why.setdefault(why, []).append(name)
    return [f"  not compared: {', '.join(names)}: {why}" for why, names in by_why.items()]
