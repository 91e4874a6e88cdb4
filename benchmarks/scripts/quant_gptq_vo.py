"""GPTQ / RTN rows with and without the per-head value/output rotation (on top of the rotated stream and both
online Hadamards), same held-out and calibration windows as `normfold bench quant --gptq`.

    PYTHONPATH=src python benchmarks/scripts/quant_gptq_vo.py OUT_DIR
"""

import sys
import time

from normfold.bench.quant_gptq import COLUMNS, _evaluate_task, calibration_batches
from normfold.bench.quant import heldout_batches
from normfold.bench.results import write
from normfold.bench.timing import machine_info
from normfold.io import load_source

t0 = time.perf_counter()
cal = calibration_batches("bundled", None, windows=16)
batches = heldout_batches(16)
kw = dict(form_names=("rotated+online+attn", "rotated+online+attn+vo"))
vocab = int(load_source(None)[0].config.vocab_size)
tasks = [(None, "kjv-gpt2", True, batches, cal, kw, True, vocab),
         (None, "outlier-gpt2", False, [b.clamp_max(vocab - 1) for b in batches], [b.clamp_max(vocab - 1) for b in cal],
          kw, True, max(vocab, 2048))]
rows = [r for t in tasks for r in _evaluate_task(t)]
machine = machine_info()
machine["seconds"] = round(time.perf_counter() - t0, 1)
machine["heldout_tokens"] = int(sum(b.numel() for b in batches))
machine["calibration"] = "bundled"
machine["calibration_tokens"] = int(sum(b.numel() for b in cal))
write(rows, "quant_gptq_vo", sys.argv[1], machine, COLUMNS,
      f"Value/output rotation: GPTQ and RTN weights, activations per token ({machine['heldout_tokens']} held-out KJV "
      f"tokens; calibration: bundled, {machine['calibration_tokens']} tokens)")
