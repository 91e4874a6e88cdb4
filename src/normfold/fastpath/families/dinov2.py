"""DINOv2 (transformers 5's Dinov2Layer): the layer-scaled (and drop-path'd) attention output's add fused
with norm2. normfold has no DINOv2 adapter: `normfold.convert` uses the plan `normfold analyze` derives,
which converts it to rmsnorm; its crmsnorm (d−1 stream) conversion is refused (layer scale reads the
stream width) and the zero-padded form's norms pad, so those models keep transformers' code."""

from __future__ import annotations

from ..blocks import FusedBlock, fusable


def _forward(base):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if not fusable(self.norm2):
            return base.forward(self, hidden_states, attention_mask=attention_mask, **kwargs)
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states, _ = self.attention(hidden_states, attention_mask=attention_mask, **kwargs)
        hidden_states = self.layer_scale1(hidden_states)
        residual, hidden_states = self.norm2(self.drop_path(hidden_states), residual)  # + residual, then norm2
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.layer_scale2(hidden_states)
        hidden_states = self.drop_path(hidden_states) + residual
        return hidden_states
    return forward


BLOCKS = (
    FusedBlock("Dinov2Layer", "transformers.models.dinov2.modeling_dinov2", ("norm2",), _forward,
               {"6774acecff37226d": "5.24.0"}),
)
