"""`normfold bench model`: end-to-end inference time of a model before and after conversion.

Candidates: the original (LayerNorm), the converted model with normfold's RMSNorm, and the same
converted model with a naive RMSNorm (torch's F.rms_norm) to show why the kernel matters on CPU.
"""

from __future__ import annotations

import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F

from .results import write
from .timing import Bar, machine_info, measure, paired, ratio_verdict, steady_allocator

COLUMNS = ["model", "dtype", "batch", "seq", "original_ms", "converted_ms", "naive_rms_ms",
           "converted/original", "naive/original", "converted_vs_original", "original_norm_ms", "converted_norm_ms",
           "norm converted/original", "hook_overhead_us"]
NOTES = ("X/original: the median over rounds of each round's X / original time (paired; every round runs each "
         "model once, back to back); converted_vs_original: 'slower'/'faster' when that held in more than three "
         "rounds of four. "
         "original_norm_ms / converted_norm_ms: time inside the norm modules per forward (median of "
         "{repeats} forwards, timed with forward hooks, less hook_overhead_us per norm call: the hooks' "
         "own cost, measured around an nn.Identity); the two models' forwards interleaved, and norm "
         "converted/original the median over forwards of each pair's ratio).")


NORM_REPEATS = 50


class _Hooked:
    """Times every call of `modules` with a forward pre-hook and a forward hook; `calls` collects
    (seconds) per call. Closing removes the hooks."""

    def __init__(self, modules):
        self.calls: list[float] = []
        start = {}
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args: start.__setitem__(id(mod), time.perf_counter())))
            self._handles.append(m.register_forward_hook(
                lambda mod, args, out: self.calls.append(time.perf_counter() - start[id(mod)])))

    def close(self):
        for h in self._handles:
            h.remove()


def hook_overhead(repeats: int = 2000) -> float:
    """Seconds the two timing hooks add to one timed call: the median interval they measure around
    an nn.Identity. It is the same for every module (0.65-0.68 µs on the Zen 5 EPYC), so norm_times
    subtracts it per call; left in, it pulls a fast norm's ratio towards 1 at decode sizes."""
    ident, x = torch.nn.Identity(), torch.empty(0)
    hooked = _Hooked([ident])
    try:
        for _ in range(repeats):
            ident(x)
    finally:
        hooked.close()
    return statistics.median(hooked.calls[repeats // 10:])


def norm_times(runs: dict, repeats: int = NORM_REPEATS, tick=None, overhead: float | None = None) -> dict:
    """Milliseconds spent inside norm modules (LayerNorm / normfold norms) in each forward, per model:
    `runs` maps a name to (model, zero-argument forward). Timed with forward hooks, less the hooks'
    own cost per call (`overhead`, seconds; measured by hook_overhead() when not given). The models'
    forwards are interleaved, one of each per repeat in rotating order, so a drift of the machine
    reaches them alike and forward i of one model pairs with forward i of another."""
    from ..nn import CRMSNorm, RMSNorm

    overhead = hook_overhead() if overhead is None else overhead
    names = list(runs)
    hooked = {k: _Hooked([m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, RMSNorm, CRMSNorm))])
              for k, (model, _) in runs.items()}
    out: dict[str, list[float]] = {k: [] for k in names}
    try:
        for k in names:
            runs[k][1]()  # warm-up
        for i in range(repeats):
            for k in names[i % len(names):] + names[:i % len(names)]:
                calls = hooked[k].calls
                calls.clear()
                runs[k][1]()
                out[k].append((sum(calls) - len(calls) * overhead) * 1e3)
                if tick is not None:
                    tick()
    finally:
        for h in hooked.values():
            h.close()
    return out


def median_ms(per_forward: list[float]) -> float:
    """The median of norm_times' per-forward values (never below 0: the hook cost is subtracted)."""
    return max(0.0, statistics.median(per_forward))


def norm_time(model, run, repeats: int = NORM_REPEATS, tick=None, overhead: float | None = None) -> float:
    """The median over `repeats` forwards of norm_times for one model (ms). End-to-end medians of a
    small model move by a few percent between runs; this isolates the part of the forward the
    conversion changes."""
    return median_ms(norm_times({"m": (model, run)}, repeats, tick, overhead)["m"])


def paired_norm_ratio(test: list[float], ref: list[float]) -> float:
    """Median over forwards of test / ref norm time (forwards paired by norm_times' interleaving)."""
    return statistics.median(t / r for t, r in zip(test, ref) if r > 0) if any(r > 0 for r in ref) else math.nan


def verdict(test, ref) -> str:
    """From the per-round (paired) ratio test / ref: 'slower' / 'faster' when it holds in more than
    three rounds of four, else 'same (within noise)'."""
    v = ratio_verdict(paired(test, ref))
    return "same (within noise)" if v == "same" else v


def _naive(model):
    """Converted model whose RMSNorms call F.rms_norm (plus bias) instead of normfold's kernel."""
    from ..nn import RMSNorm

    naive = copy.deepcopy(model)
    for m in naive.modules():
        if isinstance(m, RMSNorm):
            def fwd(x, m=m):
                y = F.rms_norm(x, m.normalized_shape, m.weight, m.eps)
                return y if m.bias is None else y + m.bias
            m.forward = fwd
    return naive


# --to crmsnorm adds the Pre-CRMSNorm model on the d−1 stream and its zero-padded d-wide form (paper 001 §3.4.2).
CRMS_COLUMNS = ["crms_ms", "crms_pad_ms", "crms/original", "crms/converted", "crms_pad/converted",
                "crms_vs_converted", "crms_pad_vs_converted", "crms_norm_ms"]


def run(model_path=None, out_dir="benchmarks", dtypes=("float32", "bfloat16"), shapes=((1, 128), (8, 256)),
        rounds: int = 15, progress: bool = True, name: str | None = None, to: str = "rmsnorm"):
    from ..conversion import convert
    from ..io import load_source

    from .. import ops

    machine = machine_info()
    machine["allocator"] = steady_allocator()  # no page faults inside the timings
    machine["normfold_cpu_isa"] = ops.info()["cpu"]["isa"]
    rows = []
    if to not in ("rmsnorm", "crmsnorm"):
        raise ValueError(f"bench model --to {to!r}: choose rmsnorm or crmsnorm")
    # Units of progress: one forward of one model. A timed round runs every candidate (at least once
    # each), the per-norm pass NORM_REPEATS forwards of each model it times; all of it is on the bar.
    n_cands, n_norm = (5, 3) if to == "crmsnorm" else (3, 2)
    per_shape = n_cands * rounds + n_norm * NORM_REPEATS
    bar = Bar(len(dtypes) * len(shapes) * per_shape, "bench model", enabled=progress)
    for dname in dtypes:
        model, source = load_source(model_path, dtype=dname)
        converted, report = convert(model, verify=False)
        naive = _naive(converted)
        extra = {}
        if to == "crmsnorm":
            extra = {"crms": convert(model, to="crmsnorm", verify=False)[0],
                     "crms_pad": convert(model, to="crmsnorm", verify=False, pad=True)[0]}
        vocab = model.config.vocab_size
        for batch, seq in shapes:
            ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
            cands = {k: (lambda m=m: m(input_ids=ids, use_cache=False)) for k, m in
                     (("original", model), ("converted", converted), ("naive", naive), *extra.items())}
            with torch.inference_mode():
                s = measure(cands, rounds=rounds, min_time=0.05, tick=lambda: bar.step(len(cands)))  # ≥50 ms a sample
                overhead = hook_overhead()
                per_forward = norm_times({k: (m, cands[k]) for k, m in (("original", model), ("converted", converted))},
                                         tick=bar.step, overhead=overhead)
                norm_ms = {k: median_ms(v) for k, v in per_forward.items()}
            ms = {k: v.median * 1e3 for k, v in s.items()}
            rows.append({"model": name or source["model"], "dtype": dname, "batch": batch, "seq": seq,
                         "original_ms": ms["original"], "converted_ms": ms["converted"], "naive_rms_ms": ms["naive"],
                         "converted/original": paired(s["converted"], s["original"]).median,
                         "naive/original": paired(s["naive"], s["original"]).median,
                         "converted_vs_original": verdict(s["converted"], s["original"]),
                         "original_norm_ms": norm_ms["original"], "converted_norm_ms": norm_ms["converted"],
                         "norm converted/original": paired_norm_ratio(per_forward["converted"],
                                                                      per_forward["original"]),
                         "hook_overhead_us": overhead * 1e6,
                         "original_q25_ms": s["original"].q25 * 1e3, "original_q75_ms": s["original"].q75 * 1e3,
                         "converted_q25_ms": s["converted"].q25 * 1e3, "converted_q75_ms": s["converted"].q75 * 1e3})
            if extra:
                with torch.inference_mode():
                    crms_norm_ms = norm_time(extra["crms"], cands["crms"], tick=bar.step, overhead=overhead)
                rows[-1].update({"crms_ms": ms["crms"], "crms_pad_ms": ms["crms_pad"],
                                 "crms/original": paired(s["crms"], s["original"]).median,
                                 "crms/converted": paired(s["crms"], s["converted"]).median,
                                 "crms_pad/converted": paired(s["crms_pad"], s["converted"]).median,
                                 "crms_vs_converted": verdict(s["crms"], s["converted"]),
                                 "crms_pad_vs_converted": verdict(s["crms_pad"], s["converted"]),
                                 "crms_norm_ms": crms_norm_ms})
    bar.close()
    paths = write(rows, "model" if to == "rmsnorm" else f"model-{to}", out_dir, machine,
                  COLUMNS + (CRMS_COLUMNS if to == "crmsnorm" else []),
                  "End-to-end forward time, original vs converted (median ms; lower is better)",
                  extra=NOTES.format(repeats=NORM_REPEATS))
    return rows, paths
