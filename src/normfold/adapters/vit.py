"""ViT (transformers `ViTModel` and its image-classification and masked-image-modeling heads).

Stream: x0 = [cls_token; patch_embeddings.projection(pixels)] + position_embeddings (the MIM head
first swaps masked patch embeddings for `mask_token`). Every one of those is a writer: the Conv2d
is centred over its output channels, the parameters over their last axis. Bicubic interpolation of
the position table (`interpolate_pos_encoding=True`) mixes positions with the same weights in every
channel, so it keeps rows zero-mean. Per block, layernorm_before → attention.{q,k,v}_proj and
layernorm_after → mlp.fc1 read the stream; attention.o_proj and mlp.fc2 write to it. The final
`layernorm` feeds last_hidden_state and the heads (pooler.dense, classifier, the MIM decoder's 1x1
conv, which is not a foldable reader: with fold_final the final norm then keeps its affine).
"""

from __future__ import annotations

from torch import nn

from .base import (
    Adapter,
    BlockTemplate,
    Capabilities,
    ConversionPlan,
    StreamTemplate,
    TinyExample,
    base_prefix,
    join,
)
from ._inputs import image_inputs
from ._tower import present

VIT_BLOCK = BlockTemplate(
    norms=(("layernorm_before", ("attention.q_proj", "attention.k_proj", "attention.v_proj")),
           ("layernorm_after", ("mlp.fc1",))),
    writers=("attention.o_proj", "mlp.fc2"),
)


def vit_like_adapter(name: str, display_name: str, *, model_types: tuple[str, ...], tokens: tuple[str, ...],
                     heads: tuple[str, ...], examples: tuple[TinyExample, ...]) -> Adapter:
    """ViT and DeiT share the layout; they differ in the extra tokens and the head readers."""
    template = StreamTemplate(
        name="encoder",
        sources=("embeddings.patch_embeddings.projection", "embeddings.position_embeddings",
                 *(f"embeddings.{t}" for t in tokens)),
        layers="layers",
        block=VIT_BLOCK,
        final_norm="layernorm",
        final_readers=("pooler.dense", *heads, "decoder.0"),
    )

    def plan(model: nn.Module) -> ConversionPlan:
        stream = template.expand(model)
        mask_token = join(base_prefix(model), "embeddings.mask_token")
        if present(model, mask_token):  # only built for masked image modeling
            stream.writers.append(mask_token)
        return ConversionPlan(adapter=name, streams=[stream])

    return Adapter(name=name, display_name=display_name, plan=plan, model_types=model_types,
                   example_inputs=image_inputs, capabilities=Capabilities(variants=("rmsnorm",)),
                   examples=examples)


_HEADS = ("ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling")

ADAPTER = vit_like_adapter(
    "vit", "ViT", model_types=("vit",), tokens=("cls_token",), heads=("classifier",),
    examples=(
        TinyExample("rgb16-p4", "ViTConfig",
                    dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         image_size=16, patch_size=4, encoder_stride=4, num_labels=3, pooler_output_size=20),
                    _HEADS),
        TinyExample("gray12-noqkvbias-eps6", "ViTConfig",
                    dict(hidden_size=24, num_hidden_layers=3, num_attention_heads=3, intermediate_size=40,
                         image_size=12, patch_size=4, num_channels=1, encoder_stride=4, qkv_bias=False,
                         layer_norm_eps=1e-6, hidden_act="gelu_new", num_labels=2),
                    ("ViTForImageClassification", "ViTForMaskedImageModeling")),
    ),
)
