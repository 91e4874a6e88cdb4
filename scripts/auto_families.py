"""The docs/families.md / docs/analyze.md table of families converted without an adapter (issue 13): each tiny
random config of tests/analysis/auto_families.py is saved as a float32 checkpoint and converted by the CLI
alone (`python -m normfold convert DIR --dry-run --json`, plus `--inputs` for another image size).

    PYTHONPATH=src python scripts/auto_families.py [KEY ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "analysis"))
from auto_families import FAMILIES  # noqa: E402

# What normfold analyze found on these configs before issue 13 (measured on main at 316564d).
BEFORE = {"dinov2": 1, "dinov2-24px": 0, "beit": 0, "data2vec-vision": 1, "vit-mae": 0, "persimmon": 5,
          "stablelm": 5, "codegen": 3, "mpt": 5}


def main(keys: list[str]) -> None:
    from safetensors.torch import save_file

    print("| family (tiny config) | LayerNorms | foldable before issue 13 | converted now | float64 rel. error | "
          "stock-reloadable |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for fam in FAMILIES:
            if keys and fam.key not in keys:
                continue
            d = Path(tmp) / fam.key
            fam.build(dtype=torch.float32).save_pretrained(d)
            cmd = [sys.executable, "-m", "normfold", "convert", str(d), "--dry-run", "--json", "-q"]
            if fam.image_size:
                g = torch.Generator().manual_seed(0)
                save_file({"pixel_values": torch.randn(2, 3, fam.image_size, fam.image_size, generator=g)},
                          d / "inputs.safetensors")
                cmd += ["--inputs", str(d / "inputs.safetensors"), "--fp64-tol", "1e-7"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode not in (0, 1):
                print(f"| {fam.key} | error: {res.stderr.strip().splitlines()[-1]} |||||")
                continue
            rep = json.loads(res.stdout)
            ln = rep["layernorms"]
            err = rep["verification"]["fp64"]["max_rel_error"]
            print(f"| {fam.config.removesuffix('Config')} ({fam.key}) | {ln['total']} | {BEFORE.get(fam.key, '?')} | "
                  f"{ln['converted']} | {err:.1e} | {'yes' if rep['stock_reloadable'] else 'no'} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
