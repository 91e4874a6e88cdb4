"""The adapter interface: a small description of an architecture's residual stream(s).

An adapter turns a model instance into a `ConversionPlan`: for each residual stream, the
*writers* whose outputs add into it (embedding tables, residual-branch output projections, stem
convolutions, parameters such as a cls token), and the *norm sites* that read it (each LayerNorm
with the linear modules reading its output). The converter needs nothing else: it centres the
writers, folds each norm's affine into its readers and swaps the norm.

Most families are one `StreamTemplate` (paths relative to the base model, `{i}`-free: the block
list is expanded per layer). Families whose layout depends on the config (parallel residual,
post-LN variants, ...) write a `plan(model)` function that builds templates or plans directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class NormSite:
    """A LayerNorm whose input is a zero-mean stream (so it may become an RMSNorm).

    `readers`: every module that reads this norm's output, when all of them are linear (then the
    norm's affine can be folded into them). Leave empty when the output goes elsewhere (it becomes
    the stream, or a model output): the affine then stays in the RMSNorm.
    `final`: the output is a model output (last_hidden_state, ...); its affine is kept unless the
    user asks to fold the final norm into the heads.
    `beta_cancels`: bias-less readers whose share of β drops out exactly (see the field).
    """

    path: str
    readers: tuple[str, ...] = ()
    final: bool = False
    # Readers without a bias whose constant contribution βW provably cancels (key projections read only
    # by q·kᵀ → softmax over keys: q·(βW) is the same for every key of a query). γ folds into them and
    # β's term is dropped, so β need not stay in the norm for want of a bias to absorb it.
    beta_cancels: tuple[str, ...] = ()


@dataclass(frozen=True)
class KeptNorm:
    path: str
    reason: str
    # False when the norm does not read a residual stream (Phi's per-head q/k norms read a projection's
    # output; SigLIP's pooling head normalizes the pooled vector): a rotation of the stream leaves it alone.
    on_stream: bool = True


@dataclass
class StreamPlan:
    """One residual stream, with concrete module/parameter paths from the model root."""

    name: str
    writers: list[str] = field(default_factory=list)
    norms: list[NormSite] = field(default_factory=list)
    # Modules whose output must be recentred explicitly (a non-linear stem, a norm sitting on the
    # stream with an affine): their output is added to / becomes the stream but is not zero-mean.
    recenter_after: list[str] = field(default_factory=list)
    # Modules whose stream input must be recentred explicitly (a forward pre-hook): the stream is
    # built by functional code with no module to hook after (Whisper: conv -> F.gelu -> + positions).
    recenter_before: list[str] = field(default_factory=list)
    # Neither kind of Recenter stops a stock reload: it is only for normfold's RMSNorms; a stock load
    # has LayerNorms, which re-centre their input. That needs this stream to be read by its norms only
    # (and returned as hidden states); a plan where anything else reads it sets
    # ConversionPlan.stock_reloadable = False.
    # Scale folding (LayerScale): (writer path, multiplier parameter path) pairs. Before centring, the
    # writer absorbs the per-channel multiplier applied to its output (W ← W·diag(λ), b ← b⊙λ) and the
    # multiplier becomes 1, so the module still exists (stock-reloadable) and computes the same thing.
    scale_folds: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ConversionPlan:
    adapter: str
    streams: list[StreamPlan] = field(default_factory=list)
    kept: list[KeptNorm] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # False when the converted checkpoint cannot be read by stock transformers, or a stock load would
    # compute something else (a stream Recenter that matters there; added biases and a different
    # hidden size are found by the conversion itself).
    stock_reloadable: bool = True
    # Model outputs (fnmatch patterns over verify's flattened names) that carry a residual stream
    # and are therefore returned recentred, beyond the default '*hidden_states[i]'.
    centered_outputs: list[str] = field(default_factory=list)
    # The tensor source that answers the conversion's value questions (is this β all zero, is this tied head
    # unchanged: `convert.TensorValues`); None: the model's own tensors. `normfold.stream` sets one that
    # answers from the checkpoint for a model on the meta device.
    values: object | None = None


@dataclass(frozen=True)
class BlockTemplate:
    """Paths relative to one block: norms with their readers, and the branch output projections."""

    norms: tuple[tuple[str, tuple[str, ...]], ...]
    writers: tuple[str, ...]


@dataclass(frozen=True)
class StreamTemplate:
    """A residual stream described by paths relative to `root` (itself below the base model).

    `final_readers` are relative to the model root (heads live there); those absent from a given
    head class are skipped, so one template covers the base model and every head.
    """

    name: str
    sources: tuple[str, ...]
    layers: str
    block: BlockTemplate
    final_norm: str | None = None
    final_readers: tuple[str, ...] = ()
    root: str = ""

    def expand(self, model: nn.Module) -> StreamPlan:
        base = join(base_prefix(model), self.root)
        layers = get(model, join(base, self.layers))
        plan = StreamPlan(name=self.name, writers=[join(base, s) for s in self.sources])
        for i in range(len(layers)):
            blk = join(base, self.layers, str(i))
            for norm, readers in self.block.norms:
                plan.norms.append(NormSite(join(blk, norm), tuple(join(blk, r) for r in readers)))
            plan.writers.extend(join(blk, w) for w in self.block.writers)
        if self.final_norm is not None:
            readers = tuple(r for r in self.final_readers if exists(model, r))
            plan.norms.append(NormSite(join(base, self.final_norm), readers, final=True))
        return plan


@dataclass(frozen=True)
class TinyExample:
    """A tiny random configuration of a family (transformers class names + config kwargs).

    Used by the generic family tests (tests/adapters/test_families.py: float64 exactness on every
    output, float32 error, stock reload, CLI) and by scripts/family_table.py for the table in docs/families.md."""

    name: str
    config: str
    kwargs: dict
    heads: tuple[str, ...]

    def build(self, head: str | None = None, dtype=None):
        import transformers

        cfg = getattr(transformers, self.config)(**self.kwargs)
        model = getattr(transformers, head or self.heads[0])(cfg).eval()
        return model if dtype is None else model.to(dtype)


@dataclass(frozen=True)
class Capabilities:
    """What an adapter's conversions support (TransformerLens-style flags, shown in docs/tables)."""

    variants: tuple[str, ...] = ("rmsnorm",)
    stock_reloadable: bool = True
    parallel_residual: bool = False
    post_ln: bool = False


def default_inputs(model: nn.Module, generator: torch.Generator, batch: int = 2, seq: int = 16) -> dict:
    cfg = model.config
    vocab = cfg.vocab_size
    max_pos = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or seq
    seq = max(2, min(seq, max_pos))
    if type(model).__name__.endswith("ForSequenceClassification") and getattr(cfg, "pad_token_id", None) is None:
        batch = 1  # HF cannot find the last token of a padded batch without a pad token
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return {"input_ids": ids}


@dataclass(frozen=True)
class Adapter:
    """How to convert one architecture family.

    `model_types`: HF `config.model_type` values handled (covers every head class of a family).
    `model_classes`: extra class names (for non-HF models or one-off classes).
    `plan`: model -> ConversionPlan; `check`: raise UnsupportedConversionError for configurations
    the adapter cannot convert exactly; `example_inputs`: (model, generator) -> forward kwargs.
    """

    name: str
    display_name: str
    plan: Callable[[nn.Module], ConversionPlan]
    model_types: tuple[str, ...] = ()
    model_classes: tuple[str, ...] = ()
    example_inputs: Callable[[nn.Module, torch.Generator], dict] = default_inputs
    check: Callable[[nn.Module], None] | None = None
    capabilities: Capabilities = Capabilities()
    examples: tuple[TinyExample, ...] = ()

    def matches(self, model: nn.Module) -> bool:
        if type(model).__name__ in self.model_classes:
            return True
        cfg = getattr(model, "config", None)
        return getattr(cfg, "model_type", None) in self.model_types


def template_adapter(name: str, display_name: str, *templates: StreamTemplate, notes: tuple[str, ...] = (),
                     **kwargs) -> Adapter:
    """An adapter whose plan is just the expansion of fixed stream templates."""

    def plan(model: nn.Module) -> ConversionPlan:
        return ConversionPlan(adapter=name, streams=[t.expand(model) for t in templates], notes=list(notes))

    return Adapter(name=name, display_name=display_name, plan=plan, **kwargs)


# ---- path helpers -------------------------------------------------------------------------------

def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def base_prefix(model: nn.Module) -> str:
    """'transformer' for GPT2LMHeadModel, '' for GPT2Model itself (HF `base_model_prefix`)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    return ""


def get(model: nn.Module, path: str):
    """The module or parameter at a dotted path (raises AttributeError with the path)."""
    obj = model
    for part in path.split(".") if path else []:
        if not hasattr(obj, part):
            raise AttributeError(f"{type(model).__name__} has no '{path}' (missing '{part}')")
        obj = getattr(obj, part)
    return obj


def submodule(model: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path, walked through the module tree only (each module's registered
    children, what `named_modules()` lists): never an attribute, so a path read from an untrusted report
    (`transformer.__class__.forward`) cannot leave the tree. LookupError if there is none."""
    obj = model
    for part in path.split(".") if path else []:
        child = obj._modules.get(part) if isinstance(obj, nn.Module) else None
        if child is None:
            raise LookupError(f"{type(model).__name__} has no submodule {path!r} (missing {part!r})")
        obj = child
    return obj


def parameter(model: nn.Module, path: str) -> nn.Parameter:
    """The parameter at a dotted path (a registered parameter of a submodule, as `named_parameters()` lists
    them). LookupError if there is none."""
    head, _, leaf = path.rpartition(".")
    p = submodule(model, head)._parameters.get(leaf)
    if p is None:
        raise LookupError(f"{type(model).__name__} has no parameter {path!r}")
    return p


def exists(model: nn.Module, path: str) -> bool:
    try:
        get(model, path)
        return True
    except AttributeError:
        return False


def parent_and_leaf(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, leaf = path.rpartition(".")
    return (get(model, head) if head else model), leaf
