"""The conversion report: what was converted, what was kept and why, and the verification numbers.

Serialized as `normfold.json` next to a saved checkpoint (DESIGN.md "Public contract"). The
`structure` part is also the recipe `normfold.load` replays to rebuild the converted modules on
top of a stock model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1


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
    # heads kept tied to a centred embedding table (nn.TiedHead): {"head", "table", "scale", "bias"}
    tied_heads: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Structure":
        return cls(norms=[NormRecord(**n) for n in d.get("norms", [])],
                   recenter_after=list(d.get("recenter_after", [])),
                   recenter_before=list(d.get("recenter_before", [])),
                   added_bias=list(d.get("added_bias", [])),
                   untied=list(d.get("untied", [])),
                   compression=dict(d.get("compression", {})),
                   tied_heads=_tied_heads(d.get("tied_heads", [])))


def _tied_heads(value) -> list[dict]:
    """The `tied_heads` records of a saved report, checked (normfold.json is untrusted input)."""
    keys = {"head": str, "table": str, "scale": bool, "bias": bool}
    if not isinstance(value, list):
        raise ValueError("structure.tied_heads must be a list")
    out = []
    for item in value:
        if not isinstance(item, dict) or set(item) != set(keys) or any(
                not isinstance(item[k], t) for k, t in keys.items()):
            raise ValueError(f"structure.tied_heads entries are {{'head': str, 'table': str, 'scale': bool, "
                             f"'bias': bool}}; got {item!r}")
        out.append(dict(item))
    return out


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

    @property
    def converted(self) -> list[NormRecord]:
        return self.structure.norms

    def reload(self) -> dict:
        """Which loaders read the saved checkpoint and compute the converted function."""
        if self.stock_reloadable:
            how = ("plain transformers (from_pretrained) loads model.safetensors; normfold.load adds normfold's "
                   "norm modules")
        else:
            how = "normfold.load only (normfold_model.safetensors; stock from_pretrained refuses it)"
            if self.structure.tied_heads:
                how += ("; a tied head is kept tied to the centred table (nn.TiedHead), which stock transformers "
                        "cannot express: --untie / untie=True writes the stock-reloadable form")
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
            "reload": self.reload(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> "ConversionReport":
        ln = d.get("layernorms", {})
        return cls(
            variant=d["variant"], adapter=d.get("adapter", ""), architecture=d.get("architecture", ""),
            dtype=d.get("dtype", ""), layernorms_total=ln.get("total", 0), kept=ln.get("kept", []),
            structure=Structure.from_dict(d.get("structure", {})),
            centered=d.get("edits", {}).get("centered_writers", []),
            tensors_edited=d.get("edits", {}).get("tensors_edited", 0),
            stock_reloadable=d.get("stock_reloadable", True), warnings=d.get("warnings", []),
            notes=d.get("notes", []), source=d.get("source", {}),
            centered_outputs=d.get("centered_outputs", []), verification=d.get("verification"),
            seconds=d.get("seconds", {}), size=d.get("size", {}),
        )
