"""Timing harness: warm-up, interleaved rounds, medians and quartiles.

Interleaving (every round runs each candidate once, in rotating order) keeps slow drifts of the
machine (frequency, other processes, page cache) from favouring whichever candidate ran first.
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Stats:
    median: float  # seconds
    q25: float
    q75: float
    n: int
    samples: tuple[float, ...] = ()  # one per round, in round order (what `paired` pairs up)

    @classmethod
    def of(cls, samples: list[float]) -> "Stats":
        q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
        return cls(median=q[1], q25=q[0], q75=q[2], n=len(samples), samples=tuple(samples))


def paired(test: Stats, ref: Stats) -> Stats:
    """Stats of the per-round ratios test / ref. `measure` times every candidate once per round, back
    to back, so a round's ratio cancels the drifts of a shared machine that move both (another
    tenant, clock changes); its quartiles are far tighter than those of the two medians' ratio."""
    if not test.samples or len(test.samples) != len(ref.samples):
        raise ValueError("paired() needs the per-round samples of two candidates of one measure() call")
    return Stats.of([t / r for t, r in zip(test.samples, ref.samples)])


def ratio_verdict(ratio: Stats) -> str:
    """'slower' when the test took longer than the reference in more than three rounds of four
    (the paired ratio's lower quartile is above 1), 'faster' in the mirror case, else 'same'."""
    if ratio.q25 > 1.0:
        return "slower"
    if ratio.q75 < 1.0:
        return "faster"
    return "same"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(candidates: dict[str, Callable[[], object]], *, rounds: int = 30, warmup: int = 3,
            min_time: float = 2e-3, device: str = "cpu", tick: Callable[[], None] | None = None) -> dict[str, Stats]:
    """Time each zero-argument callable; one sample = `inner` calls, chosen so a sample lasts at least
    `min_time` (short ops would otherwise be dominated by timer resolution). Returns seconds per call."""
    names = list(candidates)
    inner = {}
    for name in names:
        fn = candidates[name]
        for _ in range(warmup):
            fn()
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        once = max(time.perf_counter() - t, 1e-7)
        inner[name] = max(1, int(min_time / once))
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn, k = candidates[name], inner[name]
            _sync(device)
            t = time.perf_counter()
            for _ in range(k):
                fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t) / k)
        if tick is not None:
            tick()
    return {n: Stats.of(s) for n, s in samples.items()}


def cuda_graphed(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """A callable that replays `calls` invocations of `fn` captured in one CUDA graph: timing it
    measures the kernels alone, without Python's per-launch overhead (divide by `calls`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (autotuning, allocator) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def machine_info() -> dict:
    """What the numbers were measured on (goes into every benchmark output)."""
    from ..ops import cpu

    cpu_name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu_name, "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "normfold_cpu_kernel": cpu.status()["available"],
        "normfold_cpu_isa": cpu.status()["isa"],  # the kernel's ISA path (None: PyTorch fallback)
        "normfold_cpu_call": cpu.status()["call"],  # pycall extension or ctypes (normfold/ops/pycall.py)
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        from ..ops import triton_kernels

        info["triton"] = triton_kernels.status()["version"]
    return info


class Bar:
    """A one-line progress bar on stderr (no dependency).

    `total` counts units of work; a step may be worth several (`step(n)`). The time left is the
    measured time per unit of the recent steps (the last RECENT of them) times the units left, so
    it follows the step times as they change (a float32 pass then a bfloat16 one 10x slower),
    instead of assuming every step costs the average so far."""

    RECENT = 20

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        import collections
        import sys

        self.total, self.k, self.label, self.enabled, self.stream = total, 0, label, enabled, sys.stderr
        self.t0 = self._last = time.perf_counter()
        self._recent = collections.deque(maxlen=self.RECENT)  # (seconds, units) of the last steps
        self._draw()

    def eta(self) -> float:
        units = sum(u for _, u in self._recent)
        if not units:
            return 0.0
        return sum(t for t, _ in self._recent) / units * max(0, self.total - self.k)

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * min(self.k, self.total) / max(1, self.total))
        el = time.perf_counter() - self.t0
        self.stream.write(f"\r{self.label} [{'#' * done}{'.' * (width - done)}] {self.k}/{self.total} "
                          f"{el:5.0f}s elapsed, ~{self.eta():4.0f}s left ")
        self.stream.flush()

    def step(self, n: int = 1) -> None:
        now = time.perf_counter()
        self._recent.append((now - self._last, n))
        self._last = now
        self.k += n
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def steady_allocator() -> str:
    """Keep freed memory mapped so timings do not include page faults (see the module docstring)."""
    if os.environ.get("NORMFOLD_BENCH_ALLOCATOR", "").lower() == "default" or platform.libc_ver()[0] != "glibc":
        return "default"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "default"
    m_trim_threshold, m_mmap_max = -1, -4
    if mallopt(m_trim_threshold, 1 << 30) and mallopt(m_mmap_max, 0):
        return "glibc: no trim, no mmap"
    return "default"
