"""Writing a model directory safely: fail before any work when the output cannot be written, one writer per
output (a lock file beside it, stale locks of dead processes taken over), the usual permissions on the
result, and a failed write reported as the user's to fix (a full disk) with nothing left behind."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from ..errors import OutputExistsError, OutputWriteError, first_line


def check_output_dir(out: str | os.PathLike, force: bool) -> Path:
    """Fail early (before any work) if `out` exists and --force was not given."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory; choose another --out (normfold never "
                                "replaces a file)")
    if out.exists() and not force:
        raise OutputExistsError(f"{out} already exists; choose another --out or pass --force to replace it")
    _check_writable(out.absolute().parent, out)
    return out


def _check_writable(parent: Path, out: Path) -> None:
    """The output is written as a temporary directory beside `out`: make sure one can be created there
    (by trying: os.access says yes to root even on read-only file systems)."""
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputWriteError(f"cannot write {out}: {existing} is a file, not a directory; choose another --out")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".normfold-probe-", dir=existing))
        probe.rmdir()
    except OSError as exc:
        raise OutputWriteError(f"cannot write {out}: {existing} is not writable ({exc.strerror or exc}); choose "
                               "another --out on a writable file system") from None


def write_failed(out: Path, exc: BaseException) -> OutputWriteError:
    text = str(exc)
    errno_ = getattr(exc, "errno", None)
    full = errno_ in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) or any(
        k in text for k in ("No space left", "File too large", "Disk quota", "os error 28", "os error 27"))
    why = "the disk is full (or a file-size / quota limit was hit)" if full else first_line(exc)
    return OutputWriteError(f"writing {out} failed: {why}. The partial output was removed and nothing was written "
                            f"at {out}; free space (or choose --out on another disk) and run again")


@contextlib.contextmanager
def output_lock(out: str | os.PathLike):
    """`.{name}.lock` beside `out`, created exclusively: a second conversion into `out` fails at once.
    A lock whose process is gone (kill -9, power cut) is stale and taken over."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{out.name}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            if not _stale(lock):
                raise OutputExistsError(f"another normfold conversion is writing {out} (lock file {lock}); wait for "
                                        "it to finish or choose another --out") from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
    else:
        raise OutputExistsError(f"could not take the lock {lock} for {out}; choose another --out")
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        yield lock
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


def _stale(lock: Path) -> bool:
    """True when the lock names a process that no longer exists (on this machine)."""
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return False  # being written right now, or not ours: respect it
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def apply_umask(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; give the result the usual permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


@contextlib.contextmanager
def staged_dir(out: Path, *, write_errors: tuple[str, ...] = ()):
    """Build a directory in a temporary sibling of `out` (yielded), then put it in `out`'s place.

    The body writes everything into the yielded directory; on a clean exit its permissions follow the
    umask, an existing `out` is moved aside, the new directory renamed into place and the old one removed.
    On any error the temporary directory is removed and the old `out` restored, so nothing half-written is
    left. OSError (and exceptions whose class name is in `write_errors`) become `write_failed`'s message."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    backup = None
    try:
        yield tmp
        apply_umask(tmp)
        if out.exists():
            backup = out.with_name(f".{out.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
            os.rename(out, backup)
        os.rename(tmp, out)
    except BaseException as exc:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if backup is not None and not out.exists():
            os.rename(backup, out)
        if isinstance(exc, OSError) or type(exc).__name__ in write_errors:
            raise write_failed(out, exc) from None
        raise
    if backup is not None:
        import shutil

        shutil.rmtree(backup, ignore_errors=True)
