"""The family registry: one `Family` entry per model family, the one list every consumer reads.

An entry names, as data, where each part of the family lives:

- `adapter`: the module of `normfold.adapters` that defines its `ADAPTER` (the conversion plan, with the
  family's tiny `TinyExample` configs in `ADAPTER.examples`); None for a family normfold converts
  through the plan `normfold analyze` derives (no adapter of its own).
- `fused`: the modules of `normfold.fastpath.families` that define its fused block forwards (`BLOCKS`, a
  tuple of `FusedBlock`) and its cross-block hand-off stacks (`STACKS`, optional); empty for a family
  that runs transformers' own blocks.

The names are resolved where they are used, each by the layer that owns them: `normfold.adapters` loads
the adapters (`list_adapters`, `find_adapter`: the conversion, the streamed conversion and the tests), and
`normfold.fastpath` registers the fused blocks and stacks when it is imported (it sits above this layer,
so the adapters never import it). Adding a family = its adapter module, its entry below, and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring). `name` is also its adapter's name."""

    name: str
    adapter: str | None
    fused: tuple[str, ...] = ()


# In match order: `find_adapter` tries the adapters in this order (plug-ins after them).
FAMILIES: tuple[Family, ...] = (
    Family("gpt2", adapter="gpt2", fused=("gpt2",)),
    Family("gpt_neo", adapter="gpt_neo", fused=("gpt_neo",)),
    Family("gptj", adapter="gptj", fused=("gptj",)),
    Family("gpt_neox", adapter="gpt_neox", fused=("gpt_neox",)),
    Family("opt", adapter="opt", fused=("opt",)),
    Family("bloom", adapter="bloom", fused=("bloom",)),
    Family("phi", adapter="phi", fused=("phi",)),
    Family("gpt_bigcode", adapter="gpt_bigcode", fused=("gpt_bigcode",)),
    Family("falcon", adapter="falcon", fused=("falcon",)),
    Family("bert", adapter="bert"),
    Family("roberta", adapter="roberta"),
    Family("distilbert", adapter="distilbert"),
    Family("electra", adapter="electra"),
    Family("vit", adapter="vit", fused=("vit",)),
    Family("deit", adapter="deit", fused=("deit",)),
    Family("clip", adapter="clip", fused=("clip",)),
    Family("siglip", adapter="siglip", fused=("siglip",)),
    Family("siglip2", adapter="siglip2", fused=("siglip2",)),
    Family("whisper", adapter="whisper", fused=("whisper",)),
    Family("mbart", adapter="mbart", fused=("mbart",)),
    Family("bart", adapter="bart"),
    # no adapter: the derived plan converts it to rmsnorm (fastpath/families/dinov2.py says why not crmsnorm)
    Family("dinov2", adapter=None, fused=("dinov2",)),
)


def get_family(name: str) -> Family:
    """The registry entry called `name` (UnsupportedModelError when there is none)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise UnsupportedModelError(f"no family named {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


__all__ = ["FAMILIES", "Family", "get_family"]
