"""`normfold bench quant --engine {ctranslate2,onnxruntime}`: real integer runs in the deployment engines.

Per model (the bundled kjv-gpt2 on held-out KJV windows, and the outlier GPT-2 of `bench quant`), the
same inputs through:

- stock: the original converted by the engine's own tool at the same type (CTranslate2:
  `ctranslate2.converters.TransformersConverter` on the model directory, or its GPT2Loader on the
  in-memory original where there is no directory; ONNX Runtime: torch.onnx + `quantize_dynamic`);
- ln-folded (CTranslate2): normfold's conversion with every norm written as LayerNorm (γ/β folded);
- plain: normfold's default export (RMSNorm where the stream is zero-mean in the engine);
- rotated: the same after `--rotate hadamard` (weights rounded by the engine in the rotated basis);
- +reduced: the same three with int8 weights within ±63 (CTranslate2: normfold's own rows,
  `normfold.quant` method "rtn-reduced"; onnxruntime: `quantize_dynamic(reduce_range=True)`), which keeps
  the u8·s8 pair sums of AVX2 int8 GEMMs without VNNI out of int16 saturation;

each teacher-forced along the input text: KL(p_float32 ‖ p_form) of the next-token distribution against
the float32 PyTorch original (mean over positions, per input), top-1 agreement with it, perplexity, and
greedy equality (the engine's argmax along the float32 model's 16-token greedy continuation of each
input's first 32 tokens). Per input, each form's KL is divided by stock's: the median of those ratios
is the headline. Speed: a forward of one input, all forms timed interleaved (bench.timing.measure),
paired ratios to stock, and an A/A control (stock loaded twice).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .results import write
from .timing import machine_info, measure, paired, ratio_verdict

COLUMNS = ["engine", "model", "form", "type", "inputs", "kl_mean", "kl_ratio_median", "kl_ratio_q25",
           "kl_ratio_q75", "top1_agree", "perplexity", "greedy_equal", "bytes"]
SPEED_COLUMNS = ["engine", "model", "form", "type", "ms_per_forward", "tokens_per_s", "ratio_to_stock_median",
                 "ratio_q25", "ratio_q75", "verdict"]


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:]).item())


def _quartiles(xs):
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[1], q[0], q[2]


# ---------------------------------------------------------------- the engines


class Ct2Runner:
    engine = "ctranslate2"

    def __init__(self, tmp: Path, qtype: str):
        from ..engines import ct2

        self.ct2, self.tmp, self.qtype = ct2, tmp, qtype

    def build(self, name: str, model, report=None, model_dir=None, stock=False, own=None):
        out = self.tmp / f"ct2-{name}-{self.qtype}"
        if stock and model_dir is not None:
            from ctranslate2.converters import TransformersConverter

            TransformersConverter(str(model_dir)).convert(str(out), quantization=self.qtype, force=True)
        else:
            self.ct2.write(self.ct2.build_spec(model, report), out, self.qtype, force=True, own_weights=own)
        gen = self.ct2.generator(out, threads=1)
        return {"path": out, "gen": gen, "bytes": self.ct2.model_bytes(out)}

    def logits(self, h, ids):
        return self.ct2.generator_logits(h["gen"], ids)

    def forward(self, h, ids):
        return lambda: h["gen"].forward_batch([ids[0].tolist()])


class OrtRunner:
    engine = "onnxruntime"

    def __init__(self, tmp: Path, qtype: str):
        self.tmp, self.qtype = tmp, qtype

    def build(self, name: str, model, report=None, model_dir=None, stock=False, own=None, qtype=None):
        """`qtype` "int4": MatMulNBits with `own` = "ort" (onnxruntime's MatMulNBitsQuantizer on the file, RTN),
        a callable (GPTQ's row table) or None (normfold's round to nearest), blocks of 32, symmetric."""
        from .. import deploy
        from ..engines import ort_quant

        qtype = qtype or self.qtype
        path = self.tmp / f"ort-{name}.onnx"
        example = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
        info = deploy.export_onnx(model, example, path)
        if qtype == "int8":
            ort_quant.quantize_file(path, "int8", reduce_range=own == "rtn-reduced")
        elif qtype == "int4" and own == "ort":
            tmp = path.with_name(path.stem + ".ort4.onnx")
            ort_quant.quantize_int4_onnxruntime(path, tmp, block_size=32, symmetric=True)
            tmp.replace(path)
        elif qtype == "int4":
            ort_quant.quantize_file(path, "int4", **({} if own is None else {"weights": own}))
        sess = deploy.session(path, threads=1)
        return {"path": path, "sess": sess, "info": info, "bytes": path.stat().st_size}

    def logits(self, h, ids):
        return torch.from_numpy(h["sess"].run(None, {"input_ids": ids.numpy()})[0]).float()

    def forward(self, h, ids):
        feed = {"input_ids": ids.numpy()}
        return lambda: h["sess"].run(None, feed)


# ---------------------------------------------------------------- one model


def _greedy_paths(model, inputs, prompt: int = 32, steps: int = 16):
    paths = []
    with torch.no_grad():
        for ids in inputs:
            x = ids[:, :prompt]
            for _ in range(steps):
                x = torch.cat([x, model(input_ids=x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
            paths.append(x)
    return paths


def evaluate(runner, name: str, original, model_dir, inputs, say, lm: bool, rounds: int):
    from ..conversion import convert

    forms = {}
    say(f"{runner.engine} {name}: stock ({runner.qtype})")
    forms["stock"] = runner.build(f"{name}-stock", original, None, model_dir, stock=True)
    plain, rep = convert(original, verify=False)
    rot, rrep = convert(original, rotate="hadamard", verify=False)
    if runner.engine == "ctranslate2":
        say(f"{runner.engine} {name}: ln-folded")
        forms["ln-folded"] = runner.build(f"{name}-lnfold", plain.eval(), None)
    say(f"{runner.engine} {name}: plain, rotated")
    forms["plain"] = runner.build(f"{name}-plain", plain.eval(), rep)
    forms["rotated"] = runner.build(f"{name}-rotated", rot.eval(), rrep)
    if True:  # CTranslate2: normfold's ±63 rows; onnxruntime: quantize_dynamic(reduce_range=True)
        say(f"{runner.engine} {name}: reduced-range int8 weights (stock, plain, rotated)")
        forms["stock+reduced"] = runner.build(f"{name}-stock-red", original, None, own="rtn-reduced")
        forms["plain+reduced"] = runner.build(f"{name}-plain-red", plain.eval(), rep, own="rtn-reduced")
        forms["rotated+reduced"] = runner.build(f"{name}-rotated-red", rot.eval(), rrep, own="rtn-reduced")
    return score(runner, name, forms, original, model_dir, inputs, say, lm, rounds)


def evaluate_gptq(runner, name: str, original, model_dir, inputs, cal, say, lm: bool, rounds: int):
    """The GPTQ rows: CTranslate2 int8 (GPTQ rows ±127 and ±63 beside the engine's and normfold's RTN rows);
    onnxruntime int4 MatMulNBits (GPTQ beside onnxruntime's own MatMulNBitsQuantizer and normfold's RTN, blocks
    of 32, symmetric), all against the engine's own int8 of the original."""
    from ..conversion import convert
    from ..engines.intweights import gptq_model, tied_head
    from ..quant import from_quantized

    forms, types = {}, {}
    say(f"{runner.engine} {name}: stock (int8)")
    forms["stock"] = runner.build(f"{name}-stock", original, None, model_dir, stock=True)
    plain, rep = convert(original, verify=False)
    rot, rrep = convert(original, rotate="hadamard", verify=False)
    variants = {"plain": (plain.eval(), rep), "rotated": (rot.eval(), rrep)}

    def gptq(model, bits, group):
        t = time.perf_counter()
        # int4: a head tied to the embedding stays float, as in the RTN forms (its ONNX weight is the embedding's
        # transpose, not a constant MatMulNBits can take); int8: every linear, as the engine's own rounding
        head = tied_head(model) if bits == 4 else None
        res = gptq_model(model, cal, bits=bits, group_size=group, skip=[head] if head else [])
        say(f"  GPTQ {bits}-bit: {time.perf_counter() - t:.0f} s")
        return res

    if runner.engine == "ctranslate2":
        for form, (m, r) in variants.items():
            say(f"{runner.engine} {name}: {form} (engine rounding, RTN ±63, GPTQ ±127, GPTQ ±63)")
            forms[form] = runner.build(f"{name}-{form}", m, r)
            forms[f"{form}+reduced"] = runner.build(f"{name}-{form}-red", m, r, own="rtn-reduced")
            for suffix, bits in (("gptq", 8), ("gptq-reduced", 7)):
                res = gptq(m, bits, None)
                forms[f"{form}+{suffix}"] = runner.build(f"{name}-{form}-{suffix}", res.model, r,
                                                         own=lambda w, _t=res.table: from_quantized(_t.lookup(w)))
        types = {f: "int8" for f in forms}
    else:
        say(f"{runner.engine} {name}: int4 stock (onnxruntime MatMulNBitsQuantizer)")
        forms["stock-int4"] = runner.build(f"{name}-stock4", original, None, own="ort", qtype="int4")
        res = gptq(original, 4, 32)
        forms["original-int4-gptq"] = runner.build(f"{name}-orig4g", res.model, None, own=res.table.lookup,
                                                   qtype="int4")
        for form, (m, r) in variants.items():
            say(f"{runner.engine} {name}: {form} int4 (RTN, GPTQ)")
            forms[f"{form}-int4-rtn"] = runner.build(f"{name}-{form}4", m, r, qtype="int4")
            res = gptq(m, 4, 32)
            forms[f"{form}-int4-gptq"] = runner.build(f"{name}-{form}4g", res.model, r, own=res.table.lookup,
                                                      qtype="int4")
        types = {f: "int8" if f == "stock" else "int4" for f in forms}
    rows, speed = score(runner, name, forms, original, model_dir, inputs, say, lm, rounds)
    for r in rows + speed:
        r["type"] = types.get(r["form"], "int8")
    return rows, speed


def score(runner, name: str, forms: dict, original, model_dir, inputs, say, lm: bool, rounds: int):
    with torch.no_grad():
        refs = [original(input_ids=ids, use_cache=False).logits.float() for ids in inputs]
    greedy = _greedy_paths(original, inputs)
    rows, per_input = [], {}
    for form, h in forms.items():
        kls, top1, ppl, geq = [], [], [], []
        for ids, ref, path in zip(inputs, refs, greedy):
            lg = runner.logits(h, ids)
            kls.append(kl_divergence(ref, lg))
            top1.append(float((lg.argmax(-1) == ref.argmax(-1)).float().mean()))
            ppl.append(_ppl(lg, ids))
            gl = runner.logits(h, path)
            geq.append(bool(torch.equal(gl[0, 31:-1].argmax(-1), path[0, 32:])))
        per_input[form] = kls
        rows.append({"engine": runner.engine, "model": name, "form": form, "type": runner.qtype,
                     "inputs": len(inputs), "kl_mean": statistics.fmean(kls), "top1_agree": statistics.fmean(top1),
                     "perplexity": round(math.exp(statistics.fmean(ppl)), 3) if lm else "",
                     "greedy_equal": sum(geq) / len(geq), "bytes": h["bytes"]})
    for r in rows:
        ratios = [k / max(s, 1e-30) for k, s in zip(per_input[r["form"]], per_input["stock"])]
        r["kl_ratio_median"], r["kl_ratio_q25"], r["kl_ratio_q75"] = _quartiles(ratios)
    say(f"{runner.engine} {name}: timing ({rounds} rounds)")
    ids = inputs[0]
    aa = runner.build(f"{name}-stock-aa", original, None, model_dir, stock=True)
    cands = {f: runner.forward(h, ids) for f, h in forms.items()}
    cands["stock (A/A)"] = runner.forward(aa, ids)
    stats = measure(cands, rounds=rounds, warmup=3, min_time=0.05)
    speed = []
    for f, st in stats.items():
        ratio = paired(st, stats["stock"])
        speed.append({"engine": runner.engine, "model": name, "form": f, "type": runner.qtype,
                      "ms_per_forward": st.median * 1e3, "tokens_per_s": ids.shape[1] / st.median,
                      # tokens/s ratio = inverse time ratio
                      "ratio_to_stock_median": 1 / ratio.median, "ratio_q25": 1 / ratio.q75,
                      "ratio_q75": 1 / ratio.q25, "verdict": ratio_verdict(ratio)})
    return rows, speed


def _summary(rows, speed) -> str:
    lines = ["#### KL to float32, per input against stock (median ratio; ≤ 1.0: never worse than the engine's own)\n",
             "| engine | model | form | type | KL mean | median ratio (q25–q75) | top-1 | greedy equal | tokens/s × stock |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    sp = {(s["engine"], s["model"], s["form"]): s for s in speed}
    for r in rows:
        s = sp.get((r["engine"], r["model"], r["form"]), {})
        lines.append(f"| {r['engine']} | {r['model']} | {r['form']} | {r['type']} | {r['kl_mean']:.4g} | "
                     f"{r['kl_ratio_median']:.3f} ({r['kl_ratio_q25']:.3f}–{r['kl_ratio_q75']:.3f}) | "
                     f"{r['top1_agree']:.4f} | {r['greedy_equal']:.2f} | "
                     f"{s.get('ratio_to_stock_median', float('nan')):.3f} |")
    aa = [s for s in speed if s["form"] == "stock (A/A)"]
    if aa:
        lines.append("\nA/A control (stock loaded twice): " + ", ".join(
            f"{s['engine']} {s['model']} {s['ratio_to_stock_median']:.3f} ({s['ratio_q25']:.3f}–{s['ratio_q75']:.3f})"
            for s in aa))
    return "\n".join(lines) + "\n"


def run(engine: str, model_dir, out_dir, *, inputs: int = 24, ctx: int = 128, qtype: str = "int8",
        progress: bool = True, rounds: int = 15, text=None, gptq: bool = False, calibration: str = "bundled",
        cal_windows: int = 16):
    """`gptq`: the GPTQ rows (`evaluate_gptq`), calibrated on `calibration` ("bundled": KJV chapters of the
    training split, disjoint from the held-out evaluation windows; or a text file), written as
    quant_<engine>_gptq.*."""
    import sys

    from ..io import load_source
    from .quant import heldout_batches, outlier_gpt2

    say = (lambda msg: print(f"[bench quant --engine] {msg}", file=sys.stderr)) if progress else (lambda m: None)
    t0 = time.perf_counter()
    if model_dir is None:
        model_dir = Path(__file__).resolve().parent.parent / "data" / "kjv-gpt2"
    batches = heldout_batches(inputs, ctx=ctx, batch=1, text=text)
    model, _ = load_source(model_dir)
    model = model.float().eval()
    name = Path(str(model_dir)).name
    tmp = Path(tempfile.mkdtemp(prefix="normfold-bench-engine-"))
    runner = (Ct2Runner if engine == "ctranslate2" else OrtRunner)(tmp, qtype)
    cal = None
    if gptq:
        from .quant_gptq import calibration_batches

        cal = calibration_batches(calibration, None if calibration == "bundled" else model_dir, windows=cal_windows,
                                  text=text)

    def ev(runner, name, original, model_dir, inputs, say, lm, rounds):
        if not gptq:
            return evaluate(runner, name, original, model_dir, inputs, say, lm, rounds)
        c = [b.clamp_max(int(original.config.vocab_size) - 1) for b in cal]
        return evaluate_gptq(runner, name, original, model_dir, inputs, c, say, lm, rounds)

    rows, speed = ev(runner, name, model, model_dir, batches, say, True, rounds)
    vocab = int(model.config.vocab_size)
    out_model = outlier_gpt2(vocab=max(vocab, 2048))
    out_dir_model = None
    if engine == "ctranslate2" and int(out_model.config.vocab_size) == vocab:
        out_dir_model = tmp / "outlier-gpt2"  # a directory for the stock converter: weights + the bundled tokenizer
        out_model.save_pretrained(out_dir_model)
        for f in Path(model_dir).iterdir():
            if f.name.startswith("tokenizer"):
                (out_dir_model / f.name).write_bytes(f.read_bytes())
    r2, s2 = ev(runner, "outlier-gpt2", out_model, out_dir_model,
                [b.clamp_max(int(out_model.config.vocab_size) - 1) for b in batches], say, False, rounds)
    rows += r2
    speed += s2
    machine = machine_info()
    machine["seconds"] = round(time.perf_counter() - t0, 1)
    machine["engine"] = engine
    try:
        import importlib.metadata as md

        machine["engine_version"] = md.version("ctranslate2" if engine == "ctranslate2" else "onnxruntime")
    except Exception:
        pass
    extra = _summary(rows, speed)
    stem = f"quant_{engine}" + ("_gptq" if gptq else "")
    if gptq:
        machine["calibration"] = calibration
        machine["calibration_tokens"] = int(sum(b.numel() for b in cal))
        qtype = "int8" if engine == "ctranslate2" else "int4 (and int8 stock)"
    paths = write(rows, stem, out_dir, machine, COLUMNS,
                  f"{engine} {qtype}: teacher-forced KL to the float32 original, {inputs} held-out KJV windows of "
                  f"{ctx} tokens, paired per input against the engine's own conversion of the original", extra=extra)
    sp = write(speed, f"{stem}_speed", out_dir, machine, SPEED_COLUMNS,
               f"{engine} {qtype}: one {ctx}-token forward, 1 thread, interleaved rounds, paired to stock")
    paths["speed_csv"] = sp["csv"]
    return rows, speed, paths
