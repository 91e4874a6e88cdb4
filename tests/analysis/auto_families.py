"""Tiny random configs of transformers families that have no normfold adapter, converted by the plan the
analysis derives (issue 13): the examples of the family registry's entries without an adapter
(normfold.adapters.families). Used by tests/analysis/test_autoplan.py and scripts/auto_families.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from normfold.adapters import FAMILIES as REGISTRY


@dataclass(frozen=True)
class AutoFamily:
    key: str
    config: str
    head: str
    kwargs: dict
    # Trace/verification inputs other than the config's defaults (e.g. another image size).
    image_size: int | None = None
    extra: dict = field(default_factory=dict)

    def build(self, dtype=torch.float64, seed: int = 0):
        import transformers

        torch.manual_seed(seed)
        cfg = getattr(transformers, self.config)(**self.kwargs)
        return getattr(transformers, self.head)(cfg).eval().to(dtype)


def _from_registry() -> tuple[AutoFamily, ...]:
    """Every example of the family registry's families without an adapter (normfold.adapters.families), and
    DINOv2 traced at another image size."""
    out = [AutoFamily(f.name if len(f.examples) == 1 else f"{f.name}-{ex.name}", ex.config, ex.heads[0], ex.kwargs)
           for f in REGISTRY if f.adapter is None for ex in f.examples]
    dinov2 = next(a for a in out if a.key == "dinov2")
    out.insert(out.index(dinov2) + 1, dataclasses.replace(dinov2, key="dinov2-24px", image_size=24))
    return tuple(out)


FAMILIES = _from_registry()
