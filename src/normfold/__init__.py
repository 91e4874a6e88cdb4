"""normfold: turn LayerNorm Transformers into arithmetically equivalent (C)RMSNorm models, prove it,
and run them faster. See README.md and docs/architecture.md.

    import normfold
    converted, report = normfold.convert(model, to="rmsnorm")
    normfold.save(converted, report, "out-dir")
    model = normfold.load("out-dir")
    fused, report = normfold.fuse_offline_norms(model)   # after fine-tuning a --to un model
"""

from __future__ import annotations

from ._version import __version__  # noqa: E402,F401

from .errors import NormfoldError  # noqa: E402
from .options import ConvertOptions  # noqa: E402
from .conversion import convert  # noqa: E402  (the module is normfold.conversion; normfold.convert is the function)
from .io import load, save  # noqa: E402
from .unified import variant as _un  # noqa: E402,F401  (registers the "un" conversion variant)
from . import compress as _compress  # noqa: E402,F401  (registers "crmsnorm" and the reverse conversions)
from . import rotate as _rotate  # noqa: E402,F401  (registers convert(..., rotate=...))
from .analysis import analyze  # noqa: E402
from .unified import fuse_offline_norms  # noqa: E402

__all__ = ["__version__", "NormfoldError", "ConvertOptions", "convert", "load", "save", "analyze", "fuse_offline_norms"]
