"""Inference cost of Unified Normalization once fused, against the LayerNorm original.

Candidates, all from the same random weights (speed does not depend on their values):

- layernorm: the stock model;
- un (eval): LayerNorms swapped for UnifiedNorm, unfused (a per-channel affine with fixed statistics);
- un fused: `fuse_offline_norms` folded every norm into its neighbouring linear layer;
- no norm: every LayerNorm replaced by the identity: the floor a fused model can reach.

Paper 004 (Table 8) reports +31% throughput and -18% memory for Swin-T on an RTX 3090. Here: CPU.
Peak memory is what torch's CPU allocator holds at most during one forward beyond the weights
(from the profiler's allocation events); `layer_norm_share_%` is the fraction of the LayerNorm
model's forward spent in LayerNorm kernels, an upper bound on what fusing can save.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .results import write
from .timing import Bar, machine_info, measure, steady_allocator

COLUMNS = ["model", "batch", "tokens", "layernorm_ms", "un_eval_ms", "un_fused_ms", "no_norm_ms",
           "fused_speedup_%", "floor_speedup_%", "layer_norm_share_%", "layernorm_peak_MB", "fused_peak_MB",
           "memory_reduction_%"]


def vit_tiny():
    """ViT-Ti/16 at 224x224 (DeiT-Tiny's shape): 12 layers, width 192, 197 tokens."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                    intermediate_size=768, num_labels=1000)
    return ViTForImageClassification(cfg), lambda b, g: {"pixel_values": torch.randn(b, 3, 224, 224, generator=g)}, 197


def gpt2_mini():
    """A GPT-2 of width 256, 6 layers, on 256-token sequences."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=8192, n_positions=256, n_embd=256, n_layer=6, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg), lambda b, g: {"input_ids": torch.randint(0, 8192, (b, 256), generator=g)}, 256


MODELS = {"vit-tiny": vit_tiny, "gpt2-mini": gpt2_mini}


def variants(model: nn.Module, inputs: dict) -> dict[str, nn.Module]:
    from ..unified.fuse import fuse_offline_norms
    from ..nn.offline import OfflineNorm
    from ..unified.variant import swap_layernorms

    model = model.eval()
    un = copy.deepcopy(model)
    swap_layernorms(un)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking statistics, so the fused weights are generic
        for m in un.modules():
            if isinstance(m, OfflineNorm):
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    un.eval()
    small = {k: v[:1] for k, v in inputs.items()}
    fused, report = fuse_offline_norms(un, small)
    if report.kept or not report.verification["passed"]:
        raise RuntimeError(f"fusion incomplete or wrong: kept {report.kept}, verification {report.verification}")
    floor = copy.deepcopy(model)
    for name in [n for n, m in floor.named_modules() if isinstance(m, nn.LayerNorm)]:
        parent, _, leaf = name.rpartition(".")
        setattr(floor.get_submodule(parent) if parent else floor, leaf, nn.Identity())
    return {"layernorm": model, "un_eval": un, "un_fused": fused, "no_norm": floor}


def layer_norm_share(fn) -> float:
    """Fraction of one forward's CPU time spent in LayerNorm kernels (profiler): the most fusion can save."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if "layer_norm" in e.key) / total if total else 0.0


def peak_memory(fn) -> int:
    """Peak bytes the CPU allocator holds during fn() beyond what it held before (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    timeline = []
    for e in prof.events():
        if e.name == "[memory]":
            timeline.append((e.time_range.start, e.cpu_memory_usage))
        elif e.self_cpu_memory_usage:
            timeline.append((e.time_range.start, e.self_cpu_memory_usage))
    cur = peak = 0
    for _, delta in sorted(timeline):
        cur += delta
        peak = max(peak, cur)
    return peak


def run(out_dir="benchmarks", models=("vit-tiny", "gpt2-mini"), batches=(1, 8), rounds: int = 10,
        progress: bool = True):
    machine = machine_info()
    machine["allocator"] = steady_allocator()  # no page faults inside the timings
    rows = []
    bar = Bar(len(models) * len(batches) * rounds, "bench un", enabled=progress)
    for key in models:
        model, make_inputs, tokens = MODELS[key]()
        g = torch.Generator().manual_seed(0)
        cands = variants(model, make_inputs(1, g))
        for b in batches:
            inputs = make_inputs(b, g)
            calls = {k: (lambda m=m: m(**inputs)) for k, m in cands.items()}
            with torch.inference_mode():
                s = measure(calls, rounds=rounds, min_time=0, warmup=2, tick=bar.step)
                mem = {k: peak_memory(calls[k]) for k in ("layernorm", "un_fused")}
                share = layer_norm_share(calls["layernorm"])
            ms = {k: v.median * 1e3 for k, v in s.items()}
            rows.append({
                "model": key, "batch": b, "tokens": tokens,
                "layernorm_ms": ms["layernorm"], "un_eval_ms": ms["un_eval"], "un_fused_ms": ms["un_fused"],
                "no_norm_ms": ms["no_norm"],
                "fused_speedup_%": 100 * (ms["layernorm"] / ms["un_fused"] - 1),
                "floor_speedup_%": 100 * (ms["layernorm"] / ms["no_norm"] - 1),
                "layer_norm_share_%": 100 * share,
                "layernorm_peak_MB": mem["layernorm"] / 2**20, "fused_peak_MB": mem["un_fused"] / 2**20,
                "memory_reduction_%": 100 * (1 - mem["un_fused"] / mem["layernorm"]) if mem["layernorm"] else 0.0,
                **{f"{k}_q25_ms": v.q25 * 1e3 for k, v in s.items()},
                **{f"{k}_q75_ms": v.q75 * 1e3 for k, v in s.items()},
            })
    bar.close()
    paths = write(rows, "un", out_dir, machine, COLUMNS,
                  "Fused Unified Normalization vs LayerNorm at inference (median ms; speedup = throughput gain)")
    return rows, paths
