"""One module per model family, each registering its FusedBlock(s) with normfold.fastpath.blocks.
Importing this package registers them all; adding a family = a module here and its name below."""

from . import (bloom, clip, deit, dinov2, falcon, gpt2, gpt_bigcode, gpt_neo, gpt_neox, gptj, mbart,  # noqa: F401
               opt, phi, vit, whisper)
