"""`normfold bench convert`: wall time and peak memory of `normfold convert` on real-sized checkpoints.

Each measurement is a fresh `python -m normfold convert MODEL --out DIR --json` process (what a
user runs: load, convert, verify in float64 and the working dtype, save), so its peak resident
memory is exactly that of the conversion; it is read from the kernel's accounting of the finished
child (os.wait4). For scale, a process that only loads the same checkpoint is measured beside it
(interleaved). Cases: the bundled default model (skipped, with a message, when this checkout has
none) and a GPT-2-medium-sized checkpoint with random weights built into a temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import NormfoldError
from .results import write
from .timing import Bar, Stats, machine_info

_LOAD_ONLY = "import sys; from normfold.io import load_source; load_source(sys.argv[1])"


@dataclass(frozen=True)
class Case:
    """A checkpoint to convert: `make(tmp)` returns its directory (built under tmp if need be), or
    None with `skip_reason` when it is unavailable."""

    name: str
    make: Callable[[Path], Path | None]
    skip_reason: str = ""


def _bundled(tmp: Path) -> Path | None:
    from ..io import default_model_path

    path = default_model_path()
    return path if (path / "config.json").is_file() else None


def gpt2_random(n_layer: int = 24, n_embd: int = 1024, n_head: int = 16, seed: int = 0) -> Callable[[Path], Path]:
    """A GPT-2 checkpoint of the given size with random weights (GPT-2 medium: 24 × 1024, 16 heads)."""

    def make(tmp: Path) -> Path:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        out = tmp / f"gpt2-random-{n_layer}x{n_embd}"
        if not out.exists():
            torch.manual_seed(seed)
            model = GPT2LMHeadModel(GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head)).eval()
            model.save_pretrained(out, safe_serialization=True)
            del model
        return out

    return make


CASES = {
    "bundled": Case("bundled kjv-gpt2", _bundled, "the bundled default model is not in this checkout "
                                                  "(normfold.io.default_model_path() has no config.json)"),
    "gpt2-medium": Case("GPT-2 medium size, random (24 x 1024)", gpt2_random(24)),
    # --quick: GPT-2 medium's width and heads with 4 of its 24 layers
    "gpt2-medium-4l": Case("GPT-2 medium width, random (4 x 1024)", gpt2_random(4)),
}
DEFAULT_CASES = ("bundled", "gpt2-medium")
QUICK_CASES = ("bundled", "gpt2-medium-4l")


def _measure(args: list[str], stdout_path: Path, timeout: float) -> tuple[float, int]:
    """Run a child to completion; returns (wall seconds, peak RSS in bytes). Raises on failure."""
    with open(stdout_path, "w") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(args, stdout=out, stderr=err, text=True)
        deadline = t + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise NormfoldError(f"benchmark child timed out after {timeout:.0f} s: {' '.join(args)}")
            time.sleep(0.01)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise NormfoldError(f"`{' '.join(args[2:])}` failed (exit {proc.returncode}): {err.read()[-2000:]}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                total += _numel(st.get_slice(k).get_shape())
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run(out_dir="benchmarks", quick: bool = False, rounds: int | None = None, progress: bool = True,
        cases=None, to: str = "rmsnorm", timeout: float = 1800.0, work_dir: str | None = None):
    """Measure and write convert.{csv,md,png}. Returns (rows, paths)."""
    names = list(cases or (QUICK_CASES if quick else DEFAULT_CASES))
    for n in names:
        if n not in CASES:
            raise NormfoldError(f"unknown convert case {n!r}; choose from {', '.join(CASES)}")
    rounds = rounds or (1 if quick else 3)
    machine = machine_info()
    rows, skipped = [], []
    tmp = Path(tempfile.mkdtemp(prefix="normfold-bench-convert-", dir=work_dir))
    try:
        bar = Bar(len(names) * rounds * 2, "bench convert", enabled=progress)
        for key in names:
            case = CASES[key]
            src = case.make(tmp)
            if src is None:
                skipped.append(f"{case.name}: skipped, {case.skip_reason}")
                bar.step(rounds * 2)
                continue
            rows.append(_measure_case(case, src, tmp, rounds, to, timeout, bar))
        bar.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for s in skipped:
        print(f"normfold bench convert: {s}", file=sys.stderr)
    notes = ("peak_rss_MB: peak resident memory of the whole `normfold convert` process (python, torch, "
             "the original and converted models, float64 verification copies); load_only_rss_MB: a process that "
             "only loads the checkpoint. Phase times are the CLI's own (normfold.json 'seconds').")
    notes += "".join(f"\n\n{s}" for s in skipped)
    paths = write(rows, "convert", out_dir, machine, COLUMNS, f"`normfold convert --to {to}`: time and peak memory",
                  plot=_plot if rows else None, extra=notes + "\n")
    return rows, paths


COLUMNS = ["model", "params_M", "checkpoint_MB", "wall_s", "load_s", "convert_s", "verify_s", "save_s",
           "peak_rss_MB", "load_only_rss_MB", "peak_rss/checkpoint"]


def _measure_case(case: Case, src: Path, tmp: Path, rounds: int, to: str, timeout: float, bar: Bar) -> dict:
    py = sys.executable
    out = tmp / "converted"
    stdout = tmp / "stdout.json"
    conv_cmd = [py, "-m", "normfold", "convert", str(src), "--to", to, "--out", str(out), "--force", "--json", "-q"]
    load_cmd = [py, "-c", _LOAD_ONLY, str(src)]
    wall, rss, load_rss, phases = [], [], [], []
    for r in range(rounds):
        order = ("convert", "load") if r % 2 == 0 else ("load", "convert")  # interleaved
        for kind in order:
            if kind == "convert":
                t, m = _measure(conv_cmd, stdout, timeout)
                wall.append(t)
                rss.append(m)
                phases.append(json.loads(stdout.read_text()).get("seconds", {}))
                shutil.rmtree(out, ignore_errors=True)
            else:
                load_rss.append(_measure(load_cmd, stdout, timeout)[1])
            bar.step()
    ws = Stats.of(wall)
    ckpt = _dir_bytes(src)
    mb = 1024 ** 2

    def phase(name):
        vals = [p[name] for p in phases if name in p]
        return Stats.of(vals).median if vals else float("nan")

    peak = Stats.of([float(x) for x in rss]).median
    return {"model": case.name, "params_M": _params(src) / 1e6, "checkpoint_MB": ckpt / mb,
            "wall_s": ws.median, "wall_q25_s": ws.q25, "wall_q75_s": ws.q75,
            "load_s": phase("load"), "convert_s": phase("convert"), "verify_s": phase("verify"),
            "save_s": phase("save"), "peak_rss_MB": peak / mb,
            "load_only_rss_MB": Stats.of([float(x) for x in load_rss]).median / mb,
            "peak_rss/checkpoint": peak / ckpt, "rounds": rounds}


def _plot(rows, path, machine):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["model"] for r in rows]
    bottom = [0.0] * len(rows)
    for phase in ("load_s", "convert_s", "verify_s", "save_s"):
        vals = [r[phase] if r[phase] == r[phase] else 0.0 for r in rows]
        ax1.barh(names, vals, left=bottom, label=phase[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_xlabel("seconds")
    ax1.legend(fontsize=7)
    ax2.barh([n + " " for n in names], [r["load_only_rss_MB"] for r in rows], label="load only")
    ax2.barh(names, [r["peak_rss_MB"] for r in rows], label="normfold convert", alpha=0.7)
    ax2.set_xlabel("peak RSS (MB)")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.tick_params(labelsize=7)
    fig.suptitle(f"normfold convert ({machine.get('cpu', '')[:40]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
