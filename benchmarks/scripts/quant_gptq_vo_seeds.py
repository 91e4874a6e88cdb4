"""Seed spread of the value/output rotation's effect (bundled kjv-gpt2): rotated stream + both online Hadamards,
with and without `--rotate-attention vo` (seeds 1-3), GPTQ weights (act-order, per channel), W4A16 and W4A4 per
token; same held-out and calibration windows as `normfold bench quant --gptq`.

    PYTHONPATH=src python benchmarks/scripts/quant_gptq_vo_seeds.py OUT_DIR
"""

import copy
import sys
import time

import torch

from normfold import convert
from normfold.bench.quant import heldout_batches, logits_of, perplexity
from normfold.bench.quant_gptq import COLUMNS, _row, calibration_batches, with_activation_quant
from normfold.bench.results import write
from normfold.bench.timing import machine_info
from normfold.io import load_source
from normfold.quant import quantize_model

torch.set_num_threads(1)
t0 = time.perf_counter()
cal = calibration_batches("bundled", None, windows=16)
batches = heldout_batches(16)
model = load_source(None)[0].float().eval()
ref = logits_of(model, batches)
ref_ppl = perplexity(ref, batches)
rows = []
for seed in (1, 2, 3):
    for attention in ("online", "both"):
        form = f"rotated+online+attn{'+vo' if attention == 'both' else ''} seed {seed}"
        conv, _ = convert(model, rotate="hadamard", rotate_seed=seed, rotate_online=True, rotate_attention=attention,
                          verify=False)
        t1 = time.perf_counter()
        wq = copy.deepcopy(conv)
        quantize_model(wq, cal, method="gptq", bits=4, group_size=None, act_order=True)
        for cname, ab in (("W4A16", None), ("W4A4", 4)):
            m = wq if ab is None else with_activation_quant(wq, ab)
            row = _row("kjv-gpt2", form, "gptq", cname, None, logits_of(m, batches), ref, ref_ppl, batches, True,
                       time.perf_counter() - t1)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
machine = machine_info()
machine["seconds"] = round(time.perf_counter() - t0, 1)
write(rows, "quant_gptq_vo_seeds", sys.argv[1], machine, COLUMNS,
      "Value/output rotation, seeds 1-3: GPTQ weights, activations per token (bundled calibration)")
