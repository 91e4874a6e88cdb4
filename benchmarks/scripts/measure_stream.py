"""Measure `normfold convert` from outside the process: peak RSS (the kernel's high-water mark of the
child, via wait4, which counts touched memory-mapped pages), wall and CPU time and GB/s, beside a plain copy of
the same shards (the I/O floor) and the RSS of importing torch + transformers + normfold.

    python benchmarks/scripts/measure_stream.py CHECKPOINT_DIR WORK_DIR [--keep] [--stream auto|always|never]
        [-- EXTRA CONVERT ARGS, e.g. --to crmsnorm]

The default runs the default command, `normfold convert SRC --out OUT` (which streams a local safetensors
checkpoint). Prints one JSON object; the memory bound is baseline + 1.25 x largest shard + 0.5 GB.
`convert.gb_per_s` includes start-up and verification; `conversion_only_gb_per_s` is the report's convert step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def run_child(cmd: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    # output goes to files, not pipes: wait4 does not read, and a child filling a 64 KB pipe would block forever
    with tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=fout, stderr=ferr)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read().decode(), ferr.read().decode()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {code}:\n{err[-3000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "cpu_user_s": round(usage.ru_utime, 2), "cpu_sys_s": round(usage.ru_stime, 2), "stdout": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("checkpoint")
    p.add_argument("work")
    p.add_argument("--keep", action="store_true", help="keep the converted output")
    p.add_argument("--stream", default=None, choices=["auto", "always", "never"],
                   help="pass --stream (default: none, the default command)")
    p.add_argument("extra", nargs="*", help="more `normfold convert` arguments (after --)")
    args = p.parse_args(argv)
    src, work = Path(args.checkpoint), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in shards)
    largest = max(f.stat().st_size for f in shards)

    baseline = run_child([sys.executable, "-c", "import torch, transformers, normfold, normfold.stream"])
    # os.sync() (untimed) before each timed step: neither starts behind the other's dirty-page writeback
    copy_dir = work / "copy"
    os.sync()
    copy = run_child(["cp", "-r", str(src), str(copy_dir)])
    shutil.rmtree(copy_dir)
    os.sync()
    out = work / "converted"
    stream = ["--stream", args.stream] if args.stream else []
    conv = run_child([sys.executable, "-m", "normfold", "convert", str(src), "--out", str(out), *stream, "-q",
                      "--json", *args.extra])
    report = json.loads(conv.pop("stdout"))
    out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    if not args.keep:
        shutil.rmtree(out)
    bound = baseline["peak_rss_mb"] + 1.25 * largest / 2**20 + 512
    result = {
        "checkpoint": str(src), "dtype": report["dtype"], "total_gb": round(total / 1e9, 3),
        "shards": len(shards), "largest_shard_mb": round(largest / 2**20, 1), "output_gb": round(out_bytes / 1e9, 3),
        "import_rss_mb": baseline["peak_rss_mb"], "bound_mb": round(bound, 1),
        "command": ["normfold", "convert", "SRC", "--out", "OUT", *stream, *args.extra],
        "convert": {**conv, "gb_per_s": round(total / 1e9 / conv["wall_s"], 3)},
        "report_seconds": report.get("seconds"),
        "conversion_only_gb_per_s": round(total / 1e9 / report["seconds"]["convert"], 3)
        if (report.get("seconds") or {}).get("convert") else None,
        "streamed": "normfold.stream" in " ".join(report.get("notes", [])),
        "copy": {"wall_s": copy["wall_s"], "gb_per_s": round(total / 1e9 / copy["wall_s"], 3)},
        "within_bound": conv["peak_rss_mb"] <= bound,
        "throughput_vs_copy": round(copy["wall_s"] / conv["wall_s"], 3),
        "verification": report["verification"].get("reason") or report["verification"].get("passed"),
        "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
