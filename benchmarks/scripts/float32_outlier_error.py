"""How much float32 error does a conversion add, with and without outlier channels in the stream?

Draws random tiny models of every family from the property-test strategies
(tests/properties/family_configs.py), converts each in float32 (rmsnorm, crmsnorm, crmsnorm --pad)
and prints, per family, the worst ratio over all outputs of

    converted float32 error / original float32 error     (both against the float64 original)

separately for models without outliers and with ×1e3–1e4 outlier channels. The verifier's working-dtype bound
on that ratio is 4 (+64 ulp for outputs whose own error is zero).

    python benchmarks/scripts/float32_outlier_error.py [--cases 40] [--families gpt2,bert] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "properties")]
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=40, help="random models per family and outlier setting")
    p.add_argument("--families", default="", help="comma-separated adapter names (default: all)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (the drawn models depend only on it)")
    p.add_argument("--json", help="also write the per-case ratios here")
    args = p.parse_args(argv)

    import torch
    from family_configs import Case, cases
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis.errors import UnsatisfiedAssumption
    from test_family_equivalence import ADAPTERS, TARGETS, float32_errors

    eps = torch.finfo(torch.float32).eps
    families = [f for f in args.families.split(",") if f] or sorted(ADAPTERS)
    rows, records = [], []
    for fam in families:
        worst = {False: (0.0, None), True: (0.0, None)}
        for outliers in (False, True):
            seen = []

            @seed(args.seed)
            @settings(max_examples=args.cases, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=cases(ADAPTERS[fam]), target=TARGETS)
            def measure(case: Case, target):
                if (case.outlier_scale > 0) != outliers:
                    return
                to, options = target
                try:
                    result = float32_errors(case, to, options)
                except UnsatisfiedAssumption:  # transformers cannot build or run this configuration
                    return
                if result is None:  # refused by the adapter
                    return
                ratio, where = 0.0, None
                for name, (err, base) in result[2].items():
                    r = err / (base + 16 * eps)
                    if r > ratio:
                        ratio, where = r, (name, err, base)
                seen.append(ratio)
                records.append({"family": fam, "case": repr(case), "to": to, "pad": options.get("pad", False),
                                "ratio": ratio, "output": where[0], "err": where[1], "base": where[2]})
                if ratio > worst[outliers][0]:
                    worst[outliers] = (ratio, f"{to}{'+pad' if options.get('pad') else ''} {where[0]}")

            measure()
            print(f"{fam:10s} outliers={'yes' if outliers else 'no ':3s} cases={len(seen):3d} "
                  f"worst ratio={worst[outliers][0]:7.2f}  ({worst[outliers][1]})", flush=True)
        rows.append((fam, worst))
    print("\n| family | worst ratio, no outliers | worst ratio, ×1e3–1e4 outliers |\n| --- | --- | --- |")
    for fam, worst in rows:
        print(f"| {fam} | {worst[False][0]:.2f} | {worst[True][0]:.2f} ({worst[True][1]}) |")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
