"""How to convert: one options object for every entry point.

`normfold.convert`, `normfold.stream.stream_convert`, `normfold.train.prepare` and `normfold.train.export`
take a `ConvertOptions` as `options=`, or its fields as keywords of the same names and meanings; a keyword
given beside an object overrides that field. The command line spells them the same way (`--to`,
`--keep-affine`, `--fold-final`, `--allow-new-bias`, `--pad`, `--untie`, `--rotate`, `--rotate-seed`,
`--rotate-online`, `--option KEY=VALUE`)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ConvertOptions:
    """How to convert.

    to: the target: "rmsnorm" (Pre-RMSNorm), "crmsnorm" (Pre-CRMSNorm on the d−1 stream), "layernorm"
        (back from a converted checkpoint), "un" (Unified Normalization, for training).
    keep_affine: keep every norm's γ/β inside the RMSNorm instead of folding them into readers.
        None means the entry point's default: fold for convert / stream_convert / train.export; keep for
        train.prepare(to="rmsnorm") (φ is recomputed every step and the affine inside the norm kernel is
        nearly free), fold for train.prepare(to="crmsnorm") (its compressed readers need the fold).
    fold_final: also fold final norms (ln_f, ...) into their linear heads; the model's normalized last
        hidden state then lacks the affine (logits are unchanged).
    allow_new_bias: let a reader without a bias grow one to absorb β (breaks stock reloading); by default
        β stays in the RMSNorm when some reader has no bias.
    pad: Pre-CRMSNorm only: keep width d with a zero last coordinate instead of d−1 (every shape kept).
    untie: give a head tied to an edited embedding table its own copy of the table (the plain
        `transformers` form, stock-reloadable, V×d more parameters). By default the tie is kept (loads with
        normfold.load): `--to rmsnorm` keeps the original table and the stock head and recentres the
        embedding's output (a Recenter after it); a head that takes the final norm's γ (fold_final) becomes
        an `nn.TiedHead` reading the centred table plus its row means.
    rotate: "hadamard" or "orthogonal": after the Pre-RMSNorm conversion, rotate each residual stream by
        an orthogonal Q that fixes the all-ones direction (`normfold.rotate`, docs/rotation.md); None: no rotation.
    rotate_seed: the seed of a random rotation.
    rotate_online: also an online Hadamard before every MLP down-projection (needs `rotate`).
    rotate_attention: rotations inside attention (needs `rotate`): "vo" the exact per-head rotation of the
        value/output projections (weights only), "online" an online Hadamard before the attention output
        projection, "both"; None: neither.
    variant_options: options of the target itself (e.g. UnifiedNorm's M, warmup; `--option KEY=VALUE`).
    """

    to: str = "rmsnorm"
    keep_affine: bool | None = None
    fold_final: bool = False
    allow_new_bias: bool = False
    pad: bool = False
    untie: bool = False
    rotate: str | None = None
    rotate_seed: int = 0
    rotate_online: bool = False
    rotate_attention: str | None = None
    variant_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        opts = dict(self.variant_options or {})
        if "pad" in opts:  # the old spelling: fold it into the field, keep the dict free of it
            object.__setattr__(self, "pad", bool(opts.pop("pad")) or self.pad)
        object.__setattr__(self, "variant_options", opts)

    @property
    def fold_affine(self) -> bool:
        """Whether γ/β are folded into readers, for the entry points whose default is to fold."""
        return not self.keep_affine

    def target_options(self) -> dict:
        """What the target's own code reads: its variant options, with `pad` where it is set."""
        return {**self.variant_options, **({"pad": True} if self.pad else {})}

    def replace(self, **changes) -> "ConvertOptions":
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(ConvertOptions))


def resolve(options: ConvertOptions | None, caller: str, **keywords) -> ConvertOptions:
    """`options` (or the defaults) with every keyword that is not None laid over it. A `pad` key inside
    `variant_options` is the old spelling: it still works, with a DeprecationWarning."""
    if options is not None and not isinstance(options, ConvertOptions):
        raise TypeError(f"{caller}: options must be a normfold.ConvertOptions, not {type(options).__name__}")
    unknown = set(keywords) - set(FIELDS)
    if unknown:
        raise TypeError(f"{caller}: unknown option(s) {', '.join(sorted(unknown))}; fields: {', '.join(FIELDS)}")
    vo = keywords.get("variant_options")
    if vo and "pad" in vo:
        warnings.warn(f"{caller}(variant_options={{'pad': ...}}) is deprecated; use pad=... "
                      "(or ConvertOptions(pad=...))", DeprecationWarning, stacklevel=3)
    base = options or ConvertOptions()
    given = {k: v for k, v in keywords.items() if v is not None}
    if "variant_options" in given:
        given["variant_options"] = {**base.variant_options, **given["variant_options"]}
        if base.pad and "pad" not in given:
            given["pad"] = True
    return dataclasses.replace(base, **given) if given else base
