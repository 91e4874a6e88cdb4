"""Building a shared library on first use, shared by the kernel library (cpu.py) and the pycall
extension (pycall.py)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def compile_to(argv: list[str], target: Path, timeout: int) -> None:
    """Run the compiler command `argv` with `-o` a temp file next to `target`, then rename it to
    `target`: concurrent processes never see a half-written library, and a failed build leaves
    nothing behind. Raises subprocess.CalledProcessError (with the compiler's stderr) on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*argv, "-o", tmp], check=True, capture_output=True, text=True, timeout=timeout)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
