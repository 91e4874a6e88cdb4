"""One path policy for every file normfold reads from a model directory.

    d = ModelDir("path/to/model")
    d.file("config.json")          # the path, checked: exists, a regular file, resolves inside
    d.shard("model-00001-of-00002.safetensors", index)   # a name taken from a shard index
    d.auxiliary_files()            # tokenizer / processor / generation files copied to an output

The rule: the file's resolved path (every symlink followed) lies inside the directory, or, when the
directory is a Hugging Face cache snapshot (``.../models--ORG--NAME/snapshots/REV/``, whose files are
symlinks into ``../../blobs/``), inside that repository's ``blobs/``. Names taken from a shard index
must be plain file names. Anything else raises `UnsafePathError` (exit code 2) naming the offending
path, before anything is read from it or written anywhere (compare tarfile's ``filter="data"``).

The check happens when a path is handed out, and the file is read through the same link right after:
a directory whose links are changed *between* the check and the read (by another process of the same
user) is outside what this guards against.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ..errors import CheckpointError, UnsafePathError

# Files copied verbatim from a source model directory into a converted one (tokenizer, processor,
# generation config): they travel with the checkpoint, so they go through the same policy.
AUXILIARY = re.compile(r"(tokenizer.*|vocab.*|merges\.txt|special_tokens_map\.json|added_tokens\.json|"
                       r"generation_config\.json|preprocessor_config\.json|processor_config\.json|"
                       r".*\.model|chat_template.*)$")
# Files normfold or transformers read from a model directory (besides the auxiliary ones).
_READ = re.compile(r"(config\.json|normfold\.json|.*\.safetensors|.*\.safetensors\.index\.json|.*\.bin|"
                   r".*\.bin\.index\.json)$")
_CACHE_REPO = re.compile(r"(models|datasets|spaces)--.+")

_WHAT = ("normfold reads only files inside the model directory (or, for a Hugging Face cache snapshot, inside "
         "its repository's blobs/); copy the file into the directory if you trust it, or remove the link")


def hf_cache_blobs(root: Path) -> Path | None:
    """`.../models--X/blobs` when `root` (resolved) is a snapshot `.../models--X/snapshots/REV` or a folder
    inside one (`.../snapshots/REV/text_encoder`), else None."""
    for snapshot in (root, *root.parents):
        snapshots = snapshot.parent
        repo = snapshots.parent
        if snapshots.name == "snapshots" and _CACHE_REPO.fullmatch(repo.name):
            blobs = repo / "blobs"
            return blobs.resolve() if blobs.is_dir() else None
    return None


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def plain_name(name) -> bool:
    """A file name with no directory part (what a shard index may name)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name and not name.startswith(".."))


class ModelDir:
    """A model directory and the places its files may resolve to."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory)
        try:
            self.root = self.path.resolve(strict=True)
        except (OSError, RuntimeError) as exc:  # missing, or a symlink loop
            raise CheckpointError(f"{self.path}: cannot open the model directory ({exc})") from None
        self.blobs = hf_cache_blobs(self.root)
        self.roots = [self.root] + ([self.blobs] if self.blobs is not None else [])

    def __repr__(self) -> str:
        return f"ModelDir({str(self.path)!r})"

    # ---- the check ----
    def check(self, name: str, *, where: str = "") -> Path:
        """`directory / name` after checking where it resolves to (it need not exist); `where` says who named it."""
        named = f" (named by {where})" if where else ""
        if not plain_name(name):
            raise UnsafePathError(f"{self.path}: the file name {name!r}{named} is not a plain file name inside the "
                                  f"model directory; refusing to read outside the model directory. {_WHAT}")
        p = self.path / name
        try:
            resolved = p.resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise UnsafePathError(f"{p}{named}: its links cannot be resolved ({exc}). {_WHAT}") from None
        if not any(_inside(resolved, r) for r in self.roots):
            raise UnsafePathError(f"{p}{named} resolves to {resolved}, outside the model directory {self.root}; "
                                  f"refusing to read outside the model directory. {_WHAT}")
        return p

    def exists(self, name: str) -> bool:
        """Whether `name` is there (a link counts even if it dangles: reading it is then checked)."""
        return os.path.lexists(self.path / name)

    def file(self, name: str, *, where: str = "") -> Path:
        """A checked path to a regular file (CheckpointError if missing or not a regular file)."""
        p = self.check(name, where=where)
        try:
            mode = os.stat(p).st_mode
        except OSError:
            by = f"{where} lists" if where else "it needs"
            raise CheckpointError(f"{p} is missing ({by} it); the download is incomplete: re-download or "
                                  "re-export the checkpoint") from None
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"{p} is not a regular file (a directory, device or pipe); {_WHAT}")
        return p

    def optional(self, name: str) -> Path | None:
        """`file(name)` if it exists, else None."""
        return self.file(name) if self.exists(name) else None

    # ---- what a command reads ----
    def entries(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot list the model directory ({exc.strerror or exc})") from None

    def auxiliary_files(self) -> list[Path]:
        """The tokenizer / processor / generation files to copy into a converted checkpoint, each checked."""
        out = []
        for name in self.entries():
            if AUXILIARY.fullmatch(name):
                p = self.check(name)
                if p.is_file():  # a subdirectory named like one (tokenizer/) is not copied
                    out.append(self.file(name))
        return out

    def check_all(self) -> None:
        """Check every top-level file that normfold or transformers reads (config, weights, indexes,
        report, auxiliary files) before anything reads one."""
        for name in self.entries():
            if _READ.fullmatch(name) or AUXILIARY.fullmatch(name):
                p = self.check(name)
                if p.is_dir():
                    continue
                self.file(name)
