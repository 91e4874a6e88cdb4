"""Timing harness: warm-up, interleaved rounds, medians and quartiles.

Interleaving (every round runs each candidate once, in rotating order) keeps slow drifts of the
machine (frequency, other processes, page cache) from favouring whichever candidate ran first.
"""

from __future__ import annotations

import contextlib
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

    `total` counts units of work; a step may be worth several (`step(n)`). `weights` (one per unit,
    default 1) say what each unit costs relative to the others, e.g. `forward_cost` of its model and
    dtype. The time left is the average rate since the start (elapsed seconds per unit of weight,
    model building and warm-ups included) times the weight left, as `stream.progress.Work` computes
    it: a slow setting after fast ones (bfloat16 after float32, GPT-3 Medium after ViT-Ti) is already
    in the estimate from the first line; time in `paused()` blocks (building the next setting's models)
    is left out of the rate, so a one-off pause does not multiply it. (The estimate used to be the
    last 20 steps' rate, which followed such changes in a jump: `bench e2e` printed "~8 s left" over
    the first ViT rounds, then "~600 s left" on GPT-3 Medium.)"""

    def __init__(self, total: int, label: str, enabled: bool = True, weights=None) -> None:
        import sys

        self.total, self.k, self.label, self.enabled, self.stream = total, 0, label, enabled, sys.stderr
        if weights is not None and len(weights) != total:
            raise ValueError(f"Bar: {len(weights)} weights for {total} units")
        # cumulative weight after k units, so a step of n units costs O(1)
        self._cum = [0.0]
        for w in (weights if weights is not None else [1.0] * total):
            self._cum.append(self._cum[-1] + max(0.0, float(w)))
        self.t0 = time.perf_counter()
        self._paused = 0.0  # seconds spent in `paused()` blocks: shown as elapsed, not in the rate
        self._draw()

    @contextlib.contextmanager
    def paused(self):
        """Work outside the weighted units (building and converting the next setting's models): its time
        stays out of the rate, so a long one-off pause does not multiply the estimate."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - t

    def done(self) -> float:
        """The weighted fraction of the work done (0..1)."""
        return self._cum[min(self.k, self.total)] / self._cum[-1] if self._cum[-1] > 0 else 1.0

    def eta(self) -> float:
        d = self.done()
        if d <= 0:
            return 0.0
        return (time.perf_counter() - self.t0 - self._paused) * (1.0 - d) / d

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * min(self.k, self.total) / max(1, self.total))
        el = time.perf_counter() - self.t0
        left = f"~{self.eta():4.0f}s left" if self.k else "time left after the first step"
        self.stream.write(f"\r{self.label} [{'#' * done}{'.' * (width - done)}] {self.k}/{self.total} "
                          f"{el:5.0f}s elapsed, {left} ")
        self.stream.flush()

    def step(self, n: int = 1) -> None:
        self.k += n
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def measure_weights(rounds: int, candidates: int, seconds: float, min_time: float, warmup: int) -> list[float]:
    """`Bar` weights of one `measure` call's ticks (one per round) when one call takes ~`seconds`: a round
    runs each candidate for at least `min_time`; the first tick also carries the warm-up and the
    calibration call of every candidate."""
    per_round = candidates * max(seconds, min_time)
    return [per_round + candidates * (warmup + 1) * seconds] + [per_round] * (rounds - 1)


def norm_times_weights(repeats: int, models: int, seconds: float) -> list[float]:
    """`Bar` weights of `model.norm_times`' ticks (one per hooked forward; the first also warms every model up)."""
    return [seconds * (1 + models)] + [seconds] * (repeats * models - 1)


def forward_cost(dim: int, depth: int, mlp: int, tokens: int, head_rows: int = 0, batch: int = 1,
                 dtype: torch.dtype = torch.float32) -> float:
    """Estimated seconds of one forward of a Pre-LN transformer stack on this CPU, for progress lines
    only: its multiply-adds (QKV + output projection 4d², MLP 2d·mlp, attention scores and values
    2·tokens·d per token and layer, a head of `head_rows` outputs) at this machine's GEMM rate in
    `dtype` (`gemm_seconds_per_mac`; bfloat16 is 0.5–10x float32's depending on the CPU)."""
    per_token = depth * (4 * dim * dim + 2 * dim * mlp + 2 * tokens * dim) + head_rows * dim
    return batch * tokens * per_token * gemm_seconds_per_mac(dtype)


_GEMM_RATE: dict = {}


def gemm_seconds_per_mac(dtype: torch.dtype, n: int = 384) -> float:
    """Seconds per multiply-add of an n×n×n matrix product in `dtype` on this CPU, for the progress
    lines' weights: CPU time of the product on one thread (the fastest of up to 20 within ~50 ms; CPU
    time, because other processes on a shared machine stretch the wall clock, not the work) divided
    by torch's thread count. Cached per dtype."""
    if dtype not in _GEMM_RATE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            a = torch.randn(n, n).to(dtype)
            b = torch.randn(n, n).to(dtype)
            a @ b  # warm-up (oneDNN primitive creation)
            best, start = float("inf"), time.perf_counter()
            for _ in range(20):
                t = time.process_time()
                a @ b
                best = min(best, time.process_time() - t)
                if time.perf_counter() - start > 0.05:
                    break
        finally:
            torch.set_num_threads(threads)
        _GEMM_RATE[dtype] = max(best, 1e-9) / n ** 3 / threads
    return _GEMM_RATE[dtype]


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
