"""transformers 5 marks some blocks' forward with `@deprecate_kwarg("past_key_values", ..., new_name="cache")`
(5.25 adds `expose_in_signature=True` on some of them); the fused forward keeps that rename, as the block's own
forward does (a caller passing `past_key_values=` still reaches `cache`)."""

from __future__ import annotations

import inspect


def renames_past_key_values(base):
    """A decorator giving a fused forward the same `past_key_values` -> `cache` rename as `base.forward`."""
    def decorate(fn):
        try:
            from transformers.utils.deprecation import deprecate_kwarg
        except ImportError:  # pragma: no cover - the source digests keep such a release on its own code
            return fn
        exposed = "past_key_values" in inspect.signature(base.forward).parameters
        if exposed and "expose_in_signature" in inspect.signature(deprecate_kwarg).parameters:
            return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache", expose_in_signature=True)(fn)
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(fn)
    return decorate
