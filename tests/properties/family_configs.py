"""Hypothesis strategies for random tiny models of every registered family.

A drawn case starts from one of the family's `TinyExample`s (which fix the config class, the head
classes and what makes the family what it is) and redraws the knobs that vary between real
checkpoints: stream width and head count, layer count, MLP width, LayerNorm eps, tied or untied
embeddings, biases on/off, parallel/sequential residual, and the family's other switches. A knob is
only redrawn when the config class has it, so no family needs its own strategy; the few keys that
depend on the width (rotary dims, KV heads, projected embeddings) are kept consistent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from hypothesis import strategies as st

# (width key, head keys): the first pair an example sets is redrawn as heads × head_dim.
WIDTH_KEYS = (
    ("n_embd", ("n_head",)),
    ("d_model", ("encoder_attention_heads", "decoder_attention_heads")),
    ("dim", ("n_heads",)),
    ("hidden_size", ("num_attention_heads",)),
    ("hidden_size", ("num_heads",)),
    ("hidden_size", ("n_head",)),
)
# Width-dependent keys that copy the width when the example had them equal to it.
FOLLOW_WIDTH = ("word_embed_proj_dim", "embedding_size")
LAYER_KEYS = ("n_layer", "num_hidden_layers", "num_layers", "n_layers", "encoder_layers", "decoder_layers")
MLP_KEYS = ("n_inner", "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim")
EPS_KEYS = ("layer_norm_epsilon", "layer_norm_eps")
# Switches real checkpoints differ in; redrawn when the config class has them.
TOGGLES = (
    "tie_word_embeddings", "use_parallel_residual", "parallel_attn", "attention_bias", "enable_bias", "bias",
    "qkv_bias", "scale_embedding", "scale_attn_by_inverse_layer_idx", "multi_query", "qk_layernorm",
    "apply_residual_connection_post_layernorm",
)
NESTED = ("text_config", "vision_config")
# head_dim 8 or 16 keeps every partial-rotary fraction used by the examples (1/4, 1/2) an even integer.
HEAD_DIMS = (8, 16)
EPS_VALUES = (1e-12, 1e-6, 1e-5, 1e-2)


@dataclass(frozen=True)
class Case:
    """One drawn model: the family's adapter, the example it came from, its config kwargs, the head
    class, a weight seed and the outlier channels to plant in the residual stream."""

    adapter: object
    example: object
    kwargs: dict
    head: str
    seed: int
    outlier_scale: float
    outlier_channels: int
    changed: dict = field(default_factory=dict)

    def _repr_pretty_(self, p, cycle):  # hypothesis' printer: the short form, not every field
        p.text(repr(self))

    def __repr__(self):  # what hypothesis prints for a falsifying example
        return (f"Case({self.adapter.name}/{self.example.name}, head={self.head}, seed={self.seed}, "
                f"outliers={self.outlier_channels}x{self.outlier_scale:g}, changed={self.changed})")


@functools.lru_cache(maxsize=None)
def _defaults(config_cls: str) -> frozenset:
    import transformers

    return frozenset(vars(getattr(transformers, config_cls)()).keys())


def _redraw(draw, kwargs: dict, known: frozenset, changed: dict, prefix: str = "") -> dict:
    kw = dict(kwargs)

    def put(key, value):
        kw[key] = value
        changed[prefix + key] = value

    for width_key, head_keys in WIDTH_KEYS:
        if width_key in kw and any(h in kw for h in head_keys):
            heads = draw(st.integers(1, 4), label=prefix + "heads")
            head_dim = draw(st.sampled_from(HEAD_DIMS), label=prefix + "head_dim")
            old = kw[width_key]
            put(width_key, heads * head_dim)
            for h in head_keys:
                if h in kw:
                    put(h, heads)
            for k in FOLLOW_WIDTH:
                if kw.get(k) == old:
                    put(k, heads * head_dim)
            if "rotary_dim" in kw:
                put("rotary_dim", min(kw["rotary_dim"], head_dim))
            if "num_kv_heads" in kw:
                put("num_kv_heads", draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0])))
            break
    for k in LAYER_KEYS:
        if k in kw:
            put(k, draw(st.integers(1, 3), label=prefix + k))
    if "attention_types" in kw:  # GPT-Neo: one attention kind per layer
        kind = draw(st.sampled_from(["global", "local"]), label=prefix + "attention")
        put("attention_types", [[[kind], kw["num_layers"]]])
    for k in MLP_KEYS:
        if k in kw:
            put(k, draw(st.integers(4, 48), label=prefix + k))
    for k in EPS_KEYS:
        if k in known:
            put(k, draw(st.sampled_from(EPS_VALUES), label=prefix + k))
    for k in TOGGLES:
        if k in known:
            put(k, draw(st.booleans(), label=prefix + k))
    return kw


@st.composite
def cases(draw, adapter) -> Case:
    example = draw(st.sampled_from(adapter.examples), label="example")
    changed: dict = {}
    kwargs = _redraw(draw, example.kwargs, _defaults(example.config), changed)
    for nested in NESTED:  # CLIP-style dual configs: redraw each tower
        if isinstance(kwargs.get(nested), dict):
            kwargs[nested] = _redraw(draw, kwargs[nested], frozenset(kwargs[nested]), changed, nested + ".")
    return Case(
        adapter=adapter, example=example, kwargs=kwargs,
        head=draw(st.sampled_from(example.heads), label="head"),
        seed=draw(st.integers(0, 2**31 - 1), label="seed"),
        outlier_scale=draw(st.sampled_from([0.0, 1e3, 1e4]), label="outlier_scale"),
        outlier_channels=draw(st.integers(1, 3), label="outlier_channels"),
        changed=changed,
    )
