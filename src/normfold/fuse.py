"""Moved to `normfold.unified.fuse` (the fusion of offline norms); this name keeps working for one release."""

import warnings as _warnings

from .unified.fuse import *  # noqa: F401,F403

_warnings.warn("normfold.fuse moved to normfold.unified.fuse", DeprecationWarning, stacklevel=2)
