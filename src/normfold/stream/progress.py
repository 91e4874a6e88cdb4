"""One time-left estimate for a whole streamed command: the conversion and its verification as phases of
one job, each weighted by its measured cost, so that the estimate printed while the shards are written
already counts the verification still to come (before, it counted the conversion only and fell to ~0 s
with about two thirds of the command still ahead).

Each phase reports the fraction of itself that is done; the estimate is the average rate since the start
(elapsed seconds per unit of weighted work) times the work left. It does not follow single slow or fast
steps; if a phase is slower than its weight says, the estimate rises gradually, never in one jump
(tests/stream/test_progress_lines.py runs it on a fake clock).
"""

from __future__ import annotations

import time

# Cost per element of the checkpoint, relative to the streamed conversion's (measured on 2 vCPUs, a 1.68 GB
# float32 GPT-2-style checkpoint, d = 1600: conversion 3.4 s; verification 7.1 s in five passes, see
# docs/large-checkpoints.md, "Verification cost, overlap and the time left"). Per element rather than per byte: the passes
# cost what their matrix products and float64 casts cost, whatever the stored dtype.
CONVERT_WEIGHT = 1.0
# the conversion's weight per target (measured on the same checkpoint: --to crmsnorm convert 7.2 s, verify 9.0 s;
# the way back --to layernorm from its rmsnorm conversion, convert 5.6 s, verify 8.1 s, under load 5)
CONVERT_WEIGHTS = {"rmsnorm": CONVERT_WEIGHT, "crmsnorm": 1.6, "layernorm": 1.4}
# --rotate: the float64 products t·Q cost O(d) per element, so this holds near d = 1600 only (measured there:
# quiet, convert 39.1 s, verify 6.9 s: 2.04 × 39.1 / 6.9); at other widths the estimate moves gradually, as for
# any phase
ROTATE_CONVERT_WEIGHT = 11.0
VERIFY_PASS_WEIGHTS = (0.52, 0.66, 0.08, 0.41, 0.37)  # blockverify's passes 1..5, in order
IN_MEMORY_VERIFY_WEIGHT = 1.0  # small sources (verified in memory): one step, about the conversion's cost



class Work:
    """Phases with weights (any unit: only their ratios matter); `update(phase, fraction)` records how
    much of a phase is done (0..1, never going back); `left()` is the seconds left, or None at first."""

    MIN_SECONDS = 0.5  # no estimate before this much time and some work: the rate is still noise

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = {k: max(0.0, float(w)) for k, w in weights.items()}
        self.fraction = dict.fromkeys(weights, 0.0)
        self.t0 = time.perf_counter()

    def update(self, phase: str, fraction: float) -> None:
        if phase in self.fraction:
            self.fraction[phase] = max(self.fraction[phase], min(1.0, max(0.0, fraction)))

    def done(self) -> float:
        """The weighted fraction of the whole job done (0..1)."""
        total = sum(self.weights.values())
        if total <= 0:
            return 1.0
        return sum(self.weights[k] * f for k, f in self.fraction.items()) / total

    def left(self) -> float | None:
        elapsed = time.perf_counter() - self.t0
        d = self.done()
        if d <= 0 or elapsed < self.MIN_SECONDS:
            return None
        return elapsed * (1.0 - d) / d

    def suffix(self) -> str:
        """', ~N s left' for a progress line ('' while there is no estimate yet)."""
        left = self.left()
        return "" if left is None else f", ~{left:.0f} s left"



class PassProgress:
    """Block-wise verification's share of a `Work`: its k-th pass (`start`, weight `VERIFY_PASS_WEIGHTS[k]`)
    advances by the fraction of that pass's elements done so far (`done(elements)`, as each unit is freed).
    With `say`, a line `  <pass>: N %, ~S s left` at most every GAP seconds within a pass (the pass's own line
    starts it)."""

    GAP = 1.0

    def __init__(self, work: Work | None, say=None, phase: str = "verify") -> None:
        self.work, self.say, self.phase = work, say, phase
        self.weights = VERIFY_PASS_WEIGHTS
        self.k, self.total, self.seen, self.label, self.last = -1, 1, 0, "", 0.0

    def start(self, label: str | None, total_elements: int) -> None:
        self.k = min(self.k + 1, len(self.weights) - 1)
        self.label, self.total, self.seen, self.last = label or "", max(1, total_elements), 0, time.perf_counter()
        self._push()

    def done(self, elements: int) -> None:
        self.seen += elements
        self._push()
        if self.work is not None and self.say is not None and self.seen < self.total \
                and time.perf_counter() - self.last >= self.GAP:
            self.last = time.perf_counter()
            self.say(f"  {self.label}: {100 * self.seen // self.total} %{self.work.suffix()}")

    def _push(self) -> None:
        if self.work is None or self.k < 0:
            return
        w = self.weights
        within = min(1.0, self.seen / self.total)
        self.work.update(self.phase, (sum(w[:self.k]) + w[self.k] * within) / sum(w))



class Reporter:
    """A progress callback (`say(message)`) that carries the command's `Work`: the streamed writer and the
    block-wise verifier find it as `say.work` and put its time left on their lines."""

    def __init__(self, say, work: Work) -> None:
        self.say, self.work = say, work

    def __call__(self, msg: str) -> None:
        self.say(msg)
