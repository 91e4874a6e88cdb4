#!/usr/bin/env python3
"""Print the family table of docs/families.md: for every adapter and tiny example (all heads), convert in
float64 and report norms converted / total, the measured float64 relative error, and whether the
checkpoint reloads in stock transformers.

    python scripts/family_table.py > /tmp/families.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import realistic, run_flat  # noqa: E402

import normfold  # noqa: E402
from normfold.adapters import list_adapters  # noqa: E402


def fp64_error(model, conv, inputs, patterns):
    import fnmatch

    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    worst = 0.0
    for name, r in ref.items():
        g = got[name].double()
        r = r.double()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            g, r = g - g.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
        worst = max(worst, float((g - r).abs().max() / r.abs().max().clamp_min(1e-300)))
    return worst


def main() -> None:
    rows = []
    for adapter in list_adapters():
        for ex in adapter.examples:
            worst, conv_ln, tot_ln, stock, heads = 0.0, set(), set(), set(), []
            for head in ex.heads:
                torch.manual_seed(0)
                model = realistic(ex.build(head, torch.float64))
                inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
                conv, rep = normfold.convert(model, verify=False)
                worst = max(worst, fp64_error(model, conv, inputs, rep.centered_outputs))
                conv_ln.add(len(rep.structure.norms))
                tot_ln.add(rep.layernorms_total)
                stock.add(rep.stock_reloadable)
                heads.append(head)
            rows.append((adapter.display_name, ex.name, len(heads), "/".join(map(str, sorted(conv_ln))),
                         "/".join(map(str, sorted(tot_ln))), worst, stock))
    print("| family | tiny config | heads | norms converted / total | exact (float64 rel. error) | stock-reloadable |")
    print("| --- | --- | --- | --- | --- | --- |")
    for fam, ex, nh, c, t, err, stock in rows:
        ok = "yes" if err <= 1e-9 else "NO"
        st = "yes" if stock == {True} else ("no" if stock == {False} else "some heads")
        print(f"| {fam} | {ex} | {nh} | {c} / {t} | {ok} ({err:.1e}) | {st} |")


if __name__ == "__main__":
    main()
