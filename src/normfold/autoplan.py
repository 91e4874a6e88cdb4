"""Moved to `normfold.analysis.autoplan` (plans derived from the analysis); this name keeps working for one release."""

import warnings as _warnings

from .analysis.autoplan import *  # noqa: F401,F403

_warnings.warn("normfold.autoplan moved to normfold.analysis.autoplan", DeprecationWarning, stacklevel=2)
