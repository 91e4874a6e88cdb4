"""transformers 5 marks some blocks' forward with `@deprecate_kwarg("past_key_values", ..., new_name="cache")`;
the fused forward keeps that rename (a caller passing `past_key_values=` still reaches `cache`)."""

from __future__ import annotations


def renames_past_key_values(fn):
    try:
        from transformers.utils.deprecation import deprecate_kwarg
    except ImportError:  # pragma: no cover - the parameters check keeps such a release on its own code
        return fn
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(fn)
