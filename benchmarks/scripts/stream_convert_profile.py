"""The streamed conversion step alone, CPU seconds per thread and stage (issue 26).

    python benchmarks/scripts/stream_convert_profile.py CHECKPOINT_DIR OUT_DIR

Runs `prepare` first (as the CLI does), then `stream_convert` with each stage timed by the CPU of the thread
that runs it (`time.thread_time`): the main thread's computing (`Computer.run`), the reader (`Computer.read`),
the writer (`write_tensor`, `copy_range`), the SHA-256 thread (`_hash_tensor`, `_hash_range`), the direct writes
(`SequentialFile._flush` / `_pwrite_direct`, mostly waiting on the disk: compare their wall with their CPU).
Prints one JSON object: wall, the step's user and system CPU (getrusage), CPU and wall per stage, load average.
OUT_DIR is emptied first. Timings on a shared machine are loaded: say so.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import shutil
import sys
import threading
import time
from pathlib import Path

from normfold.stream import compute, convert, safetensors_io as st, writer

cpu: dict = collections.defaultdict(float)
wall: dict = collections.defaultdict(float)
lock = threading.Lock()


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def run(*args, **kwargs):
        t0, w0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            thread = threading.current_thread().name.split("_")[0]
            with lock:
                cpu[f"{label}@{thread}"] += time.thread_time() - t0
                wall[label] += time.perf_counter() - w0

    setattr(owner, name, run)


def main(argv: list[str]) -> int:
    src, out = argv[0], Path(argv[1])
    for owner, name in [(compute.Computer, "run"), (compute.Computer, "read"), (st, "write_tensor"),
                        (st, "copy_range"), (writer, "_hash_tensor"), (writer, "_hash_range"),
                        (st.SequentialFile, "_flush"), (st.SequentialFile, "_pwrite_direct"),
                        (writer._Writer, "_pop")]:
        timed(owner, name, name.strip("_"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.sync()
    prepared = convert.prepare(src)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    report = convert.stream_convert(src, out, prepared=prepared)
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall_s": round(dt, 3), "report_convert_s": report.seconds["convert"],
                      "user_s": round(r1.ru_utime - r0.ru_utime, 2), "sys_s": round(r1.ru_stime - r0.ru_stime, 2),
                      "cpu_s": {k: round(v, 3) for k, v in sorted(cpu.items())},
                      "wall_in_s": {k: round(v, 3) for k, v in sorted(wall.items())},
                      "loadavg": os.getloadavg(), "cpus": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
