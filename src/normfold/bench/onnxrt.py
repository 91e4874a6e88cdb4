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

A second table times one norm op alone (x of GPT-2's 256 x 768 and ViT-S's 197 x 384; --quick: the
first): LayerNormalization, RMSNormalization, the decomposed form, onnxruntime's
SimplifiedLayerNormalization, and the residual-add forms Add + LayerNormalization,
SkipLayerNormalization, Add + RMSNormalization, SkipSimplifiedLayerNormalization; each checked
against a float64 reference.
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
from .results import markdown, write
from .timing import Bar, machine_info, measure, paired, ratio_verdict

THREADS = 2
CANDIDATES = ("ln", "ln-copy", "rms", "rms-decomp", "rms-sln", "crms", "no-norm", "ln-opt", "rms-opt")
COLUMNS = ["model", "tokens", "ln_ms", "ln-copy/ln", "rms/ln", "rms-decomp/ln", "rms-sln/ln", "crms/ln", "no-norm/ln",
           "rms-opt/ln-opt", "ln-opt/ln", "rms_vs_ln", "aa_vs_ln", "rms_err"]


def write_csv(rows: list[dict], path: Path) -> None:
    import csv

    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


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
        out.append(("vit-s/16", transformers.ViTModel(vit).eval(),
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


def _session(path, threads: int = THREADS):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3  # errors only (not "removing unused initializer")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _files(name, model, inputs, tmp: Path, progress) -> dict[str, Path]:
    from .. import compress  # noqa: F401  (registers --to crmsnorm)
    from ..conversion import convert
    from ..io import load, save

    files = {}

    def export(key, m, opset):
        files[key] = tmp / f"{key}.onnx"
        deploy.export_onnx(m, inputs, files[key], opset=opset, dynamic=False)
        if progress:
            progress()

    export("ln", model, 23)
    for to in ("rmsnorm", "crmsnorm"):
        conv, report = convert(model, to=to, verify=False)  # normfold.convert, .save, .load: the public API
        loaded = load(save(conv, report, tmp / f"ckpt-{to}"))
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


# ---- single norm ops in onnxruntime -------------------------------------------------------------------

OP_SHAPES = ((256, 768), (197, 384))
OPS = ("LayerNormalization", "RMSNormalization", "decomposed", "SimplifiedLayerNormalization")
FUSED = ("Add+LayerNormalization", "SkipLayerNormalization", "Add+RMSNormalization",
         "SkipSimplifiedLayerNormalization")
EPS = 1e-5
# One thread for the single-op table: a norm call lasts ~0.1 ms, and waking a second (non-spinning)
# thread per call on a shared 2-core machine made its timings swing by 2-6x between rounds.
OP_THREADS = 1


def _op_graph(kind: str, t: int, d: int, path: Path) -> None:
    """A one-norm ONNX model (opset 23, onnxruntime's com.microsoft ops where named) of input x
    (and skip for the fused residual forms, which also return the sum)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = np.random.default_rng(0)
    inits = [numpy_helper.from_array((1 + 0.1 * g.standard_normal(d)).astype(np.float32), "g"),
             numpy_helper.from_array((0.1 * g.standard_normal(d)).astype(np.float32), "b")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, d])
    skip = helper.make_tensor_value_info("skip", TensorProto.FLOAT, [t, d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [t, d])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [t, d])
    nodes, inputs, outputs = [], [x], [y]
    ms = "com.microsoft"
    if kind == "LayerNormalization":
        nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=EPS)]
    elif kind == "RMSNormalization":
        nodes = [helper.make_node("RMSNormalization", ["x", "g"], ["y"], axis=-1, epsilon=EPS)]
    elif kind == "SimplifiedLayerNormalization":
        nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], axis=-1, epsilon=EPS)]
    elif kind == "decomposed":  # what the exporter writes below opset 23 (aten.rms_norm's decomposition)
        inits += [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                  numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                  numpy_helper.from_array(np.array(EPS, np.float32), "eps")]
        nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
                 helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
                 helper.make_node("Add", ["ms", "eps"], ["mse"]),
                 helper.make_node("Sqrt", ["mse"], ["rms"]),
                 helper.make_node("Reciprocal", ["rms"], ["r"]),
                 helper.make_node("Mul", ["x", "r"], ["n"]),
                 helper.make_node("Mul", ["n", "g"], ["y"])]
    else:
        inputs, outputs = [x, skip], [y, s]
        if kind == "Add+LayerNormalization":
            nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
                     helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=EPS)]
        elif kind == "Add+RMSNormalization":
            nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
                     helper.make_node("RMSNormalization", ["s", "g"], ["y"], axis=-1, epsilon=EPS)]
        elif kind == "SkipLayerNormalization":
            nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "g", "b"], ["y", "", "", "s"],
                                      domain=ms, epsilon=EPS)]
        elif kind == "SkipSimplifiedLayerNormalization":
            nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "g"], ["y", "", "", "s"],
                                      domain=ms, epsilon=EPS)]
        else:
            raise ValueError(kind)
    graph = helper.make_graph(nodes, kind, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(ms, 1)])
    model.ir_version = 10
    onnx.save(model, str(path))


def _op_reference(kind, x, skip, t, d):
    """float64 reference of each graph's y (RMS forms: x / rms · g; LN forms: (x − μ)/σ · g + b)."""
    import numpy as np

    g = np.random.default_rng(0)
    w = (1 + 0.1 * g.standard_normal(d)).astype(np.float32).astype(np.float64)
    b = (0.1 * g.standard_normal(d)).astype(np.float32).astype(np.float64)
    v = x.astype(np.float64) + (skip.astype(np.float64) if "Skip" in kind or "Add" in kind else 0)
    if "Layer" in kind and "Simplified" not in kind:
        c = v - v.mean(-1, keepdims=True)
        return c / np.sqrt((c * c).mean(-1, keepdims=True) + EPS) * w + b
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS) * w


def run_ops(rounds: int, shapes=OP_SHAPES, tick=None) -> list[dict]:
    import numpy as np

    rows = []
    for t, d in shapes:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((t, d)).astype(np.float32)
        skip = rng.standard_normal((t, d)).astype(np.float32)
        with tempfile.TemporaryDirectory(prefix="normfold-bench-onnx-ops-") as tmp:
            sessions, feeds, errs = {}, {}, {}
            for kind in OPS + FUSED:
                path = Path(tmp) / f"{kind}.onnx"
                _op_graph(kind, t, d, path)
                sessions[kind] = _session(path, OP_THREADS)
                names = {i.name for i in sessions[kind].get_inputs()}
                feeds[kind] = {k: v for k, v in (("x", x), ("skip", skip)) if k in names}
                y = sessions[kind].run(None, feeds[kind])[0]
                errs[kind] = _rel(y, _op_reference(kind, x, skip, t, d))
            cands = {k: (lambda s=sessions[k], f=feeds[k]: s.run(None, f)) for k in sessions}
            stats = measure(cands, rounds=rounds, warmup=5, min_time=2e-3, tick=tick)
        for group, ref in ((OPS, "LayerNormalization"), (FUSED, "Add+LayerNormalization")):
            for kind in group:
                r = paired(stats[kind], stats[ref])
                rows.append({"shape": f"{t}x{d}", "op": kind, "us": stats[kind].median * 1e6,
                             f"/{'ln' if group is OPS else 'add+ln'}": r.median, "ratio_q25": r.q25,
                             "ratio_q75": r.q75, "verdict": ratio_verdict(r), "max_rel_err": f"{errs[kind]:.1e}"})
    return rows


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
    op_shapes = OP_SHAPES[:1] if quick else OP_SHAPES
    bar = Bar(len(models) * (5 + rounds) + len(op_shapes) * rounds, "bench onnx", enabled=progress)
    op_rows = run_ops(rounds, op_shapes, tick=bar.step)
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
            e = _rel(first[k], first["ln"])  # max relative error against the original's ONNX
            row[f"{k}_err"] = f"{e:.1e}" if isinstance(e, float) else e
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
    op_cols = ["shape", "op", "us", "/ln", "/add+ln", "ratio_q25", "ratio_q75", "verdict", "max_rel_err"]
    op_md = markdown(op_rows, op_cols, "onnxruntime: one norm op (float32)", machine)
    op_notes = ("\nOne norm per graph, one onnxruntime thread, x of the shape shown (and a residual `skip` for the fused forms, which "
                "also return the sum). /ln: paired ratio to LayerNormalization; /add+ln: to Add then "
                "LayerNormalization. decomposed = what the exporter writes below opset 23; Simplified* and Skip* "
                "are onnxruntime's com.microsoft ops (what its transformer optimizer fuses to). max_rel_err: "
                "against a float64 reference.\n")
    paths = write(rows, "onnx", out_dir, machine, COLUMNS, "onnxruntime: converted vs original (float32)",
                  extra=notes + "\n" + op_md + op_notes)
    write_csv(op_rows, Path(out_dir) / "onnx-ops.csv")
    paths["ops_csv"] = Path(out_dir) / "onnx-ops.csv"
    return rows + op_rows, paths
