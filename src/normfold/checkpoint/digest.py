"""SHA-256 of weight files (tamper evidence): recorded in `normfold.json` when a checkpoint is written,
checked by `normfold verify CONVERTED`."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK = 8 * 1024 * 1024


def file_digest(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in chunks (the file just written is in the page cache)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class HashingSink:
    """A file descriptor written front to back (`write(data, offset)` at increasing, contiguous offsets),
    hashed as it is written; a write out of order turns hashing off and `hexdigest()` then reads the file."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, Path(path)
        self._sha = hashlib.sha256()
        self._pos = 0
        self._in_order = True

    def seen(self, data, offset: int) -> None:
        """Account for `data` written at `offset`."""
        if self._in_order and offset == self._pos:
            self._sha.update(data)
            self._pos += len(data)
        else:
            self._in_order = False

    def hexdigest(self) -> str:
        if self._in_order and self._pos == os.fstat(self.fd).st_size:
            return self._sha.hexdigest()
        return file_digest(self.path)


def check_digests(files: dict[str, Path], recorded: dict[str, dict]) -> list[dict]:
    """Compare weight files ({name: path}, checked by the path policy) with the digests a report recorded
    ({name: {"sha256", "bytes"}}): one row per file, `status` "ok", "changed" (size or SHA-256 differ),
    "missing" (recorded, not there) or "unrecorded" (there, not recorded)."""
    rows = []
    for name in sorted(set(files) | set(recorded)):
        want = recorded.get(name)
        path = files.get(name)
        if path is None:
            rows.append({"file": name, "status": "missing", "sha256": None, "recorded": want["sha256"]})
            continue
        if want is None:
            rows.append({"file": name, "status": "unrecorded", "sha256": None, "recorded": None})
            continue
        size = Path(path).stat().st_size
        got = file_digest(path) if size == want["bytes"] else None
        ok = got is not None and got == want["sha256"].lower()
        rows.append({"file": name, "status": "ok" if ok else "changed", "sha256": got, "recorded": want["sha256"],
                     "bytes": size, "recorded_bytes": want["bytes"]})
    return rows
