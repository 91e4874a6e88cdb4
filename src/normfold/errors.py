"""Errors a user can cause. The CLI prints their message (no traceback) and exits with `exit_code`."""

from __future__ import annotations


class NormfoldError(Exception):
    """Base class: a problem with the user's input or environment, with a message saying what to do."""

    exit_code = 2


class ModelNotFoundError(NormfoldError):
    """The MODEL argument names no directory we can read and no hub model we could fetch."""


class NotAModelError(NormfoldError):
    """A directory exists but holds no Hugging Face model (no usable config.json / weights)."""


class UnsupportedModelError(NormfoldError):
    """No adapter describes this architecture."""


class UnsupportedConversionError(NormfoldError):
    """The adapter exists but cannot do what was asked (variant, option, configuration)."""


class UntraceableModelError(NormfoldError):
    """`normfold analyze` could not trace the model's forward pass (torch.export / torch.fx)."""


class NonFiniteWeightsError(NormfoldError):
    """The model has NaN or infinite parameters; no conversion can be exact."""


class OutputExistsError(NormfoldError):
    """The output directory exists and --force was not given."""


class OutputWriteError(NormfoldError):
    """The output cannot be written (not writable, disk full); nothing is left at --out."""


class CheckpointError(NormfoldError):
    """A saved normfold checkpoint is missing files or is inconsistent."""


class VerificationFailedError(NormfoldError):
    """The converted model's outputs differ from the original's beyond tolerance."""

    exit_code = 1


class NormInputError(NormfoldError, ValueError):
    """A norm op got tensors that do not fit together (a weight or bias of the wrong width)."""


class UnsafePathError(CheckpointError):
    """A file of a model directory resolves (through a symlink or a shard index) to a place outside it."""


class ReportSchemaError(CheckpointError):
    """A `normfold.json` does not match the report schema, or disagrees with config.json and the weights."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty), at most 400 characters: what
    a one-paragraph error message quotes of an underlying failure."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:400]
