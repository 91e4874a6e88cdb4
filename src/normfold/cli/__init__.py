"""The `normfold` command. Each subcommand lives in its own module with `add_parser(subparsers)` and
`run(args) -> exit code`; adding one is a new module and a line in `_COMMANDS`."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import traceback

from .._version import __version__
from ..errors import NormfoldError

_COMMANDS = ("convert", "verify", "analyze", "fuse", "export", "bench")

DESCRIPTION = """\
normfold turns LayerNorm Transformers into arithmetically equivalent RMSNorm models.

A Pre-LN Transformer only ever reads normalized copies of its residual stream, and LayerNorm is
blind to the stream's mean. normfold makes the stream zero-mean (centres the embedding tables and
every residual-branch output projection), folds each norm's scale/shift into the linear layers that
read it, and swaps LayerNorm for the cheaper RMSNorm -- which equals LayerNorm on zero-mean input.
Every conversion is checked by running both models (float64 exactness and working-dtype error).
"""

EPILOG = """\
examples:
  normfold convert --out ./kjv-rms            convert the bundled default model (a small GPT-2)
  normfold convert ./my-gpt2 --out ./gpt2-rms convert a local Hugging Face model directory
  normfold verify ./my-gpt2 ./gpt2-rms        re-check a saved conversion against its original
  normfold analyze ./my-bert                  which LayerNorms can be folded, and why the others cannot
  normfold convert ./my-gpt2 --to un --out ./gpt2-un   swap LayerNorm for Unified Normalization (to fine-tune)
  normfold fuse ./gpt2-un-ft --out ./gpt2-fused        fold a fine-tuned UN model's norms into its linears
  normfold export ./gpt2-rms --onnx gpt2-rms.onnx      export to ONNX and check it in onnxruntime

exit codes: 0 ok, 1 verification failed, 2 bad input (message on stderr, nothing written),
            3 internal error (a bug: please report it with the traceback), 130 interrupted.
Run `normfold COMMAND --help` for each command's options.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normfold", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"normfold {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}_cmd")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    _quiet_third_party()
    previous = _terminate_as_interrupt()
    try:
        return int(args.run(args) or 0)
    except NormfoldError as exc:
        print(f"normfold {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"normfold {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception:  # a bug, not a user error: show everything
        traceback.print_exc()
        print(f"normfold {args.command}: internal error (this is a bug in normfold; please report it "
              "with the traceback above)", file=sys.stderr)
        return 3
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate_as_interrupt():
    """SIGTERM (kill, a job scheduler's timeout) unwinds like Ctrl-C, so the temporary output is removed."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (main() called from a worker thread): leave it alone
        return None


def _quiet_third_party() -> None:
    """transformers' own progress bars and warnings would drown normfold's progress lines
    (set before transformers is imported, so commands that never need it don't pay for it)."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
