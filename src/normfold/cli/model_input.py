"""The model a command reads: a normfold checkpoint (replayed with normfold's modules) or a source model."""

from __future__ import annotations


def load_model(path):
    """(model, its normfold report or None): `normfold.load` for a directory with normfold.json, else the
    guarded source loader (`io.load_source`)."""
    from pathlib import Path

    from .. import io

    if (Path(path) / io.REPORT_FILE).is_file():
        model = io.load(path)
        return model, model.normfold_report
    model, _ = io.load_source(path)
    return model, None
