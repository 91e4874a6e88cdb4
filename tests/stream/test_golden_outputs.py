"""Golden outputs: the SHA-256 of every file a conversion writes, for every family's first tiny example ×
rmsnorm / crmsnorm / rotate / untie / fold-final / reverse, converted in memory (`normfold.convert` +
`normfold.save`) and streamed (`normfold.stream.stream_convert`), compared with the digests recorded in
golden_outputs.json. A change to how a conversion is organised must not change one output byte; a change
that is meant to change outputs re-records the file:

    NORMFOLD_GOLDEN_RECORD=1 python -m pytest -q tests/stream/test_golden_outputs.py

What is hashed, per output directory:
- every `*.safetensors` file and `model.safetensors.index.json`, byte for byte;
- `config.json` and `generation_config.json` without their `transformers_version` field (the installed
  transformers writes its own version there; everything else, `tie_word_embeddings` included, is hashed);
- `normfold.json` without `seconds` (wall time), `normfold_version` (the package's release number),
  `options` (the recorded `ConvertOptions`, checked by tests/test_options.py's round trip) and with the
  temporary directory's path replaced by `<tmp>` (a streamed report names its source directory).

A case the conversion refuses is recorded as "refused" (which error class is left to the tests of the
options). Seeds are fixed (make_checkpoint), so the digests repeat run after run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import normfold
from normfold.adapters import FAMILIES as REGISTRY, get_adapter
from normfold.errors import NormfoldError
from normfold.stream import stream_convert

from _compare import make_checkpoint

GOLDEN = Path(__file__).with_name("golden_outputs.json")
RECORD = os.environ.get("NORMFOLD_GOLDEN_RECORD") == "1"

OPTIONS = {  # case name -> conversion keywords
    "rmsnorm": {"to": "rmsnorm"},
    "crmsnorm": {"to": "crmsnorm"},
    "rotate": {"to": "rmsnorm", "rotate": "hadamard"},
    "untie": {"to": "rmsnorm", "untie": True},
    "fold-final": {"to": "rmsnorm", "fold_final": True},
}
REVERSE = {"reverse-rmsnorm": "rmsnorm", "reverse-crmsnorm": "crmsnorm"}  # back to layernorm from this output
HEAD_WORDS = ("LMHead", "CausalLM", "MaskedLM", "ConditionalGeneration", "ImageClassification")
VOLATILE_REPORT = ("seconds", "normfold_version", "options")


def _head(example) -> str:
    return next((h for h in example.heads if any(w in h for w in HEAD_WORDS)), example.heads[0])


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digests(out: Path, tmp: Path) -> dict[str, str]:
    """{file name: sha256} of one output directory, volatile fields left out (module docstring)."""
    found = {}
    for f in sorted(out.iterdir()):
        if f.suffix == ".safetensors" or f.name == "model.safetensors.index.json":
            found[f.name] = _digest(f.read_bytes())
        elif f.name in ("config.json", "generation_config.json"):
            cfg = json.loads(f.read_text())
            cfg.pop("transformers_version", None)
            found[f.name] = _digest(json.dumps(cfg, sort_keys=True).encode())
        elif f.name == "normfold.json":
            rep = json.loads(f.read_text().replace(str(tmp), "<tmp>"))
            for key in VOLATILE_REPORT:
                rep.pop(key, None)
            found[f.name] = _digest(json.dumps(rep, sort_keys=True).encode())
        else:
            found[f.name] = _digest(f.read_bytes())
    return found


def _in_memory(src: Path, out: Path, **kw) -> None:
    model = normfold.load(src) if (src / "normfold.json").is_file() else normfold.io.load_source(src)[0]
    conv, report = normfold.convert(model, verify=False, **kw)
    normfold.save(conv, report, out, source_dir=src)


def _streamed(src: Path, out: Path, **kw) -> None:
    out.mkdir()
    stream_convert(src, out, **kw)


def family_digests(family: str, tmp: Path) -> dict:
    example = get_adapter(family).examples[0]
    src = make_checkpoint(example, _head(example), tmp / "src")
    found: dict[str, dict] = {}
    for case, kw in OPTIONS.items():
        for how, run in (("memory", _in_memory), ("stream", _streamed)):
            out = tmp / f"{case}-{how}"
            try:
                run(src, out, **kw)
            except NormfoldError:
                found[f"{case}/{how}"] = "refused"
                continue
            found[f"{case}/{how}"] = digests(out, tmp)
    for case, forward in REVERSE.items():
        rms = tmp / f"{forward}-memory"
        if not (rms / "normfold.json").is_file():
            continue
        for how, run in (("memory", _in_memory), ("stream", _streamed)):
            out = tmp / f"{case}-{how}"
            try:
                run(rms, out, to="layernorm")
            except NormfoldError:
                found[f"{case}/{how}"] = "refused"
                continue
            found[f"{case}/{how}"] = digests(out, tmp)
    return found


# every family of the family registry (normfold.adapters.families) that has an adapter
FAMILIES = sorted(f.name for f in REGISTRY if f.adapter is not None)


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_byte_identical_to_golden(tmp_path, family):
    found = family_digests(family, tmp_path)
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    if RECORD:
        recorded[family] = found
        GOLDEN.write_text(json.dumps(dict(sorted(recorded.items())), indent=1, sort_keys=True) + "\n")
        return
    assert family in recorded, f"no golden digests for {family}: record them (module docstring)"
    want = recorded[family]
    assert sorted(found) == sorted(want)
    changed = [case for case in want if found[case] != want[case]]
    assert not changed, f"{family}: outputs changed for {', '.join(changed)}"
