"""How to convert: one options object for every entry point.

`normfold.convert`, `normfold.stream.stream_convert`, `normfold.train.prepare` and `normfold.train.export`
take a `ConvertOptions` as `options=`, or its fields as keywords of the same names and meanings; a keyword
given beside an object overrides that field. The command line spells them the same way (`--to`,
`--keep-affine`, `--fold-final`, `--allow-new-bias`, `--pad`, `--untie`, `--rotate`, `--rotate-seed`,
`--rotate-online`, `--option KEY=VALUE`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import UnsupportedConversionError


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
        projection, "both"; "qk" the per-head rotation of queries and keys (in the weights, or after the rotary
        positions at run time), "all" the three; None: none.
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
        object.__setattr__(self, "variant_options", dict(self.variant_options or {}))

    @property
    def fold_affine(self) -> bool:
        """Whether γ/β are folded into readers, for the entry points whose default is to fold."""
        return not self.keep_affine

    def target_options(self) -> dict:
        """What the target's own code reads: its variant options, with `pad` where it is set."""
        return {**self.variant_options, **({"pad": True} if self.pad else {})}

    def replace(self, **changes) -> "ConvertOptions":
        return dataclasses.replace(self, **changes)

    def check(self) -> "ConvertOptions":
        """Every rule on how the fields combine, each with one message (`UnsupportedConversionError`, exit 2 on
        the command line); returns the options as a conversion runs them: with `rotate`, the final norms'
        γ folded (`fold_final`) and the heads untied (`untie`), since γ must leave the stream before it is
        rotated and a head that takes γ cannot stay the table. `normfold.convert`, `stream_convert`,
        `train.prepare` / `train.export` and the command line all call it; the rules that depend on a
        registry (which targets exist, which take `variant_options`) are the target registry's
        (`normfold.convert`)."""
        if "pad" in self.variant_options:
            raise UnsupportedConversionError("pad is an option of its own (pad=True, --pad), not a variant option")
        if self.rotate_online and self.rotate is None:
            raise UnsupportedConversionError("--rotate-online needs --rotate hadamard|orthogonal")
        if self.pad and self.to != "crmsnorm":
            raise UnsupportedConversionError(f"--pad applies to --to crmsnorm only (--to {self.to} takes no options)")
        if self.untie and self.to not in ("rmsnorm",):
            raise UnsupportedConversionError(
                "--untie applies to --to rmsnorm only (--to crmsnorm checkpoints load with normfold.load only and "
                "keep the tie on the compressed table)")
        if self.rotate_attention is not None and self.rotate_attention not in ATTENTION_ROTATIONS:
            raise UnsupportedConversionError(f"unknown attention rotation {self.rotate_attention!r}; choose one of "
                                             f"{', '.join(ATTENTION_ROTATIONS)}")
        if self.rotate_attention is not None and self.rotate is None:
            raise UnsupportedConversionError("--rotate-attention needs --rotate hadamard|orthogonal")
        if self.rotate is None:
            return self
        if self.to != "rmsnorm":
            raise UnsupportedConversionError(f"--rotate works with --to rmsnorm (got --to {self.to}): the rotated "
                                             "stream is the Pre-RMSNorm one")
        if self.keep_affine:
            raise UnsupportedConversionError("--rotate needs every norm's γ folded into its readers; it cannot be "
                                             "combined with --keep-affine")
        return self.replace(fold_final=True, untie=True)

    def to_record(self) -> dict:
        """The options as normfold.json records them (`options`), with the record's version."""
        return {"version": OPTIONS_VERSION, **{f: getattr(self, f) for f in FIELDS if f != "variant_options"},
                "variant_options": dict(self.variant_options)}

    @classmethod
    def from_record(cls, record: dict) -> "ConvertOptions":
        """The options a normfold.json `options` record holds (`to_record`'s inverse; the schema is checked by
        `normfold.report` when the report is read)."""
        version = record.get("version")
        if version != OPTIONS_VERSION:
            raise UnsupportedConversionError(f"normfold.json: options record version {version!r}; this normfold reads "
                                             f"version {OPTIONS_VERSION}")
        return cls(**{k: v for k, v in record.items() if k != "version"})


FIELDS = tuple(f.name for f in dataclasses.fields(ConvertOptions))
# rotations inside attention (`rotate_attention`): the per-head V/O rotation in the weights, the online Hadamard
# before each attention output projection, both of those, the per-head query/key rotation (keys for a quantized KV
# cache), or all three
ATTENTION_ROTATIONS = ("vo", "online", "both", "qk", "all")
# the version of the `options` record in normfold.json (`ConvertOptions.to_record`)
OPTIONS_VERSION = 1


def resolve(options: ConvertOptions | None, caller: str, **keywords) -> ConvertOptions:
    """`options` (or the defaults) with every keyword that is not None laid over it."""
    if options is not None and not isinstance(options, ConvertOptions):
        raise TypeError(f"{caller}: options must be a normfold.ConvertOptions, not {type(options).__name__}")
    unknown = set(keywords) - set(FIELDS)
    if unknown:
        raise TypeError(f"{caller}: unknown option(s) {', '.join(sorted(unknown))}; fields: {', '.join(FIELDS)}")
    base = options or ConvertOptions()
    given = {k: v for k, v in keywords.items() if v is not None}
    if "variant_options" in given:
        given["variant_options"] = {**base.variant_options, **given["variant_options"]}
        if base.pad and "pad" not in given:
            given["pad"] = True
    return dataclasses.replace(base, **given) if given else base
