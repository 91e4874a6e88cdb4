"""The fused block forwards, one module per family. Each module defines `BLOCKS` (its `FusedBlock`s) and,
where its blocks hand off to the next norm, `STACKS` (its `handoff.Stack`s); it registers nothing itself.
Which modules exist for which family is data in the family registry (`normfold.adapters.families`:
`Family.fused`); importing this package walks that registry and registers every family's blocks and
stacks with `normfold.fastpath.blocks` and `normfold.fastpath.handoff`."""

from __future__ import annotations

import importlib

from ...adapters.families import FAMILIES
from ..blocks import register
from ..handoff import register_stack


def register_families() -> list[str]:
    """Register the fused blocks and hand-off stacks of every family in the registry (once per module); returns
    the modules registered."""
    done = []
    for family in FAMILIES:
        for name in family.fused:
            if name in done:
                continue
            module = importlib.import_module(f"{__name__}.{name}")
            for spec in module.BLOCKS:
                register(spec)
            for stack in getattr(module, "STACKS", ()):
                register_stack(stack)
            done.append(name)
    return done


REGISTERED = tuple(register_families())
