"""Tiny random configs of transformers families that have no normfold adapter, converted by the plan the
analysis derives (issue 13). Used by tests/analysis/test_autoplan.py and scripts/auto_families.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AutoFamily:
    key: str
    config: str
    head: str
    kwargs: dict
    # Trace/verification inputs other than the config's defaults (e.g. another image size).
    image_size: int | None = None
    extra: dict = field(default_factory=dict)

    def build(self, dtype=torch.float64, seed: int = 0):
        import transformers

        torch.manual_seed(seed)
        cfg = getattr(transformers, self.config)(**self.kwargs)
        return getattr(transformers, self.head)(cfg).eval().to(dtype)


_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=16,
            patch_size=4, num_channels=3)
_LM = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
           max_position_embeddings=64)

FAMILIES = (
    AutoFamily("dinov2", "Dinov2Config", "Dinov2Model", dict(_VIT, layerscale_value=0.5)),
    AutoFamily("dinov2-24px", "Dinov2Config", "Dinov2Model", dict(_VIT, layerscale_value=0.5), image_size=24),
    AutoFamily("beit", "BeitConfig", "BeitModel",
               dict(_VIT, vocab_size=50, use_mask_token=False, layer_scale_init_value=0.5,
                    use_relative_position_bias=True, use_mean_pooling=True)),
    AutoFamily("data2vec-vision", "Data2VecVisionConfig", "Data2VecVisionModel",
               dict(_VIT, layer_scale_init_value=0.5, use_relative_position_bias=True, use_mean_pooling=True)),
    AutoFamily("vit-mae", "ViTMAEConfig", "ViTMAEModel", dict(_VIT, mask_ratio=0.0)),
    AutoFamily("persimmon", "PersimmonConfig", "PersimmonForCausalLM", dict(_LM)),
    AutoFamily("stablelm", "StableLmConfig", "StableLmForCausalLM", dict(_LM, num_key_value_heads=2)),
    AutoFamily("codegen", "CodeGenConfig", "CodeGenForCausalLM",
               dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, bos_token_id=0,
                    eos_token_id=0)),
    AutoFamily("mpt", "MptConfig", "MptForCausalLM",
               dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=64)),
)
