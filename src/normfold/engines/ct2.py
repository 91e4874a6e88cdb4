"""A CTranslate2 model from a converted (or rotated) normfold model: `normfold export DIR --ctranslate2 OUT`.

The model is laid out by CTranslate2's own per-family loaders (`ctranslate2.converters.transformers.
<Family>Loader`, the code behind `ct2-transformers-converter`; classes of that module, not documented
API) into the engine's public spec (`ctranslate2.specs`), with every normfold norm written first as a
LayerNorm with unit γ (or the norm's own weight) and zero β. That form is exact wherever normfold's
Recenter steps sit, because a LayerNorm subtracts the mean they would have removed. Then, per residual
stream, the norms become RMSNorm (a norm spec without `beta`, which the engine runs as RMSNorm) when
every contribution to the stream is zero-mean inside the engine too:

- a Recenter after an embedding table is written as the centred table itself (the head, if tied,
  keeps the original table: the spec holds the two separately);
- a Recenter the engine has no place for (after Whisper's conv stem, after BLOOM's / mBART's
  embedding LayerNorm) leaves that stream's norms as LayerNorm, and the export says so.

The model's epsilon is written in the config (the engine's RMSNorm otherwise defaults to 1e-6).
Integer weights: `--quantization int8` lets the engine round (per output row, absmax) unless
`own_weights` is given, in which case normfold's `normfold.quant.quantize_weight` computes them
(after any rotation, in the rotated basis) and they are written as `weight` int8 + `weight_scale`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import NormfoldError

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "bfloat16")

# config class → (CTranslate2 loader class, the head class it reads)
LOADERS = {
    "GPT2Config": ("GPT2Loader", "GPT2LMHeadModel"),
    "OPTConfig": ("OPTLoader", "OPTForCausalLM"),
    "GPTNeoXConfig": ("GPTNeoXLoader", "GPTNeoXForCausalLM"),
    "WhisperConfig": ("WhisperLoader", "WhisperForConditionalGeneration"),
    "GPTJConfig": ("GPTJLoader", "GPTJForCausalLM"),
    "BloomConfig": ("BloomLoader", "BloomForCausalLM"),
    "FalconConfig": ("FalconLoader", "FalconForCausalLM"),
    "GPTBigCodeConfig": ("GPTBigCodeMHALoader", "GPTBigCodeForCausalLM"),
    "MBartConfig": ("MBartLoader", "MBartForConditionalGeneration"),
}

# why a family the conversion handles is refused here
REFUSED = {
    "PhiConfig": "CTranslate2 4.x's Phi loader reads the old remote-code layout (transformer.embd, mixer.Wqkv), "
                 "not transformers' PhiForCausalLM; the engine has no converter for this model",
}


class CTranslate2Error(NormfoldError):
    """A CTranslate2 export that cannot be done as asked (missing package, family, option)."""


def require_ctranslate2() -> None:
    if importlib.util.find_spec("ctranslate2") is None:
        raise CTranslate2Error("CTranslate2 export needs the ctranslate2 package: pip install 'normfold[ctranslate2]'")


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise CTranslate2Error(f"--quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")


def check_family(model: nn.Module) -> str:
    """The loader name for `model`, or a CTranslate2Error saying why the engine cannot run it."""
    config = getattr(model, "config", None)
    name = type(config).__name__
    if name in REFUSED:
        raise CTranslate2Error(f"{type(model).__name__}: {REFUSED[name]}")
    if name not in LOADERS:
        raise CTranslate2Error(f"{type(model).__name__} ({name}): no CTranslate2 export for this family; supported: "
                               + ", ".join(h for _, h in LOADERS.values()))
    loader, head = LOADERS[name]
    if type(model).__name__ != head:
        raise CTranslate2Error(f"{type(model).__name__}: CTranslate2 runs {name} as {head} (with its LM head); "
                               f"convert that class (e.g. `normfold convert` a {head} checkpoint)")
    if name == "GPTBigCodeConfig" and not getattr(config, "multi_query", True):
        raise CTranslate2Error("GPT-BigCode with multi_query=False: CTranslate2's loader writes every GPT-BigCode as "
                               "multi-query attention, which this model is not")
    if name == "GPT2Config" and getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise CTranslate2Error("GPT-2 with scale_attn_by_inverse_layer_idx=True: CTranslate2 has no per-layer "
                               "attention scale and would compute another model; not exported")
    if name == "BloomConfig" and getattr(config, "apply_residual_connection_post_layernorm", False):
        raise CTranslate2Error("BLOOM with apply_residual_connection_post_layernorm=True: CTranslate2's loader "
                               "has no such option and would compute another model; not exported")
    if name == "OPTConfig" and not getattr(config, "do_layer_norm_before", True):
        raise CTranslate2Error("post-LayerNorm OPT (do_layer_norm_before=False, OPT-350m): CTranslate2's loader "
                               "writes it as a pre-norm model whose final norm it lacks; not exported")
    return loader


def check_rotation(report) -> None:
    """Refuse the rotation steps the engine has no place for: an explicit x·Q on a stream (after Whisper's conv
    stem, BLOOM's / mBART's embedding norm) and online Hadamard transforms."""
    rotation = getattr(getattr(report, "structure", None), "rotation", None) or {}
    explicit = [e.get("path", "?") for e in rotation.get("explicit", []) or []]
    if explicit:
        raise CTranslate2Error(f"this rotated model applies an explicit rotation at {', '.join(explicit)} (a stream "
                               "whose first writer is not a linear map); CTranslate2 has no step there. Export the "
                               "model converted without --rotate")
    if rotation.get("online"):
        raise CTranslate2Error("this model has online Hadamard transforms (--rotate-online), which CTranslate2 "
                               "cannot run; export the model converted without --rotate-online")


def _norm_classes():
    from ..nn import RMSNorm

    return (RMSNorm,)


@dataclass
class NormForm:
    name: str
    form: str  # "RMSNorm" or "LayerNorm"
    why: str = ""
    stream: str = "decoder"


@dataclass
class Ct2Spec:
    spec: object
    norms: list[NormForm] = field(default_factory=list)
    streams: dict[str, str] = field(default_factory=dict)  # stream → "RMSNorm" / "LayerNorm: why"
    centred_tables: list[str] = field(default_factory=list)
    eps: float | None = None
    kind: str = "generator"  # "generator", "whisper", "translator"


def _stream_of(name: str) -> str:
    parts = name.split(".")
    return "encoder" if "encoder" in parts else "decoder"


class _VocabOnly:
    """A stand-in tokenizer for model directories without one (placeholder tokens, ids in order)."""

    def __init__(self, size: int, named: dict[int, str] | None = None, config=None):
        self.size = size
        self.named = named or {}
        self.bos_token = self.eos_token = self.unk_token = self.convert_ids_to_tokens(0)
        for key in ("bos", "eos", "unk"):
            i = getattr(config, f"{key}_token_id", None) if config is not None else None
            if isinstance(i, int) and 0 <= i < size:
                setattr(self, f"{key}_token", self.convert_ids_to_tokens(i))
        self.additional_special_tokens: list[str] = []

    def get_vocab(self):
        return {self.convert_ids_to_tokens(i): i for i in range(self.size)}

    def convert_ids_to_tokens(self, i):
        return self.named.get(int(i), f"<{int(i)}>")


def _placeholder_tokenizer(model) -> _VocabOnly:
    cfg = model.config
    named = {}
    if type(cfg).__name__ == "WhisperConfig":  # the engine finds these by name in the prompt
        v = _vocab_size(model)
        named = {v - 4: "<|transcribe|>", v - 3: "<|nocaptions|>", v - 2: "<|notimestamps|>", v - 1: "<|0.00|>",
                 int(cfg.decoder_start_token_id): "<|startoftranscript|>", int(cfg.eos_token_id): "<|endoftext|>"}
    return _VocabOnly(_vocab_size(model), named, cfg)


def _vocab_size(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])


def _eps(model) -> float | None:
    from ..nn import RMSNorm

    eps = {float(m.eps) for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))}
    if len(eps) > 1:
        raise CTranslate2Error(f"the model's norms use several epsilons {sorted(eps)}; CTranslate2 has one "
                               "global layer_norm_epsilon")
    return eps.pop() if eps else None


def _stream_forms(model, report) -> dict[str, str]:
    """Per stream, "RMSNorm" when every contribution is zero-mean inside the engine, else why not."""
    structure = getattr(report, "structure", None)
    modules = dict(model.named_modules())
    forms = {"encoder": "RMSNorm", "decoder": "RMSNorm"}
    if structure is None:
        return {k: "LayerNorm: not a normfold conversion (no report)" for k in forms}
    for name in structure.recenter_before:
        forms[_stream_of(name)] = (f"LayerNorm: {name} needs a Recenter before it (the stream from the stem), and "
                                   "the engine has no step there")
    for name in structure.recenter_after:
        if not isinstance(modules.get(name), nn.Embedding):
            forms[_stream_of(name)] = (f"LayerNorm: the output of {name} is recentred, which the engine cannot "
                                       "express (it is not an embedding table to centre)")
    for name, m in modules.items():
        if type(m) is nn.LayerNorm and not any(k in name for k in ("q_layernorm", "k_layernorm")):
            forms[_stream_of(name)] = f"LayerNorm: {name} was left a LayerNorm by the conversion"
    return forms


def _visit_layers(layer, fn) -> None:
    from ctranslate2.specs import model_spec

    fn(layer)
    for v in list(vars(layer).values()):
        for sub in (v if isinstance(v, list) else [v]):
            if isinstance(sub, model_spec.LayerSpec):
                _visit_layers(sub, fn)


def _gptj_qkv_bias(spec, model) -> None:
    """CTranslate2's GPT-J loader writes q/k/v weights only; a conversion that gave them biases (--allow-new-bias)
    needs them written too, permuted as the loader permutes the rows."""
    from ctranslate2.converters import utils

    cfg = model.config
    for layer_spec, layer in zip(spec.decoder.layer, model.transformer.h):
        attn = layer.attn
        if attn.q_proj.bias is None and attn.k_proj.bias is None and attn.v_proj.bias is None:
            continue
        parts = []
        for lin, rotate in ((attn.q_proj, True), (attn.k_proj, True), (attn.v_proj, False)):
            b = lin.bias.detach().clone() if lin.bias is not None else torch.zeros(lin.out_features)
            if rotate:
                b = utils.permute_for_sliced_rotary(b[:, None], cfg.n_head, cfg.rotary_dim)[:, 0]
            parts.append(b)
        layer_spec.self_attention.linear[0].bias = torch.cat(parts)


@contextlib.contextmanager
def _compat(model):
    """The names CTranslate2 4.x's loaders read under transformers 4 spellings, added for the duration of
    the layout (transformers 5 keeps rotary settings in `rope_parameters` and names GPT-NeoX's head lm_head)."""
    config = model.config
    added, attrs = [], []
    if type(config).__name__ == "GPTNeoXConfig" and not hasattr(model, "embed_out"):
        object.__setattr__(model, "embed_out", model.get_output_embeddings())
        attrs.append("embed_out")
    if type(config).__name__ == "GPTNeoXConfig" and not hasattr(config, "rotary_pct"):
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", 10000.0)
        if float(theta) != 10000.0:
            raise CTranslate2Error(f"GPT-NeoX with rope_theta {theta}: CTranslate2's loader writes the default 10000")
        config.rotary_pct = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        added.append("rotary_pct")
    if type(config).__name__ == "MBartConfig" and not hasattr(config, "normalize_before"):
        config.normalize_before = True  # mBART is pre-LN throughout (transformers 5 dropped the field)
        added.append("normalize_before")
    try:
        yield
    finally:
        for k in added:
            delattr(config, k)
        for k in attrs:
            object.__delattr__(model, k)


def build_spec(model: nn.Module, report=None, tokenizer=None) -> Ct2Spec:
    """The CTranslate2 spec of `model` (a normfold-converted model, or any model of a supported family)."""
    require_ctranslate2()
    from ctranslate2.converters import transformers as ct2t

    loader_name = check_family(model)
    check_rotation(report)
    # the loaders permute some weights in place and `optimize` quantizes in place what the spec holds:
    # they get a copy, the caller's model stays as it was
    model = copy.deepcopy(model)
    base = getattr(ct2t, loader_name)
    rms_classes = _norm_classes()
    modules = {id(m): n for n, m in model.named_modules()}
    structure = getattr(report, "structure", None)
    recentred = set(getattr(structure, "recenter_after", []) or [])
    seen: list[tuple[object, str, bool]] = []
    centred: list[str] = []

    class Loader(base):
        def set_layer_norm(self, spec, module):
            d = module.normalized_shape[-1] if hasattr(module, "normalized_shape") else module.weight.shape[-1]
            w = getattr(module, "weight", None)
            b = getattr(module, "bias", None)
            spec.gamma = w.detach() if w is not None else torch.ones(d)
            spec.beta = b.detach() if b is not None else torch.zeros(d)
            seen.append((spec, modules.get(id(module), "?"), isinstance(module, rms_classes), b is not None))

        def set_embeddings(self, spec, module):
            name = modules.get(id(module), "")
            w = module.weight.detach()
            if name in recentred:
                w = w - w.double().mean(dim=-1, keepdim=True).to(w.dtype)
                centred.append(name)
            spec.weight = w

        if tokenizer is None:
            def get_vocabulary(self, model, tokenizer):
                return list(tokenizer.get_vocab())

    loader = Loader()
    tok = tokenizer if tokenizer is not None else _placeholder_tokenizer(model)
    with torch.no_grad(), _compat(model):
        try:
            spec = loader(model, tok)
        except Exception as exc:
            raise CTranslate2Error(f"CTranslate2's {loader_name} could not lay out {type(model).__name__} (the "
                                   f"engine's converter fails on this configuration): {type(exc).__name__}: "
                                   f"{str(exc)[:300]}") from exc
    if loader_name == "GPTJLoader":
        _gptj_qkv_bias(spec, model)
    kind = {"WhisperLoader": "whisper", "MBartLoader": "translator"}.get(loader_name, "generator")
    cfg = spec.config
    if kind == "whisper":
        for key in ("suppress_ids", "suppress_ids_begin", "lang_ids"):
            if getattr(cfg, key, None) is None:
                setattr(cfg, key, [])
    eps = _eps(model)
    if eps is not None:
        if hasattr(cfg, "layer_norm_epsilon"):
            cfg.layer_norm_epsilon = eps
        else:  # WhisperConfig has no such field; the engine reads it from config.json all the same
            cfg.add_attribute("layer_norm_epsilon", eps)
    streams = _stream_forms(model, report)
    out = Ct2Spec(spec, streams=streams, centred_tables=centred, eps=eps, kind=kind)
    for norm_spec, name, is_rms, has_bias in seen:
        stream_form = streams[_stream_of(name)]
        if is_rms and has_bias and stream_form == "RMSNorm":
            # the engine's RMSNorm has no β; on the zero-mean stream LayerNorm(γ, β) computes the same
            out.norms.append(NormForm(name, "LayerNorm", "it keeps a bias (β), which the engine's RMSNorm has "
                                      "no place for (a reader without a bias could not absorb it: convert with "
                                      "--allow-new-bias for RMSNorm here)", _stream_of(name)))
        elif is_rms and stream_form == "RMSNorm":
            del norm_spec.beta  # no beta: the engine runs it as RMSNorm
            out.norms.append(NormForm(name, "RMSNorm", stream=_stream_of(name)))
        else:
            why = stream_form.split(": ", 1)[1] if is_rms else "a LayerNorm in the model"
            out.norms.append(NormForm(name, "LayerNorm", why, _stream_of(name)))
    return out


def set_own_int8(spec, method="rtn") -> int:
    """Replace every int8 linear weight of an optimized spec by normfold's int8 rows (`weight` int8 +
    `weight_scale`, the engine's multiplier 1 / scale); returns how many. The float weights must have been
    kept by `_keep_float_weights` before `spec.optimize("int8...")`. `method`: a name registered in
    `normfold.quant.integer.METHODS`, or a callable (float weight [out, in] → IntWeight), e.g. a GPTQ
    `RowTable` lookup (`normfold.engines.intweights`)."""
    import numpy as np
    from ctranslate2.specs import common_spec, model_spec

    from ..quant import quantize_weight

    count = 0

    def own(layer):
        nonlocal count
        w = vars(layer).get("_nf_float")
        if isinstance(layer, common_spec.LinearSpec) and w is not None and _is_int8(layer.weight):
            iw = quantize_weight(w, bits=8, method=method) if isinstance(method, str) else method(w)
            if iw.group_size is not None or iw.q.shape != w.shape:
                raise CTranslate2Error("CTranslate2 int8 stores one scale per output row: per-group weights "
                                       "cannot be written")
            layer.weight = model_spec.NumpyVariable(iw.q.numpy())
            layer.weight_scale = model_spec.NumpyVariable((1.0 / iw.scale).numpy().astype(np.float32))
            count += 1

    _visit_layers(spec, own)
    return count


def _is_int8(var) -> bool:
    return str(getattr(var, "dtype", "")) == "int8"


def _keep_float_weights(spec) -> None:
    """Remember each linear weight in float32 before `optimize` quantizes it in place."""
    from ctranslate2.specs import common_spec

    def keep(layer):
        if isinstance(layer, common_spec.LinearSpec) and isinstance(layer.weight, torch.Tensor):
            object.__setattr__(layer, "_nf_float", layer.weight.detach().to(torch.float32).clone())

    _visit_layers(spec, keep)


def write(ct2: Ct2Spec, out: str | os.PathLike, quantization: str = "float32", *, files=(), force: bool = False,
          own_weights=None) -> Path:
    """Validate, quantize and save the spec to directory `out` atomically (temp dir beside it, then rename).
    `files` are copied into it (tokenizer files). `own_weights` ("rtn", a registered method, or a callable
    float weight → IntWeight such as a GPTQ row table's) writes normfold's int8 weights instead of the
    engine's (int8 types only); nothing is written if one fails."""
    from ..io.atomic import check_output_dir, output_lock, staged_dir

    check_quantization(quantization)
    if own_weights and not quantization.startswith("int8"):
        raise CTranslate2Error(f"own integer weights need an int8 --quantization, not {quantization}")
    out = check_output_dir(out, force).absolute()
    spec = ct2.spec
    with output_lock(out), staged_dir(out) as tmp:
        if own_weights:
            _keep_float_weights(spec)
        try:
            spec.validate()
        except ValueError as exc:
            raise CTranslate2Error(f"CTranslate2 rejects the model: {exc}") from None
        spec.optimize(quantization=quantization)
        if own_weights:
            set_own_int8(spec, own_weights)
        spec.save(str(tmp))
        for f in files:
            shutil.copy2(f, tmp / Path(f).name)
    return out


def read_variables(path) -> dict:
    """The variables of a written CTranslate2 model (`model.bin`, the format its `ModelSpec.save` writes) as
    {name: numpy array}; aliases map to their target's array. For checking what a file holds."""
    import struct

    import numpy as np

    dtypes = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # bfloat16: raw uint16 below
    data = (Path(path) / "model.bin").read_bytes()
    pos = 0

    def take(fmt):
        nonlocal pos
        vals = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return vals[0]

    def string():
        nonlocal pos
        n = take("H")
        s = data[pos:pos + n - 1].decode("utf-8")
        pos += n
        return s

    take("I")
    string()
    take("I")
    out = {}
    for _ in range(take("I")):
        name = string()
        shape = [take("I") for _ in range(take("B"))]
        dt = dtypes[take("B")] or np.uint16
        nbytes = take("I")
        out[name] = np.frombuffer(data[pos:pos + nbytes], dtype=dt).reshape(shape)
        pos += nbytes
    for _ in range(take("I")):
        alias = string()
        out[alias] = out.get(string())
    return out


def model_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


# ---------------------------------------------------------------- running it


def generator(path, threads: int = 0):
    import ctranslate2

    return ctranslate2.Generator(str(path), device="cpu", compute_type="default", intra_threads=threads)


def generator_logits(gen, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits [batch, seq, vocab] of a decoder-only model for token ids [batch, seq]."""
    import numpy as np

    out = gen.forward_batch([row.tolist() for row in ids])
    return torch.from_numpy(np.array(out)).float()


def translator(path, threads: int = 0):
    import ctranslate2

    return ctranslate2.Translator(str(path), device="cpu", compute_type="default", intra_threads=threads)


def translator_scores(tr, src: torch.Tensor, tgt: torch.Tensor, vocab: list[str]) -> list[list[float]]:
    """Per target token log-probabilities (the engine has no teacher-forced logits for translators):
    entry i scores tgt[i + 1] given src and tgt[:i + 1], the last entry the end token."""
    res = tr.score_batch([[vocab[i] for i in row.tolist()] for row in src],
                         [[vocab[i] for i in row.tolist()] for row in tgt])
    return [list(r.log_probs) for r in res]


def whisper_model(path, threads: int = 0):
    import ctranslate2

    return ctranslate2.models.Whisper(str(path), device="cpu", compute_type="default", intra_threads=threads)


def whisper_encode(wm, features: torch.Tensor) -> torch.Tensor:
    import ctranslate2
    import numpy as np

    sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(features.float().numpy()))
    return torch.from_numpy(np.array(wm.encode(sv, to_cpu=True))).float()


def whisper_step_logprobs(wm, features: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
    """log p(next | prefix) [len(prefixes), vocab] for one clip: one greedy step per prefix (the
    engine has no teacher-forced forward for Whisper)."""
    import ctranslate2
    import numpy as np

    feats = np.ascontiguousarray(features.float().numpy())
    if feats.ndim == 2:
        feats = feats[None]
    enc = wm.encode(ctranslate2.StorageView.from_array(feats), to_cpu=True)
    enc = np.array(enc)
    rows = []
    for p in prefixes:
        res = wm.generate(ctranslate2.StorageView.from_array(enc), [p], beam_size=1, max_length=len(p) + 1,
                          return_logits_vocab=True, suppress_blank=False, suppress_tokens=[])
        rows.append(torch.from_numpy(np.array(res[0].logits[0][0])).float())
    return torch.stack(rows)


def whisper_greedy(wm, features: torch.Tensor, prompt: list[int], max_length: int) -> list[int]:
    import ctranslate2
    import numpy as np

    feats = np.ascontiguousarray(features.float().numpy())
    res = wm.generate(ctranslate2.StorageView.from_array(feats), [prompt], beam_size=1, max_length=max_length,
                      suppress_blank=False, suppress_tokens=[], max_initial_timestamp_index=10 ** 6)
    return list(res[0].sequences_ids[0])


# ---------------------------------------------------------------- the check


def vocabulary(path) -> list[str]:
    """The target vocabulary of a written CTranslate2 model directory."""
    import json

    path = Path(path)
    for name in ("vocabulary.json", "target_vocabulary.json", "shared_vocabulary.json"):
        if (path / name).is_file():
            return json.loads((path / name).read_text())
    for name in ("vocabulary.txt", "target_vocabulary.txt", "shared_vocabulary.txt"):
        if (path / name).is_file():
            return (path / name).read_text().split("\n")[:-1]
    raise CTranslate2Error(f"{path}: no vocabulary file")


def special_ids(model) -> set[int]:
    """Token ids the engine treats specially in Whisper prompts (kept out of the check's inputs)."""
    cfg = model.config
    if type(cfg).__name__ != "WhisperConfig":
        return set()
    v = _vocab_size(model)
    ids = {v - 4, v - 3, v - 2, v - 1, int(cfg.decoder_start_token_id), int(cfg.eos_token_id)}
    for key in ("pad_token_id", "bos_token_id"):
        if isinstance(getattr(cfg, key, None), int):
            ids.add(getattr(cfg, key))
    return ids


def check_inputs(model, kind: str, generator_: torch.Generator, length: int = 8, batch: int = 2,
                 ids: torch.Tensor | None = None) -> dict:
    """Token ids (and Whisper features) to run both models on."""
    v = _vocab_size(model)
    cfg = model.config
    if ids is None:
        ids = torch.randint(0, v, (batch, length), generator=generator_)
    if kind == "generator":
        return {"input_ids": ids}
    start = int(cfg.decoder_start_token_id)
    bad = special_ids(model)
    tgt = ids.clone()
    for b in sorted(bad):
        tgt[tgt == b] = next(i for i in range(v) if i not in bad)
    tgt[:, 0] = start
    if kind == "whisper":
        frames = 2 * int(cfg.max_source_positions)
        feats = torch.randn(ids.shape[0], int(cfg.num_mel_bins), frames, generator=generator_)
        return {"input_features": feats, "decoder_input_ids": tgt}
    return {"input_ids": ids, "decoder_input_ids": tgt}


def engine_logits(path, kind: str, inputs: dict, vocab: list[str] | None = None, threads: int = 0) -> torch.Tensor:
    """What the engine gives for `inputs`, teacher-forced: logits [batch, seq, vocab] (decoders, Whisper:
    entries the engine's timestamp rules mask are -inf), or per-token log-probabilities [batch, seq - 1]
    of the next target token (translators)."""
    if kind == "generator":
        return generator_logits(generator(path, threads), inputs["input_ids"])
    if kind == "whisper":
        wm = whisper_model(path, threads)
        rows = []
        for b in range(inputs["input_features"].shape[0]):
            p = inputs["decoder_input_ids"][b].tolist()
            lp = whisper_step_logprobs(wm, inputs["input_features"][b], [p[:i] for i in range(1, len(p) + 1)])
            rows.append(lp.masked_fill(lp < -1e30, float("-inf")))
        return torch.stack(rows)
    vocab = vocab or vocabulary(path)
    scores = translator_scores(translator(path, threads), inputs["input_ids"], inputs["decoder_input_ids"], vocab)
    return torch.tensor([s[:-1] for s in scores])


def torch_logits(model, kind: str, inputs: dict) -> torch.Tensor:
    """The same quantity from the PyTorch model."""
    with torch.no_grad():
        if kind == "generator":
            return model(input_ids=inputs["input_ids"], use_cache=False).logits.float()
        if kind == "whisper":
            return model(input_features=inputs["input_features"], decoder_input_ids=inputs["decoder_input_ids"],
                         use_cache=False).logits.float()
        tgt = inputs["decoder_input_ids"]
        logits = model(input_ids=inputs["input_ids"], decoder_input_ids=tgt, use_cache=False).logits.float()
        lp = torch.log_softmax(logits, -1)[:, :-1]
        return lp.gather(-1, tgt[:, 1:, None])[..., 0]


def compare(got: torch.Tensor, want: torch.Tensor, kind: str) -> dict:
    """max abs / relative error (to the largest |want|) over the entries the engine computed, and top-1
    agreement of the logits (not for translators' scores)."""
    ok = torch.isfinite(got)
    diff = (got - want).abs().masked_fill(~ok, 0)
    scale = float(want.abs().masked_fill(~ok, 0).max().clamp_min(1e-30))
    out = {"max_abs_error": float(diff.max()), "max_rel_error": float(diff.max()) / scale}
    if kind != "translator":
        # top-1 over the entries both computed (Whisper: the engine masks timestamp tokens)
        w = want.masked_fill(~ok, float("-inf"))
        out["top1_agreement"] = float((got.argmax(-1) == w.argmax(-1)).float().mean())
    return out


def greedy_path(model, kind: str, inputs: dict, steps: int) -> torch.Tensor:
    """The PyTorch model's greedy continuation of the first input row (decoder-only models): ids [1, n + steps]."""
    ids = inputs["input_ids"][:1]
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def greedy_equal(path, model, inputs: dict, steps: int = 8, threads: int = 0) -> bool:
    """Whether the engine's greedy tokens equal PyTorch's: the engine's argmax at every step of PyTorch's
    greedy path (which is then the engine's own greedy path)."""
    path_ids = greedy_path(model, "generator", inputs, steps)
    got = generator_logits(generator(path, threads), path_ids)
    n = inputs["input_ids"].shape[1]
    return bool(torch.equal(got[0, n - 1:-1].argmax(-1), path_ids[0, n:]))
