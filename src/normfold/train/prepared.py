"""What `normfold.train.prepare` did to a model, kept on the root module (`model._normfold_train`), and the
per-stream state its norms and writers share."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..errors import UnsupportedConversionError

STATE_ATTR = "_normfold_train"


@dataclass
class StreamState:
    name: str
    layernorm_in_training: bool = False  # fallback: an element-wise dropout on this stream was not located


@dataclass
class PreparedState:
    """What `prepare` did (`model._normfold_train`); `restore` undoes it."""

    to: str
    adapter: str
    cache: bool
    modules: list[nn.Module] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    dropouts: dict[str, list[str]] = field(default_factory=dict)
    fallback_streams: list[str] = field(default_factory=list)
    hooks: list = field(default_factory=list)  # (module, hook id)
    streams: list[StreamState] = field(default_factory=list)
    fold: bool = True
    fold_final: bool = False

    def summary(self) -> str:
        lines = [f"prepared for {self.to} training ({self.adapter} adapter): {len(self.norms)} LayerNorm(s) computed as "
                 f"{'RMSNorm' if self.to == 'rmsnorm' else 'CRMSNorm'}, {len(self.writers)} writer(s) centred, "
                 f"{len(self.folded)} affine(s) folded into readers"]
        for d, ws in self.dropouts.items():
            lines.append(f"  dropout {d} after {', '.join(ws)}: writer left uncentred in training, output recentred")
        for s in self.fallback_streams:
            lines.append(f"  stream {s}: an element-wise dropout could not be located; in training mode its norms "
                         "centre their input (LayerNorm arithmetic, exact, no speed-up)")
        return "\n".join(lines)


def root_state(module: nn.Module) -> PreparedState | None:
    return module.__dict__.get("_nf_root")


def is_prepared(model: nn.Module) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


def state(model: nn.Module) -> PreparedState:
    st = getattr(model, STATE_ATTR, None)
    if st is None:
        raise UnsupportedConversionError("this model was not prepared with normfold.train.prepare")
    return st
