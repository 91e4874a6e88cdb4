"""The family registry: one `Family` entry per model family, the one list every consumer reads.

An entry names, as data, where each part of the family lives:

- `adapter`: the module of `normfold.adapters` that defines its `ADAPTER` (the conversion plan, with the
  family's tiny `TinyExample` configs in `ADAPTER.examples`); None for a family normfold converts
  through the plan the analysis derives (`normfold analyze`), whose tiny configs are then the entry's
  own `examples`.
- `fused`: the modules of `normfold.fastpath.families` that define its fused block forwards (`BLOCKS`, a
  tuple of `FusedBlock`) and its cross-block hand-off stacks (`STACKS`, optional); empty for a family
  that runs transformers' own blocks.

The names are resolved where they are used, each by the layer that owns them: `normfold.adapters` loads
the adapters (`list_adapters`, `find_adapter`: the conversion, the streamed conversion and the tests), and
`normfold.fastpath` registers the fused blocks and stacks when it is imported (it sits above this layer,
so the adapters never import it). Adding a family = its adapter module, its entry below, and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from .base import TinyExample


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring). `name` is also its adapter's name. `examples`: the tiny
    configs of a family without an adapter (an adapter carries its own)."""

    name: str
    adapter: str | None
    fused: tuple[str, ...] = ()
    examples: tuple[TinyExample, ...] = ()

    def __post_init__(self):
        if self.adapter is not None and self.examples:
            raise ValueError(f"{self.name}: a family with an adapter gives its examples in ADAPTER.examples")


# tiny configs shared by the families without an adapter
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=16,
            patch_size=4, num_channels=3)
_LM = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
           max_position_embeddings=64)

# In match order: `find_adapter` tries the adapters in this order (plug-ins after them).
FAMILIES: tuple[Family, ...] = (
    Family("gpt2", adapter="gpt2", fused=("gpt2",)),
    Family("gpt_neo", adapter="gpt_neo", fused=("gpt_neo",)),
    Family("gptj", adapter="gptj", fused=("gptj",)),
    Family("gpt_neox", adapter="gpt_neox", fused=("gpt_neox",)),
    Family("opt", adapter="opt", fused=("opt",)),
    Family("bloom", adapter="bloom", fused=("bloom",)),
    Family("phi", adapter="phi", fused=("phi",)),
    Family("gpt_bigcode", adapter="gpt_bigcode", fused=("gpt_bigcode",)),
    Family("falcon", adapter="falcon", fused=("falcon",)),
    Family("bert", adapter="bert"),
    Family("roberta", adapter="roberta"),
    Family("distilbert", adapter="distilbert"),
    Family("electra", adapter="electra"),
    Family("vit", adapter="vit", fused=("vit",)),
    Family("deit", adapter="deit", fused=("deit",)),
    Family("clip", adapter="clip", fused=("clip",)),
    Family("siglip", adapter="siglip", fused=("siglip",)),
    Family("siglip2", adapter="siglip2", fused=("siglip2",)),
    Family("whisper", adapter="whisper", fused=("whisper",)),
    Family("mbart", adapter="mbart", fused=("mbart",)),
    Family("bart", adapter="bart"),
    # No adapter: the plan the analysis derives converts them (docs/analyze.md). DINOv2 is fused after an
    # rmsnorm conversion (fastpath/families/dinov2.py says why not crmsnorm).
    Family("dinov2", adapter=None, fused=("dinov2",), examples=(
        TinyExample("tiny", "Dinov2Config", dict(_VIT, layerscale_value=0.5), ("Dinov2Model",)),)),
    Family("beit", adapter=None, examples=(
        TinyExample("tiny", "BeitConfig", dict(_VIT, vocab_size=50, use_mask_token=False, layer_scale_init_value=0.5,
                                               use_relative_position_bias=True, use_mean_pooling=True),
                    ("BeitModel",)),)),
    Family("data2vec-vision", adapter=None, examples=(
        TinyExample("tiny", "Data2VecVisionConfig",
                    dict(_VIT, layer_scale_init_value=0.5, use_relative_position_bias=True, use_mean_pooling=True),
                    ("Data2VecVisionModel",)),)),
    Family("vit-mae", adapter=None, examples=(
        TinyExample("tiny", "ViTMAEConfig", dict(_VIT, mask_ratio=0.0), ("ViTMAEModel",)),)),
    Family("persimmon", adapter=None, examples=(
        TinyExample("tiny", "PersimmonConfig", dict(_LM), ("PersimmonForCausalLM",)),)),
    Family("stablelm", adapter=None, examples=(
        TinyExample("tiny", "StableLmConfig", dict(_LM, num_key_value_heads=2), ("StableLmForCausalLM",)),)),
    Family("codegen", adapter=None, examples=(
        TinyExample("tiny", "CodeGenConfig", dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                  rotary_dim=4, bos_token_id=0, eos_token_id=0),
                    ("CodeGenForCausalLM",)),)),
    Family("mpt", adapter=None, examples=(
        TinyExample("tiny", "MptConfig",
                    dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=64),
                    ("MptForCausalLM",)),)),
)


def get_family(name: str) -> Family:
    """The registry entry called `name` (UnsupportedModelError when there is none)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise UnsupportedModelError(f"no family named {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


__all__ = ["FAMILIES", "Family", "get_family"]
