"""Pre-CRMSNorm for real checkpoints (paper 001 §3.2–3.4.2, Appendix C).

- `to="crmsnorm"`: Pre-LN → Pre-RMSNorm → Pre-CRMSNorm on the (d−1)-wide stream (`crmsnorm.py`),
  `variant_options={"pad": True}` for the zero-padded d-wide form;
- the runtime that lets transformers' own modules run the narrower stream (`runtime.py`);
- the reverse conversions: Pre-CRMSNorm → Pre-RMSNorm and Pre-RMSNorm → Pre-LN (`reverse.py`).
"""

from __future__ import annotations

from ..conversion import Variant, register_variant
from ..io import register_structure_part
from .crmsnorm import apply_crmsnorm, compress, keep_ties_compressed
from .reverse import carries_normfold_norms, decompress, run_reverse, to_layernorm
from .runtime import StreamCRMSNorm, TiedCompressedHead, apply_compression, decompress_last

register_structure_part("compression", apply_compression)  # normfold.load rebuilds the d-1 stream
register_variant(Variant(
    "crmsnorm", "Pre-LN -> Pre-CRMSNorm: zero-mean stream compressed to d-1 coordinates, LayerNorm -> CRMSNorm "
    "(exact; --pad keeps d with a zero last coordinate)", apply_crmsnorm, takes_options=True,
    keep_ties=keep_ties_compressed, keep_shared_tables=True))



def _only_from_converted(model, plan, options, report) -> None:  # pragma: no cover - run_reverse executes it
    from ..errors import UnsupportedConversionError

    raise UnsupportedConversionError("--to layernorm converts normfold Pre-RMSNorm / Pre-CRMSNorm models back")


# The reverse conversions (paper 001 App. C): `--to layernorm`, and every target for a model that already carries
# normfold norms, run by their own executor (Variant.executor) rather than by an adapter's plan.
register_variant(Variant(
    "layernorm", "Pre-RMSNorm / Pre-CRMSNorm -> Pre-LN (paper 001 App. C; the stock architecture again)",
    _only_from_converted, executor=run_reverse, claims=carries_normfold_norms))

__all__ = ["apply_crmsnorm", "compress", "decompress", "to_layernorm", "TiedCompressedHead", "StreamCRMSNorm", "apply_compression", "decompress_last"]
