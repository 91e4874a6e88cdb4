"""One module per model family, each registering its FusedBlock(s) with normfold.fastpath.blocks.
Importing this package registers them all; adding a family = a module here and its name below."""

from . import gpt2, vit  # noqa: F401
