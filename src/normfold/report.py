"""The conversion report: what was converted, what was kept and why, and the verification numbers.

Serialized as `normfold.json` next to a saved checkpoint (docs/verification.md, "Checkpoints"). The
`structure` part is also the recipe `normfold.load` replays to rebuild the converted modules on
top of a stock model.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Optional, Union

from .errors import ReportSchemaError

# 1: the first format. 2: adds `weight_files` (each weight file's SHA-256 and size, tamper evidence).
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")



# how the note of a tied embedding/head kept in the Recenter form begins (convert.recentre_tied_tables)
TIE_NOTE = "tied embedding/head kept tied"

@dataclass
class NormRecord:
    """A converted norm: its module path, new type and which parts of its affine it still holds."""

    name: str
    type: str  # "RMSNorm", "CRMSNorm", "UnifiedNorm", ...
    eps: float
    weight: bool
    bias: bool
    folded_into: list[str] = field(default_factory=list)
    # Whether the stock module had these parameters (a stock-layout save writes ones / zeros there).
    stock_weight: bool = True
    stock_bias: bool = True
    # Constructor options of the new module beyond eps/weight/bias (e.g. UnifiedNorm's window sizes).
    options: dict = field(default_factory=dict)


@dataclass
class Structure:
    """Module-level changes made on top of the stock architecture (replayed by `normfold.load`)."""

    norms: list[NormRecord] = field(default_factory=list)
    recenter_after: list[str] = field(default_factory=list)  # modules whose output gets a Recenter
    recenter_before: list[str] = field(default_factory=list)  # modules whose stream input gets a Recenter
    added_bias: list[str] = field(default_factory=list)  # modules that grew a bias parameter
    untied: list[str] = field(default_factory=list)  # parameter names given their own storage
    # Pre-CRMSNorm: resized parameters, compress hooks, per-stream widths (normfold.compress.runtime)
    compression: dict = field(default_factory=dict)
    # Residual-stream rotation (normfold.rotate): {"kind", "seed", "streams": [{"name", "width",
    # "construction"}]}; the weights carry it, this records how to rebuild Q. Empty: not rotated.
    rotation: dict = field(default_factory=dict)
    # heads kept tied to a centred embedding table (nn.TiedHead): {"head", "table", "scale", "bias"}
    tied_heads: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "structure") -> "Structure":
        """Validated against the schema (`ReportSchemaError` on unknown fields, wrong types, unknown norm
        types or options); fields a report predates take their defaults."""
        check(d, Structure, where)
        norms = []
        for i, n in enumerate(d.get("norms", [])):
            check(n, NormRecord, f"{where}.norms[{i}]")
            check_norm_options(n["type"], n.get("options", {}), f"{where}.norms[{i}].options")
            norms.append(NormRecord(**n))
        tied_heads = d.get("tied_heads", [])
        for i, t in enumerate(tied_heads):
            check(t, TiedHeadRecordSpec, f"{where}.tied_heads[{i}]")
        compression = d.get("compression", {})
        if compression:
            check(compression, CompressionSpec, f"{where}.compression")
        return cls(norms=norms, recenter_after=list(d.get("recenter_after", [])),
                   recenter_before=list(d.get("recenter_before", [])), added_bias=list(d.get("added_bias", [])),
                   untied=list(d.get("untied", [])), compression=dict(compression),
                   rotation=dict(d.get("rotation", {})), tied_heads=[dict(t) for t in tied_heads])


@dataclass
class ConversionReport:
    variant: str
    adapter: str
    architecture: str
    dtype: str
    layernorms_total: int
    kept: list[dict] = field(default_factory=list)  # {"name", "reason"}
    structure: Structure = field(default_factory=Structure)
    centered: list[str] = field(default_factory=list)  # stream writers made zero-mean
    tensors_edited: int = 0
    stock_reloadable: bool = True
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source: dict = field(default_factory=dict)
    centered_outputs: list[str] = field(default_factory=list)
    verification: dict | None = None
    seconds: dict = field(default_factory=dict)
    size: dict = field(default_factory=dict)  # parameters and stream width, before / after
    # {file name: {"sha256": hex digest, "bytes": size}} of every weight file, recorded when written
    weight_files: dict = field(default_factory=dict)
    # the ConvertOptions that made the conversion (`ConvertOptions.to_record`, versioned); None: not recorded
    options: dict | None = None

    @property
    def converted(self) -> list[NormRecord]:
        return self.structure.norms

    @property
    def keeps_tie(self) -> bool:
        """A tied embedding/head kept tied: the original table with a Recenter after the embedding (the
        conversion's note says which), or a head tied to the centred table (nn.TiedHead, older form)."""
        return bool(self.structure.tied_heads) or any(n.startswith(TIE_NOTE) for n in self.notes)

    def reload(self) -> dict:
        """Which loaders read the saved checkpoint and compute the converted function."""
        if self.stock_reloadable:
            how = ("plain transformers (from_pretrained) loads model.safetensors; normfold.load adds normfold's "
                   "norm modules")
            recenters = self.structure.recenter_after + self.structure.recenter_before
            if recenters:
                how += (f" and the Recenter at {', '.join(recenters)}, which stock transformers does without: its "
                        "LayerNorms re-centre their input, so it computes the same outputs except hidden states, "
                        "which differ from normfold.load's by a per-token constant (both equal the original's up "
                        "to one)")
            if self.keeps_tie:
                how += "; the tied embedding/head stays one tensor in both (--untie / untie=True writes an untied copy)"
        else:
            how = "normfold.load only (normfold_model.safetensors; stock from_pretrained refuses it)"
            if self.structure.tied_heads:
                how += ("; a tied head is kept tied to the centred table (nn.TiedHead), which stock transformers "
                        "cannot express: --untie / untie=True writes the stock-reloadable form")
            elif self.keeps_tie and self.structure.compression:
                how += ("; a tied head is kept tied to the original d-wide table, the stream compressed after the "
                        "summed embeddings (Pre-CRMSNorm)")
            elif self.keeps_tie:
                how += ("; a tied head is kept tied to the original table with a Recenter after the embedding; "
                        "--untie / untie=True writes the untied form")
        return {"stock_transformers": self.stock_reloadable, "normfold_load": True, "how": how}

    def to_dict(self) -> dict[str, Any]:
        from ._version import __version__

        return {
            "format_version": FORMAT_VERSION,
            "normfold_version": __version__,
            "variant": self.variant,
            "source": self.source,
            "adapter": self.adapter,
            "architecture": self.architecture,
            "dtype": self.dtype,
            "layernorms": {
                "total": self.layernorms_total,
                "converted": len(self.structure.norms),
                "kept": self.kept,
                "converted_names": [n.name for n in self.structure.norms],
            },
            "structure": self.structure.to_dict(),
            "edits": {"tensors_edited": self.tensors_edited, "centered_writers": self.centered},
            "stock_reloadable": self.stock_reloadable,
            "centered_outputs": self.centered_outputs,
            "warnings": self.warnings,
            "notes": self.notes,
            "verification": self.verification,
            "seconds": self.seconds,
            "size": self.size,
            "weight_files": self.weight_files,
            "reload": self.reload(),
            **({"options": self.options} if self.options is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> "ConversionReport":
        """A report read back from JSON, validated against the schema of its format version first
        (`ReportSchemaError`: unknown fields, wrong types, unknown norm types, a version this normfold
        cannot read)."""
        version = check_version(d)
        check(d, ReportSpec, "normfold.json")
        if d.get("options") is not None:
            check(d["options"], OptionsSpec, "options")
        if version < 2 and "weight_files" in d:
            raise ReportSchemaError("normfold.json: field 'weight_files' is not part of report format 1")
        from .checkpoint import plain_name

        for name, entry in d.get("weight_files", {}).items():
            if not plain_name(name):
                raise ReportSchemaError(f"normfold.json: weight_files names {name[:120]!r}, which is not a plain file "
                                        "name")
            digest = entry["sha256"]
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or entry["bytes"] < 0:
                raise ReportSchemaError(f"normfold.json: weight_files[{name[:120]!r}] is not a SHA-256 (64 lower-case "
                                        "hex digits) and a size")
        ln = d.get("layernorms", {})
        edits = d.get("edits", {})
        return cls(
            variant=d["variant"], adapter=d.get("adapter", ""), architecture=d.get("architecture", ""),
            dtype=d.get("dtype", ""), layernorms_total=ln.get("total", 0), kept=ln.get("kept", []),
            structure=Structure.from_dict(d.get("structure", {})),
            centered=edits.get("centered_writers", []), tensors_edited=edits.get("tensors_edited", 0),
            stock_reloadable=d.get("stock_reloadable", True), warnings=d.get("warnings", []),
            notes=d.get("notes", []), source=d.get("source", {}),
            centered_outputs=d.get("centered_outputs", []), verification=d.get("verification"),
            seconds=d.get("seconds", {}), size=d.get("size", {}), weight_files=d.get("weight_files", {}),
            options=d.get("options"),
        )


# ---- the schema of normfold.json ----------------------------------------------------------------------------
#
# Dataclasses describe the JSON layout field by field (their annotations are the types; a field without a
# default is required); `check` walks a parsed document against them. `structure` is what `normfold.load`
# replays, so it is checked strictly (every name, type and option); the informational parts
# (`verification`, `size`, `source`) are checked as objects only. Whether the names exist in the model and
# the widths agree with config.json and the weights is checked in `normfold.io` (`validate_structure`).

@dataclass
class TiedHeadRecordSpec:
    """One entry of `structure.tied_heads` (nn.TiedHead): the head and the table it reads, whether it has a
    folded scale (γ) and a bias. Whether the paths name a linear head and an embedding of the same shape is
    checked where it is rebuilt (`normfold.io.structure.apply_tied_heads`)."""

    head: str
    table: str
    scale: bool
    bias: bool


@dataclass
class CompressionSpec:
    """`structure.compression` of a Pre-CRMSNorm report (normfold.compress.runtime)."""

    pad: bool = False
    streams: list[dict] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    compress_after: list[str] = field(default_factory=list)
    compress_before: list[str] = field(default_factory=list)
    widen_after: list[str] = field(default_factory=list)
    narrow_before: list[str] = field(default_factory=list)
    writer_params: dict[str, int] = field(default_factory=dict)
    reader_params: dict[str, int] = field(default_factory=dict)
    tied_heads: list[TiedHeadSpec] = field(default_factory=list)


@dataclass
class TiedHeadSpec:
    head: str
    table: str
    bias: bool = False


@dataclass
class KeptSpec:
    name: str
    reason: str


@dataclass
class LayerNormsSpec:
    total: int = 0
    converted: int = 0
    kept: list[KeptSpec] = field(default_factory=list)
    converted_names: list[str] = field(default_factory=list)


@dataclass
class EditsSpec:
    tensors_edited: int = 0
    centered_writers: list[str] = field(default_factory=list)


@dataclass
class WeightFileSpec:
    sha256: str
    bytes: int


@dataclass
class OptionsSpec:
    """normfold.json's `options`: the fields of `ConvertOptions` and the record's version."""

    version: int
    to: str
    keep_affine: Optional[bool] = None
    fold_final: bool = False
    allow_new_bias: bool = False
    pad: bool = False
    untie: bool = False
    rotate: Optional[str] = None
    rotate_seed: int = 0
    rotate_online: bool = False
    rotate_attention: Optional[str] = None
    variant_options: dict = field(default_factory=dict)


@dataclass
class ReportSpec:
    """The top level of normfold.json."""

    format_version: int
    variant: str
    normfold_version: str = ""
    source: dict = field(default_factory=dict)
    adapter: str = ""
    architecture: str = ""
    dtype: str = ""
    layernorms: LayerNormsSpec = field(default_factory=LayerNormsSpec)
    structure: dict = field(default_factory=dict)  # checked by Structure.from_dict
    edits: EditsSpec = field(default_factory=EditsSpec)
    stock_reloadable: bool = True
    centered_outputs: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verification: Optional[dict] = None
    seconds: dict[str, float] = field(default_factory=dict)
    size: dict = field(default_factory=dict)
    weight_files: dict[str, WeightFileSpec] = field(default_factory=dict)
    reload: dict = field(default_factory=dict)  # informational (ConversionReport.reload()); recomputed, not read
    options: Optional[dict] = None  # the ConvertOptions of the conversion (ConvertOptions.to_record): OptionsSpec


MAX_INT = 2**53  # larger integers are not exact in JSON readers; no width, count or size gets near it


def check_version(d) -> int:
    """The report's format version, if this normfold reads it (else `ReportSchemaError` naming both versions)."""
    from ._version import __version__

    if not isinstance(d, dict):
        raise ReportSchemaError(f"normfold.json is not a JSON object (it is a {type(d).__name__})")
    version = d.get("format_version")
    by = d.get("normfold_version")
    by = f"normfold {by}" if isinstance(by, str) and len(by) < 64 else "an unknown normfold version"
    if not isinstance(version, int) or isinstance(version, bool):
        raise ReportSchemaError(f"normfold.json has no valid format_version (got {str(version)[:40]!r}); it was not "
                                f"written by normfold (this is normfold {__version__}, reading report formats "
                                f"{READABLE_FORMATS[0]}-{READABLE_FORMATS[-1]})")
    if version not in READABLE_FORMATS:
        newer = version > FORMAT_VERSION
        raise ReportSchemaError(
            f"normfold.json has report format {version}, written by {by}; this is normfold {__version__}, which reads "
            f"formats {READABLE_FORMATS[0]}-{READABLE_FORMATS[-1]}" + ("; upgrade normfold (pip install -U normfold)"
                                                                        if newer else "; reconvert the model"))
    return version


def check(value, spec: type, where: str) -> None:
    """`value` (parsed JSON) against dataclass `spec`: an object with only `spec`'s fields, each of its type,
    the required ones present."""
    if not isinstance(value, dict):
        raise ReportSchemaError(f"normfold.json: {where} must be an object, got {_show(value)}")
    hints = typing.get_type_hints(spec)
    known = {f.name: f for f in fields(spec)}
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ReportSchemaError(f"normfold.json: {where} has unknown field(s) {', '.join(map(repr, unknown[:5]))} "
                                f"(known: {', '.join(known)}); the report was edited or written by another tool")
    from dataclasses import MISSING

    for name, f in known.items():
        if name not in value:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ReportSchemaError(f"normfold.json: {where} lacks the required field {name!r}")
            continue
        check_type(value[name], hints[name], f"{where}.{name}")


def check_type(value, hint, where: str) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        errors = []
        for h in args:
            try:
                return check_type(value, h, where)
            except ReportSchemaError as exc:
                errors.append(exc)
        raise errors[-1]
    if hint is type(None):
        if value is not None:
            raise ReportSchemaError(f"normfold.json: {where} must be null, got {_show(value)}")
        return
    if hint is Any:
        return
    if is_dataclass(hint):
        return check(value, hint, where)
    base = origin or hint
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_INT,
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: lambda v: isinstance(v, str),
          list: lambda v: isinstance(v, list),
          dict: lambda v: isinstance(v, dict)}[base](value)
    if not ok:
        raise ReportSchemaError(f"normfold.json: {where} must be {_describe(hint)}, got {_show(value)}")
    if base is list and args:
        for i, v in enumerate(value):
            check_type(v, args[0], f"{where}[{i}]")
    if base is dict and args:
        for k, v in value.items():
            check_type(v, args[1], f"{where}[{k[:80]!r}]")


def check_norm_options(type_name: str, options, where: str) -> None:
    """A norm record's type must be registered (normfold.nn.NORM_TYPES) and its options among the ones that
    type declares (`REPORT_OPTIONS`: name -> type), each of its type."""
    from .nn import NORM_TYPES

    cls = NORM_TYPES.get(type_name)
    if cls is None:
        raise ReportSchemaError(f"normfold.json: {where.rpartition('.')[0]}.type {type_name[:80]!r} is not a normfold "
                                f"norm type (known: {', '.join(sorted(NORM_TYPES))})")
    declared = getattr(cls, "REPORT_OPTIONS", {})
    unknown = [k for k in options if k not in declared]
    if unknown:
        raise ReportSchemaError(f"normfold.json: {where} has unknown option(s) {', '.join(repr(k[:80]) for k in unknown[:5])} "
                                f"for {type_name} (known: {', '.join(declared) or 'none'})")
    for k, v in options.items():
        check_type(v, declared[k], f"{where}.{k}")


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    names = {bool: "true/false", int: "an integer", float: "a finite number", str: "a string", list: "a list",
             dict: "an object"}
    base = origin or hint
    if is_dataclass(base):
        return "an object"
    text = names.get(base, str(hint))
    if args and base is list:
        text += " of objects" if is_dataclass(args[0]) else f" of {_describe(args[0])}"
    return text


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return f"{type(value).__name__} {text[:60]}" + ("..." if len(text) > 60 else "")
