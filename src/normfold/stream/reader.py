"""Reading a model directory's safetensors weights one tensor at a time (block-wise verification).

`CheckpointReader` maps tensor names to files through the index (every file name checked by the path policy,
`normfold.checkpoint`) and reads each tensor with pread into a private or a caller's reused buffer: nothing
stays memory-mapped between units, and a cast to float64 goes through one reused staging buffer."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoint.safetensors_format import TORCH_DTYPES, read_header
from ..errors import CheckpointError, NormfoldError



class CheckpointReader:
    """Tensor names → memory-mapped safetensors files of a model directory (single file or index).

    Files are mapped with `safe_open` only while one unit is read (`session`); `get` copies one
    tensor out, so nothing stays mapped between units."""

    def __init__(self, directory: str | os.PathLike, direct: bool = False) -> None:
        """`direct`: tensors read past the page cache (safetensors_io.read_into), for a directory known not to be
        cached (a streamed conversion's own output)."""
        from ..checkpoint import ModelDir, read_weight_map

        model_dir = ModelDir(directory)  # every file through the path policy: nothing read from outside
        model_dir.check_all()
        self.dir = model_dir.path
        self.files: dict[str, Path] = {}
        indexes = [n for n in model_dir.entries() if n.endswith(".safetensors.index.json")]
        if indexes:
            for index in indexes:
                for name, file in read_weight_map(model_dir, index).items():
                    self.files.setdefault(name, self.dir / file)
        self._headers: dict[Path, dict] = {}
        if not indexes:
            for n in model_dir.entries():
                if n.endswith(".safetensors") and not n.startswith("."):
                    f = model_dir.file(n)
                    with _checkpoint_errors(f):
                        self._headers[f] = read_header(f)[0]
                    for name in self._headers[f]:
                        self.files.setdefault(name, f)
        if not self.files:
            pickles = [p.name for p in self.dir.glob("*.bin")]
            extra = f" (it has {', '.join(pickles)}: re-save it as safetensors)" if pickles else ""
            raise CheckpointError(f"{self.dir} has no safetensors weights{extra}; block-wise verification "
                                  "reads safetensors only")
        self._handles: dict[Path, object] | None = None
        self._stage: Tensor | None = None
        self.direct = direct

    def __contains__(self, name: str) -> bool:
        return name in self.files

    @contextlib.contextmanager
    def session(self):
        """Keep files open (mapped) while one unit is read; unmapped after it, so the pages touched
        for one unit do not stay resident for the rest of the run."""
        outer = self._handles is None
        if outer:
            self._handles = {}
        try:
            yield self
        finally:
            if outer:
                handles, self._handles = self._handles, None
                for h in handles.values():
                    with contextlib.suppress(Exception):
                        h.__exit__(None, None, None)

    def _handle(self, f: Path):
        from safetensors import safe_open

        if f not in self._handles:
            with _checkpoint_errors(f):
                self._handles[f] = safe_open(str(f), "pt").__enter__()
        return self._handles[f]

    def _info(self, name: str):
        """The tensor's header entry (file offsets), read once per file with plain reads."""
        f = self.files[name]
        if f not in self._headers:
            with _checkpoint_errors(f):
                self._headers[f] = read_header(f)[0]
        return self._headers[f][name]

    def get(self, name: str, out: Tensor | None = None) -> Tensor:
        """A private copy read with pread: no memory map, so no file pages stay resident beside it. `out`
        (a contiguous tensor of the stored shape and dtype) is filled instead of a new tensor."""
        from .safetensors_io import read_into, read_tensor

        with _checkpoint_errors(self.files[name]):
            if out is None:
                return read_tensor(self._info(name), direct=self.direct)
            entry = self._info(name)
            read_into(entry.file, entry.start, out, direct=self.direct)
            return out

    def info(self, name: str) -> tuple[tuple, torch.dtype]:
        """(shape, dtype) of a stored tensor, from the header."""
        entry = self._info(name)
        if entry.dtype not in TORCH_DTYPES:
            raise CheckpointError(f"{entry.file}: tensor {name!r} has dtype {entry.dtype}, which normfold does not read")
        return tuple(entry.shape), TORCH_DTYPES[entry.dtype]

    def _staging(self, nbytes: int) -> Tensor:
        """One reused byte buffer for reads that are cast (no fresh pages per chunk)."""
        if self._stage is None or self._stage.numel() < nbytes:
            self._stage = torch.empty(nbytes, dtype=torch.uint8)
        return self._stage[:nbytes]

    def get_as(self, name: str, dtype: torch.dtype, chunk_bytes: int = 1 << 24, out: Tensor | None = None,
               rows: tuple[int, int] | None = None) -> Tensor:
        """The tensor cast to `dtype`, read (pread) in slices of rows through one reused staging buffer: the
        stored-dtype copy that a whole-tensor read and cast would hold next to the result is never larger
        than `chunk_bytes`. `out` (contiguous, the stored shape, `dtype`) is filled instead of a new tensor.
        `rows` (a, b): only rows a..b-1 along the first axis (`out` then has b - a rows)."""
        from .safetensors_io import read_into

        entry = self._info(name)
        shape, stored = self.info(name)
        if len(shape) == 0:
            if out is None:
                out = torch.empty(shape, dtype=dtype)
            out.copy_(self.get(name))
            return out
        row = max(1, entry.nbytes // max(1, shape[0]))
        first, last = rows if rows is not None else (0, shape[0])
        if out is None:
            out = torch.empty((last - first, *shape[1:]), dtype=dtype)
        if stored == dtype and out.is_contiguous():  # nothing to cast: read straight into `out`
            with _checkpoint_errors(entry.file):
                read_into(entry.file, entry.start + first * row, out, direct=self.direct)
            return out
        step = max(1, chunk_bytes // row)
        with _checkpoint_errors(entry.file):
            for i in range(first, last, step):
                k = min(step, last - i)
                part = self._staging(k * row).view(stored).view(k, *shape[1:])
                read_into(entry.file, entry.start + i * row, part, direct=self.direct)
                out[i - first:i - first + k].copy_(part)
        return out

    def get_rows(self, name: str, rows: Tensor, dtype: torch.dtype, out: Tensor) -> None:
        """Only `rows` (indices along the first axis) of the tensor, cast to `dtype`, written into `out` (the
        full shape; the other rows are left as they are): an embedding looked up by a few tokens."""
        from .safetensors_io import read_into

        entry = self._info(name)
        shape, stored = self.info(name)
        row = entry.nbytes // max(1, shape[0])
        part = self._staging(row).view(stored).view(*shape[1:])
        with _checkpoint_errors(entry.file):
            for r in rows.tolist():
                read_into(entry.file, entry.start + r * row, part, direct=self.direct)
                out[r].copy_(part)

    def dtype(self) -> torch.dtype:
        """The stored floating dtype (of the first floating tensor, in name order)."""
        with self.session():
            return self._dtype()

    def _dtype(self) -> torch.dtype:
        for name in sorted(self.files):
            f = self._handle(self.files[name])
            with _checkpoint_errors(self.files[name]):
                dt = TORCH_DTYPES.get(self._info(name).dtype)
            if dt is not None and dt.is_floating_point:
                return dt
        return torch.float32

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.files.values()))






@contextlib.contextmanager
def _checkpoint_errors(f: Path):
    try:
        yield
    except NormfoldError:
        raise
    except Exception as exc:  # safetensors raises its own error types for broken files
        raise CheckpointError(f"{f} could not be read as safetensors ({type(exc).__name__}: "
                              f"{str(exc).strip()[:300]}); re-save or re-download it") from exc
