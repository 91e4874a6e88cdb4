"""Reading and writing safetensors files tensor by tensor, without memory maps.

Reads use `os.pread` into a private buffer that is freed after use, so resident memory holds only
the tensors being computed (pages touched through an mmap would stay resident until the handle is
closed). Writes lay out the header first (offsets depend on names, dtypes and shapes only) and then
stream each tensor's bytes into place; untouched tensors are copied file-to-file in chunks.

The header is written as safetensors' own serializer writes it (tensors ordered by dtype, largest
first, then by name; JSON without spaces; padded with spaces to 8 bytes), so a file written here has
the same tensor layout as `safetensors.torch.save_file` of the same tensors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path

import torch

from ..errors import CheckpointError

from ..checkpoint.safetensors_format import ST_DTYPES, TORCH_DTYPES, TensorInfo, read_header  # noqa: F401
from ..checkpoint.writer import layout, write_all  # noqa: F401 (re-exported: the one safetensors layer)
CHUNK = 8 * 1024 * 1024


# ---- freed memory kept for reuse (no page fault per tensor) -----------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_DEFAULT_THRESHOLD = 128 * 1024  # glibc's initial mmap and trim thresholds
_reusing = 0


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to tune
        return None


_LIBC = _libc()


def reusing_memory() -> bool:
    """Inside `reuse_freed_memory()`: callers call `trim_if_over` instead of their own malloc_trim."""
    return _reusing > 0


_limit: int | None = None


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@contextlib.contextmanager
def reuse_freed_memory(budget: int | None = None, mmap_from: int = 1024 * 1024 * 1024):
    """Keep freed tensor memory in the process for the next tensor instead of handing it back.

    glibc serves allocations above its mmap threshold (at most 32 MB, so every weight matrix of a 1.5 B model)
    with a fresh mmap and returns them with munmap: every tensor read or computed then page-faults over all of
    its memory (measured: 18.6 s of system time for 1.7 GB converted and verified on a 2-core VM, 5.4 s
    without). Inside this context, allocations below `mmap_from` come from the heap and freed memory stays
    there, and all threads share one arena (a reader thread reuses what the main thread freed). The heap
    fragments slowly (tensors of many sizes, Python objects between them), so callers call `trim_if_over` at
    coarse points: it trims once resident memory exceeds what it was on entry plus `budget`. On exit: glibc's
    initial thresholds again and the free heap trimmed. A no-op without glibc."""
    global _reusing, _limit
    if _LIBC is None:
        yield
        return
    outer = _reusing == 0
    if outer:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, int(mmap_from))
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 64 * 1024 * 1024)
        _LIBC.mallopt(_M_ARENA_MAX, 1)
        _limit = None if budget is None else resident_bytes() + int(budget)
    _reusing += 1
    try:
        yield
    finally:
        _reusing -= 1
        if outer:
            _limit = None
            _LIBC.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD)
            _LIBC.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD)
            _LIBC.malloc_trim(0)


def trim() -> None:
    """Hand the free heap back to the system now (malloc_trim; a no-op without glibc)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def trim_if_over() -> None:
    """Hand the free heap back (malloc_trim) if resident memory is over the budget of `reuse_freed_memory`
    (always, outside it)."""
    if _LIBC is not None and (_reusing == 0 or _limit is None or resident_bytes() > _limit):
        _LIBC.malloc_trim(0)


class Slabs:
    """Byte buffers recycled across tensors of the same size (a streamed conversion reads the same shapes block
    after block): a slab is free again once nothing but the pool references its memory (every tensor viewing
    it is gone: computed, written, dropped), so each block's tensors reuse the previous block's pages instead of
    page-faulting over fresh memory. Thread-safe (the reader thread takes, the main and writer threads drop).
    Holds at most `budget` bytes of slabs; slabs above `largest` bytes and anything past the budget (after
    free slabs of other sizes are dropped) are plain allocations."""

    def __init__(self, budget: int, largest: int = 128 * 1024 * 1024) -> None:
        import threading

        self.budget, self.largest, self.held = budget, largest, 0
        self.slabs: dict[int, list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.largest or _use_count is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            for slab in self.slabs.get(nbytes, ()):
                if _free(slab):
                    return slab.view(torch.uint8)  # a new view: the slab is in use while it lives
            if self.held + nbytes > self.budget:
                self._drop_free()
            if self.held + nbytes > self.budget:
                return torch.empty(nbytes, dtype=torch.uint8)
            slab = torch.empty(nbytes, dtype=torch.uint8)
            slab.pool_uses = _use_count(slab)  # the count when only the pool holds it
            self.slabs.setdefault(nbytes, []).append(slab)
            self.held += nbytes
            return slab.view(torch.uint8)

    def drop_free(self) -> None:
        """Let go of every slab nothing uses (before a one-off large tensor: they would add to its peak)."""
        with self.lock:
            self._drop_free()

    def _drop_free(self) -> None:
        for size in list(self.slabs):
            kept = [t for t in self.slabs[size] if not _free(t)]
            self.held -= (len(self.slabs[size]) - len(kept)) * size
            self.slabs[size] = kept


def _storage_use_count():
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    return lambda t: fn(t.untyped_storage()._cdata)


_use_count = _storage_use_count()


def _free(slab: torch.Tensor) -> bool:
    return _use_count(slab) <= slab.pool_uses


def read_tensor(info: TensorInfo, slabs: Slabs | None = None, direct: bool = False) -> torch.Tensor:
    """A private copy of one tensor (no memory map: freed when the tensor is), in a recycled buffer of `slabs`
    when given (`direct`: see `read_into`)."""
    if info.dtype not in TORCH_DTYPES:
        raise CheckpointError(f"{info.file}: unsupported dtype {info.dtype}")
    # torch.empty, not bytearray: no zero-fill pass over memory the read overwrites anyway
    raw = torch.empty(info.nbytes, dtype=torch.uint8) if slabs is None else slabs.take(info.nbytes)
    read_into(info.file, info.start, raw, direct=direct)
    return raw.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)


def read_into(path: Path, start: int, out: torch.Tensor, direct: bool = False) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` from `start` (pread: no memory map), so a
    caller can reuse one buffer for many reads (no page fault per tensor). `direct`: read past the page cache
    (O_DIRECT, through one aligned staging buffer per thread; plain reads where the filesystem refuses it), for
    a file known not to be cached, as a streamed conversion's own output is (written with O_DIRECT,
    `SequentialFile`): a buffered read would fill fresh page-cache pages, a host fault each on a VM whose
    freed memory goes back to the host (see SequentialFile)."""
    nbytes = out.numel() * out.element_size()
    if nbytes == 0:
        return
    if direct and _read_direct(path, start, out.reshape(-1).view(torch.uint8)):
        return
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], start + done)
            if got <= 0:
                raise CheckpointError(f"{path}: unexpected end of file reading a tensor")
            done += got
    finally:
        os.close(fd)


_direct_stage = threading.local()  # this thread's aligned staging buffer for direct reads


def _read_direct(path: Path, start: int, out: torch.Tensor) -> bool:
    """`read_into(direct=True)`: bytes [start, start + len(out)) of `path` into the uint8 tensor `out`, read in
    aligned blocks with O_DIRECT and copied out of the staging buffer. False (nothing promised about `out`)
    where O_DIRECT is not available, so that the caller reads plainly."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        stage = getattr(_direct_stage, "buf", None)
        if stage is None:
            raw = mmap.mmap(-1, STAGE_BYTES)  # page-aligned, kept for this thread's next reads
            stage = _direct_stage.buf = (raw, memoryview(raw), torch.frombuffer(raw, dtype=torch.uint8))
        _, view, buf = stage
        n = out.numel()
        pos = start - start % ALIGN  # file offset of the staging buffer's first byte
        done = 0
        while done < n:
            skip = start + done - pos
            want = min(STAGE_BYTES, -(-(skip + n - done) // ALIGN) * ALIGN)
            try:
                got = os.preadv(fd, [view[:want]], pos)
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    return False
                raise
            k = min(got - skip, n - done)
            if k <= 0:
                raise CheckpointError(f"{path}: unexpected end of file reading a tensor")
            out[done:done + k].copy_(buf[skip:skip + k])
            done += k
            if got < want and done < n:  # a short read is the end of the file
                raise CheckpointError(f"{path}: unexpected end of file reading a tensor")
            pos += want
        return True
    finally:
        os.close(fd)


def all_finite(t: torch.Tensor) -> bool:
    """torch.isfinite(t).all() without temporaries: NaN propagates through min/max and ±inf shows in them
    (one pass, ~100x faster than isfinite on CPU, no tensor-sized bool)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def copy_range(src: Path, start: int, nbytes: int, out_fd: int, out_offset: int, check=None) -> None:
    """Copy bytes [start, start+nbytes) of `src` to `out_fd` at `out_offset` through a bounded buffer;
    `check(chunk_bytes)` sees each chunk (the finiteness check)."""
    fd = os.open(src, os.O_RDONLY)
    try:
        buf = bytearray(min(CHUNK, max(nbytes, 1)))
        done = 0
        while done < nbytes:
            want = min(len(buf), nbytes - done)
            view = memoryview(buf)[:want]
            got = os.preadv(fd, [view], start + done)
            if got != want:
                raise CheckpointError(f"{src}: unexpected end of file")
            if check is not None:
                check(view)
            _write_all(out_fd, view, out_offset + done)
            done += want
    finally:
        os.close(fd)


def write_tensor(out_fd, tensor: torch.Tensor, offset: int) -> None:
    """Write `tensor`'s bytes at `offset` of `out_fd` (a file descriptor or a `SequentialFile`)."""
    t = tensor.detach().contiguous()
    if t.numel() == 0:
        return
    if isinstance(out_fd, SequentialFile):
        out_fd.write_tensor(t, offset)
        return
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    _write_all(out_fd, data, offset)


def write_bytes(out_fd, data, offset: int) -> None:
    """Write `data` (bytes-like) at `offset` of `out_fd` (a file descriptor or a `SequentialFile`)."""
    _write_all(out_fd, data, offset)


def _write_all(out_fd, data, offset: int) -> None:
    if isinstance(out_fd, SequentialFile):
        out_fd.write(data, offset)
    else:
        write_all(out_fd, data, offset)


# ---- output written past the page cache ---------------------------------------------------------------------

# below this rate (a hard disk's or a slow SSD's; measured over a file's first CHECK_BYTES) direct writing is a slow disk's own speed, which
# the page cache would have hidden: the rest is written plainly (SequentialFile.slow)
MIN_DIRECT_RATE, CHECK_BYTES = 0.4e9, 128 * 1024 * 1024
ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffer addresses in multiples of the block size (4096 covers
STAGE_BYTES = 16 * 1024 * 1024  # 512-byte and 4 KiB devices); bytes staged per direct write


def _take_stage() -> tuple:
    """A page-aligned 16 MB staging buffer (mmap, its uint8 tensor). Not pooled across files: buffers kept
    resident count against `reuse_freed_memory`'s budget and made it trim the heap more often (measured: more
    system time, not less)."""
    import mmap

    raw = mmap.mmap(-1, STAGE_BYTES)
    return raw, torch.frombuffer(raw, dtype=torch.uint8)


def _give_stage(stage: tuple) -> None:
    """A staging buffer from `_take_stage` unmapped (now, or with the last view still alive)."""
    raw, buf = stage
    del buf, stage
    with contextlib.suppress(BufferError):  # a view still alive: freed with it
        raw.close()


class SequentialFile:
    """A new file written front to back (`write(data, offset)` at contiguous increasing offsets, as the streamed
    writer writes every output file) through O_DIRECT: bytes are gathered in one page-aligned 16 MB staging
    buffer and written past the page cache. Why: a buffered write must first get a page-cache page for every
    4 KiB it writes, and on a VM whose freed memory goes back to the host (virtio-balloon free page reporting,
    as on the machine that measured it) each of those pages is a host fault: 1.42 GB written buffered into a new
    file cost 2.7-2.9 s of system time (0.27 s when the pages had just been freed by the process), O_DIRECT 0.04 s
    (docs/large-checkpoints.md). The bytes on disk are the same. Where O_DIRECT is refused (tmpfs, some network
    filesystems: EINVAL at open or at the first write), or a write comes out of order, it falls back to plain
    pwrite for the rest of the file. `close()` writes the last partial block padded and truncates the file to
    its size; `fd` (a plain descriptor of the same file) stays valid for fstat until the caller closes it."""

    def __init__(self, fd: int, path: Path, size: int, direct: bool = True) -> None:
        self.fd, self.path, self.size = fd, Path(path), size
        self.dfd: int | None = None
        if direct and hasattr(os, "O_DIRECT") and size >= ALIGN:
            try:
                self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self.dfd = None
        self.stage = self.buf = None
        self.spare = None  # the other staging buffer (mmap, tensor): filled while this one is being written
        self.pending = None  # (future, stage, file offset, length) of the full buffer being written
        self.flusher = None  # the thread that writes full buffers (os.pwrite releases the GIL)
        if self.dfd is not None:
            self.stage, self.buf = _take_stage()
        self.slow = False  # direct writes ran below MIN_DIRECT_RATE: given up
        self.fell_back = self.dfd is None  # some bytes were written plainly (so may be in the page cache)
        self.direct_bytes, self.direct_s = 0, 0.0
        self.start = 0  # file offset of the staged bytes
        self.fill = 0  # bytes staged
        self.end = 0  # where the next sequential write starts

    @property
    def direct(self) -> bool:
        return self.dfd is not None

    def write(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        if not self._sequential(offset, len(view)):
            write_all(self.fd, view, offset)
            return
        done = 0
        while done < len(view):
            k = min(STAGE_BYTES - self.fill, len(view) - done)
            self.stage[self.fill:self.fill + k] = view[done:done + k]
            self._staged(k)
            done += k
            if self.dfd is None and done < len(view):  # given up within this write: the rest plainly
                write_all(self.fd, view[done:], offset + done)
                return

    def write_tensor(self, t: torch.Tensor, offset: int) -> None:
        """A contiguous tensor's bytes at `offset` (copied into the staging buffer by torch, without the GIL)."""
        src = t.reshape(-1).view(torch.uint8)
        if not self._sequential(offset, src.numel()):
            write_all(self.fd, memoryview(src.numpy()), offset)
            return
        done = 0
        while done < src.numel():
            k = min(STAGE_BYTES - self.fill, src.numel() - done)
            self.buf[self.fill:self.fill + k].copy_(src[done:done + k])
            self._staged(k)
            done += k
            if self.dfd is None and done < src.numel():  # given up within this write: the rest plainly
                write_all(self.fd, memoryview(src[done:].numpy()), offset + done)
                return

    def _sequential(self, offset: int, n: int) -> bool:
        """Whether this write goes through the staging buffer (direct, in order); else the file is plain from here."""
        if self.dfd is None:
            return False
        if offset == self.end:
            self.end += n
            return True
        self._fall_back()
        return False

    def _staged(self, k: int) -> None:
        self.fill += k
        if self.fill == STAGE_BYTES:
            self._flush_behind()

    def _flush_behind(self) -> None:
        """The full staging buffer written by the flusher thread while the caller fills the other one (a direct
        write is synchronous: ~10 ms per 16 MB that the copying into the stage would otherwise wait out)."""
        from concurrent.futures import ThreadPoolExecutor

        self._wait()  # the other buffer's write done (or refused: then everything is plain from here)
        if self.dfd is None:
            self._fall_back()
            return
        if self.flusher is None:
            self.flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normfold-flush")
        if self.spare is None:
            self.spare = _take_stage()
        self.pending = (self.flusher.submit(self._pwrite_direct, self.stage, STAGE_BYTES, self.start), self.stage,
                        self.start, STAGE_BYTES)
        full = (self.stage, self.buf)
        self.stage, self.buf = self.spare
        self.spare = full
        self.start += STAGE_BYTES
        self.fill = 0

    def _pwrite_direct(self, stage, n: int, at: int) -> float:
        """Write stage[:n] at `at` through the direct descriptor; the seconds it took."""
        t0 = time.perf_counter()
        with memoryview(stage) as view:
            done = 0
            while done < n:
                got = os.pwrite(self.dfd, view[done:n], at + done)
                if got <= 0 or got % ALIGN:
                    raise OSError(errno.EINVAL, "short direct write")
                done += got
        return time.perf_counter() - t0

    def _wait(self) -> None:
        """The write in flight finished: counted, or (refused by the filesystem) redone plainly and direct
        writing turned off; a direct rate below MIN_DIRECT_RATE turns it off too."""
        if self.pending is None:
            return
        future, stage, at, n = self.pending
        self.pending = None
        try:
            seconds = future.result()
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            with memoryview(stage) as view:
                write_all(self.fd, view[:n], at)
            self.fell_back = True
            self._close_direct()
            return
        self.direct_s += seconds
        self.direct_bytes += n
        if (self.direct_bytes >= CHECK_BYTES and not self.slow
                and self.direct_bytes < MIN_DIRECT_RATE * self.direct_s):
            self.slow = True  # a slow disk: the page cache absorbs the rest (written back later)
            self._fall_back()

    def _flush(self, n: int) -> None:
        """Write the first `n` staged bytes (a multiple of ALIGN) at `self.start`."""
        t0 = time.perf_counter()
        try:
            with memoryview(self.stage) as view:
                done = 0
                while done < n:
                    got = os.pwrite(self.dfd, view[done:n], self.start + done)
                    if got <= 0 or got % ALIGN:
                        raise OSError(errno.EINVAL, "short direct write")
                    done += got
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            self._fall_back()  # the filesystem refused O_DIRECT: everything staged written plainly, and the rest
            return
        self.direct_s += time.perf_counter() - t0
        self.direct_bytes += n
        self.start += n
        self.fill -= n
        if self.fill:
            self.stage.move(0, n, self.fill)
        if (self.direct_bytes >= CHECK_BYTES and not self.slow
                and self.direct_bytes < MIN_DIRECT_RATE * self.direct_s):
            self.slow = True  # a slow disk: the page cache absorbs the rest (written back later)
            self._fall_back()

    def _fall_back(self) -> None:
        """Out of order: the staged bytes written plainly, direct writing off for the rest of the file."""
        self._wait()  # the buffer in flight first (it lies before the staged bytes)
        self.fell_back = True
        if self.fill:
            with memoryview(self.stage) as view:
                write_all(self.fd, view[:self.fill], self.start)
            self.start += self.fill
            self.fill = 0
        self._close_direct()

    def _close_direct(self) -> None:
        if self.pending is not None:  # only after a failure elsewhere: let the write in flight end first
            self.pending[0].exception()
            self.pending = None
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def close(self) -> None:
        """The last staged bytes written (a partial block padded to ALIGN, then the file truncated to its
        length); the direct descriptor and the staging buffer released. `fd` stays open (the caller's)."""
        try:
            self._wait()
            if self.dfd is not None and self.fill:
                whole = self.fill - self.fill % ALIGN
                if whole:
                    self._flush(whole)
                if self.dfd is not None and self.fill:
                    length = self.start + self.fill  # padded with zeros to a block, cut back to `length`
                    self.stage[self.fill:ALIGN] = bytes(ALIGN - self.fill)
                    self.fill = ALIGN
                    self._flush(ALIGN)
                    os.ftruncate(self.fd, max(length, self.size))
            elif self.fill:
                self._fall_back()
        finally:
            self._close_direct()
            if self.flusher is not None:
                self.flusher.shutdown(wait=True)
                self.flusher = None
            stages = [pair for pair in ((self.stage, self.buf), self.spare) if pair is not None and pair[0] is not None]
            self.stage = self.buf = self.spare = None
            for pair in stages:
                _give_stage(pair)
