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
    # Residual-stream rotation (normfold.rotate): {"kind", "seed", "streams": [{"name", "width",
    # "construction"}]}; the weights carry it, this records how to rebuild Q. Empty: not rotated.
    rotation: dict = field(default_factory=dict)

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
                   rotation=dict(d.get("rotation", {})))


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
