"""Summarise `normfold bench ops` CSVs into the per-ISA tables of docs/kernels-cpu-measurements.md (ratios min–max over shapes).

    python scripts/isa_summary.py benchmarks/isa/epyc-avx512-2026-11-24/ops-avx2-t1-ops.csv benchmarks/isa/epyc-avx512-2026-11-24/ops-avx2-t2-ops.csv

Each CSV is one run (one ISA path, one thread count: taken from the file name's `-tN-`); prints one
markdown row per dtype and run: forward rms/ln, forward rms/copy, backward rms/ln, add+rms / add+ln,
and how many of the run's rows for that dtype meet the kernel targets (the CSV's `target` column).
"""

from __future__ import annotations

import csv
import re
import sys
from collections import defaultdict


def span(values) -> str:
    values = list(values)
    return f"{min(values):.2f}–{max(values):.2f}"


def main(paths: list[str]) -> int:
    print("| dtype | threads | fwd rms/ln | fwd rms/copy | bwd rms/ln | add+rms / add+ln | targets met |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for path in paths:
        m = re.search(r"-t(\d+)-", path)
        threads = m.group(1) if m else "?"
        by = defaultdict(lambda: defaultdict(list))
        with open(path) as f:
            for r in csv.DictReader(f):
                by[r["dtype"]][r["pass"]].append(r)
        for dtype in ("float32", "bfloat16", "float16"):
            p = by.get(dtype)
            if not p:
                continue
            fwd, bwd, add = p["forward"], p["backward"], p["add"]
            every = fwd + bwd + add
            met = sum(r.get("target") == "met" for r in every)
            rows.append((dtype, threads, [
                span(float(r["rms/ln"]) for r in fwd), span(float(r["rms/copy"]) for r in fwd),
                span(float(r["rms/ln"]) for r in bwd), span(float(r["rms/ln"]) for r in add) if add else "—",
                f"{met}/{len(every)}"]))
    order = {"float32": 0, "bfloat16": 1, "float16": 2}
    for dtype, threads, cells in sorted(rows, key=lambda r: (order[r[0]], r[1])):
        print(f"| {dtype} | {threads} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
