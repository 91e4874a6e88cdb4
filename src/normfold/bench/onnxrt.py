"""`normfold bench onnx`: converted models in onnxruntime against their original (float32, CPU).

The models are what users deploy: a Hugging Face GPT-2 (random weights, GPT-2 small's width, 4
layers, no LM head so the blocks dominate) and a ViT-S/16-sized ViTModel (--quick: GPT-2 only, 2
layers, 128 tokens), converted with `normfold.convert`, saved, reloaded with `normfold.load` and
exported with torch's dynamo exporter exactly as `normfold export` does. Candidates, each an ONNX
file in its own onnxruntime session (2 intra-op threads, spinning off so idle sessions leave the
cores alone, all graph optimisations):

  ln            the original (LayerNormalization), opset 23
  ln-copy       the same file in a second session: the A/A control
  rms           Pre-RMSNorm, opset 23: the standard RMSNormalization op
  rms-decomp    Pre-RMSNorm, opset 18: the norm decomposed (Pow/ReduceMean/Sqrt/Reciprocal/Mul)
  rms-sln       Pre-RMSNorm, opset 23 with each RMSNormalization node renamed to onnxruntime's own
                SimplifiedLayerNormalization (same inputs and attributes)
  crms          Pre-CRMSNorm (d−1 stream), opset 23 (no standard op: decomposed)
  no-norm       the Pre-RMSNorm model with its norms removed: the floor (not the same function)
  ln-opt, rms-opt
                the original (opset 23) and Pre-RMS (opset 18) after onnxruntime's transformer
                optimizer (`normfold export --optimize`): SkipLayerNormalization and
                SkipSimplifiedLayerNormalization fusions

Every round runs each candidate once, in rotating order; X/ln is the median over rounds of the
round's X time / ln time (paired), with its quartiles. ln-copy/ln is what "no difference" looks like.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from .. import deploy
from .results import write
from .timing import Bar, machine_info, measure, paired, ratio_verdict

THREADS = 2
CANDIDATES = ("ln", "ln-copy", "rms", "rms-decomp", "rms-sln", "crms", "no-norm", "ln-opt", "rms-opt")
COLUMNS = ["model", "tokens", "ln_ms", "ln-copy/ln", "rms/ln", "rms-decomp/ln", "rms-sln/ln", "crms/ln", "no-norm/ln",
           "rms-opt/ln-opt", "ln-opt/ln", "rms_vs_ln", "aa_vs_ln", "rms_err"]


def _models(quick: bool):
    import transformers

    torch.manual_seed(0)
    gpt = transformers.GPT2Config(n_layer=2 if quick else 4, n_embd=768, n_head=12)
    seq = 128 if quick else 256
    out = [("gpt2-768 x {} layers".format(gpt.n_layer), transformers.GPT2Model(gpt).eval(),
            {"input_ids": torch.randint(0, gpt.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))},
            seq)]
    if not quick:
        vit = transformers.ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                     intermediate_size=1536, image_size=224, patch_size=16)
        out.append(("vit-s/16", transformers.ViTModel(vit, add_pooling_layer=False).eval(),
                    {"pixel_values": torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))}, 197))
    return out


def _realistic(model: nn.Module) -> nn.Module:
    """Non-trivial LayerNorm affines and biases (fresh ones are 1 and 0, which the exporter could fold)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _without_norms(model: nn.Module) -> nn.Module:
    from ..nn import CRMSNorm, RMSNorm

    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, (RMSNorm, CRMSNorm)):
                setattr(m, child_name, nn.Identity())
    return model


def _rename_rmsnorm(src: Path, dst: Path) -> int:
    import onnx

    model = onnx.load(str(src))
    n = 0
    for node in model.graph.node:
        if node.op_type == "RMSNormalization":
            node.op_type = "SimplifiedLayerNormalization"  # onnxruntime's op: same inputs, axis, epsilon
            n += 1
    onnx.save(model, str(dst))
    return n


def _session(path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _files(name, model, inputs, tmp: Path, progress) -> dict[str, Path]:
    import normfold

    files = {}

    def export(key, m, opset):
        files[key] = tmp / f"{key}.onnx"
        deploy.export_onnx(m, inputs, files[key], opset=opset, dynamic=False)
        if progress:
            progress()

    export("ln", model, 23)
    for to in ("rmsnorm", "crmsnorm"):
        conv, report = normfold.convert(model, to=to, verify=False)
        loaded = normfold.load(normfold.save(conv, report, tmp / f"ckpt-{to}"))
        if to == "rmsnorm":
            export("rms", loaded, 23)
            export("rms-decomp", loaded, 18)
            _rename_rmsnorm(files["rms"], tmp / "rms-sln.onnx")
            files["rms-sln"] = tmp / "rms-sln.onnx"
            export("no-norm", _without_norms(loaded), 23)
        else:
            export("crms", loaded, 23)
    with contextlib.redirect_stderr(io.StringIO()):
        deploy.optimize(files["ln"], tmp / "ln-opt.onnx", model.config)
        deploy.optimize(files["rms-decomp"], tmp / "rms-opt.onnx", model.config)
    files["ln-opt"], files["rms-opt"] = tmp / "ln-opt.onnx", tmp / "rms-opt.onnx"
    files["ln-copy"] = files["ln"]
    return files


def _rel(a, b):
    import numpy as np

    if a.shape != b.shape:
        return ""
    return float(np.abs(a.astype(np.float64) - b).max() / max(float(np.abs(b).max()), 1e-30))


def run(out_dir, quick: bool = False, rounds: int | None = None, progress: bool = True, models=None):
    """`models`: [(name, HF model, inputs, tokens)] instead of the presets (tests use a tiny one)."""
    deploy.require_onnx()
    import onnxruntime as ort

    rounds = rounds or (7 if quick else 21)
    models = models or _models(quick)
    rows = []
    bar = Bar(len(models) * (6 + rounds), "bench onnx", enabled=progress)
    for name, model, inputs, tokens in models:
        _realistic(model)
        with tempfile.TemporaryDirectory(prefix="normfold-bench-onnx-") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            files = _files(name, model, inputs, Path(tmp), bar.step)
            sessions = {k: _session(files[k]) for k in CANDIDATES}
            feeds = {k: deploy.feeds(s, inputs) for k, s in sessions.items()}
            first = {k: s.run(None, feeds[k])[0] for k, s in sessions.items()}  # same function? (not no-norm)
            cands = {k: (lambda s=s, f=feeds[k]: s.run(None, f)) for k, s in sessions.items()}
            stats = measure(cands, rounds=rounds, warmup=3, min_time=0.0, tick=bar.step)
        r = {k: paired(stats[k], stats["ln"]) for k in CANDIDATES}
        row = {"model": name, "tokens": tokens, "ln_ms": stats["ln"].median * 1e3}
        for k in ("ln-copy", "rms", "rms-decomp", "rms-sln", "crms", "no-norm", "ln-opt"):
            row[f"{k}/ln"] = r[k].median
            row[f"{k}/ln_q25"], row[f"{k}/ln_q75"] = r[k].q25, r[k].q75
        ropt = paired(stats["rms-opt"], stats["ln-opt"])
        row["rms-opt/ln-opt"], row["rms-opt/ln-opt_q25"], row["rms-opt/ln-opt_q75"] = ropt.median, ropt.q25, ropt.q75
        row["rms_vs_ln"] = ratio_verdict(r["rms"])
        row["aa_vs_ln"] = ratio_verdict(r["ln-copy"])  # anything but "same" is the machine's noise
        for k in ("rms", "rms-decomp", "rms-sln", "crms", "rms-opt"):
            row[f"{k}_err"] = _rel(first[k], first["ln"])  # max relative error against the original's ONNX
        row["rounds"] = rounds
        rows.append(row)
    bar.close()
    machine = {**machine_info(), "onnxruntime": ort.__version__, "onnxruntime_threads": THREADS}
    notes = ("X/ln: median over rounds of the paired per-round ratio to the original (ln) in onnxruntime "
             f"({THREADS} threads, all graph optimisations), float32, {rounds} rounds; quartiles in the CSV. "
             "ln-copy is the original again in a second session (A/A control): its distance from 1 and its "
             "verdict show the machine's noise. rms = RMSNormalization (opset 23), rms-decomp = the "
             "decomposed norm (opset 18), rms-sln = onnxruntime's SimplifiedLayerNormalization, crms = "
             "Pre-CRMSNorm, no-norm = norms removed (the floor); -opt = after onnxruntime's transformer "
             "optimizer (rms-opt from opset 18). Verdicts: 'slower'/'faster' when the paired ratio's "
             "quartile is past 1, else 'same'.\n")
    paths = write(rows, "onnx", out_dir, machine, COLUMNS, "onnxruntime: converted vs original (float32)",
                  extra=notes)
    return rows, paths
