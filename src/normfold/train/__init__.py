"""Training with the LayerNorm parameters θ while computing as Pre-RMSNorm / Pre-CRMSNorm (paper 001 §3.5).

    from normfold import train
    model = train.prepare(model, to="rmsnorm")     # θ, names, state_dict keys unchanged
    ...train with any optimizer / Trainer / DDP / FSDP2 / torch.compile...
    train.export(model, "out-dir")                 # the same checkpoint `normfold convert` writes
    train.restore(model)                           # the plain LayerNorm model again

See docs/training.md.
"""

from __future__ import annotations

from .export import export
from .prepare import PreparedState, invalidate, is_prepared, prepare, restore, set_cache, state

__all__ = ["prepare", "restore", "export", "is_prepared", "state", "set_cache", "invalidate", "PreparedState"]
