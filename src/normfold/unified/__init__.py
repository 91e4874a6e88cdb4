"""Unified Normalization (Yang et al., ACM MM 2022): the `--to un` target that swaps LayerNorms for offline
norms to train with (`variant.py`), and the fusion that folds trained offline norms into their neighbouring
linears for inference (`fuse.py`, `normfold fuse`). The norm modules themselves are `normfold.nn.offline`."""

from .fuse import Decision, FusionReport, check_site, checkpoint_report, example_inputs, fuse_offline_norms
from .variant import check_options, swap_layernorms

__all__ = ["fuse_offline_norms", "swap_layernorms", "check_options", "Decision", "FusionReport", "check_site",
           "checkpoint_report", "example_inputs"]
