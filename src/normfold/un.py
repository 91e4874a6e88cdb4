"""Moved to `normfold.unified.variant` (Unified Normalization's `--to un` variant); this name keeps working for one release."""

import warnings as _warnings

from .unified.variant import *  # noqa: F401,F403

_warnings.warn("normfold.un moved to normfold.unified.variant", DeprecationWarning, stacklevel=2)
