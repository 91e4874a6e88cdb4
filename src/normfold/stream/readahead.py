"""Read-ahead for block-wise verification: the next block's stored tensors read on one background thread while
the current block computes, so that a pass over weights not in the page cache (a streamed conversion's own
output, written with O_DIRECT) does not wait for the disk between blocks.

At most one unit is read ahead, into stored-dtype buffers that are reused from block to block (no fresh pages
per block): in a pass that casts (float64 over a float32 or 16-bit checkpoint) the main thread casts them into
its own pooled buffers and hands them back here; in a pass in the stored dtype they become the parameters
themselves and come back through the streamer's BufferPool when the block is freed. The bytes are the same
whichever thread reads them, so the results are too. A read that fails on the background thread raises its
exception (the reader's CheckpointError, as a read on the main thread would) when that unit is loaded, not
before; a read-ahead of a unit that is not loaded next is cancelled and waited for, and `close` (at the end of
every pass, also on an exception) leaves no thread running.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import NormfoldError
from .memory import BufferPool
from .reader import CheckpointReader

ENV = "NORMFOLD_VERIFY_READAHEAD"



def enabled(flag: bool | None = None) -> bool:
    """`flag` if given, else NORMFOLD_VERIFY_READAHEAD (default on; 0 turns it off)."""
    if flag is not None:
        return bool(flag)
    raw = os.environ.get(ENV, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise NormfoldError(f"{ENV}={raw!r}: expected 0 (no read-ahead) or 1 (read the next block ahead, the default)")



@dataclass
class _Job:
    path: str
    slots: list[str]
    bufs: list[Tensor]
    future: object
    cancel: threading.Event = field(default_factory=threading.Event)



class ReadAhead:
    """One unit's stored tensors (`start`) read on a background thread; `take` hands them over."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.pool = BufferPool()  # stored-dtype buffers handed back after a cast, refilled by the next read-ahead
        self._executor: ThreadPoolExecutor | None = None
        self._job: _Job | None = None

    def start(self, path: str, items: list[tuple[str, str, tuple, torch.dtype]], take) -> None:
        """Read `items` ((slot, checkpoint key, shape, stored dtype) of unit `path`) on the background thread,
        into buffers from this read-ahead's pool, else `take(shape, dtype)` (the streamer's pool), else new."""
        self.cancel()
        bufs = []
        for _, _, shape, dtype in items:
            buf = self.pool.take(shape, dtype)
            if buf is None:
                buf = take(shape, dtype)
            bufs.append(buf if buf is not None else torch.empty(shape, dtype=dtype))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normfold-readahead")
        cancel = threading.Event()
        keys = [key for _, key, _, _ in items]
        future = self._executor.submit(self._read, keys, bufs, cancel)
        self._job = _Job(path, [slot for slot, _, _, _ in items], bufs, future, cancel)

    def _read(self, keys: list[str], bufs: list[Tensor], cancel: threading.Event) -> None:
        for key, buf in zip(keys, bufs):
            if cancel.is_set():
                return
            self.reader.get(key, out=buf)  # pread (releases the GIL); errors as CheckpointError, as on the main thread

    def take(self, path: str) -> dict[str, Tensor] | None:
        """{slot: tensor} read ahead for `path` (waiting for the read to finish; its error raised here), or None
        when nothing was read ahead for it (anything read ahead for another unit is dropped)."""
        job = self._job
        if job is None:
            return None
        if job.path != path:
            self.cancel()
            return None
        self._job = None
        job.future.result()  # the background read's exception, raised in the loading thread
        return dict(zip(job.slots, job.bufs))

    def cancel(self) -> None:
        """Stop the read in flight (between tensors) and wait for it; its buffers go back to the pool."""
        job, self._job = self._job, None
        if job is None:
            return
        job.cancel.set()
        try:
            job.future.result()
        except Exception:  # noqa: BLE001 - a read nobody loads: its error is not this unit's
            pass
        for buf in job.bufs:
            self.pool.give(buf)

    def reader_for_rows(self, key: str, dtype: torch.dtype, chunks: list[tuple[int, int]], shape: tuple) -> "_Rows":
        """Row chunks (a, b) of tensor `key` (stored `dtype`, `shape`) read one ahead of their use (`get(j)`)."""
        self.cancel()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normfold-readahead")
        return _Rows(self, key, dtype, chunks, shape)

    def close(self) -> None:
        """End of a pass: nothing in flight, no thread left, no buffers kept."""
        self.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.pool.clear()



class _Rows:
    """A head's row chunks read one ahead (Streamer.run_rows): chunk j + 1 is read into the other of two buffers
    while chunk j is used. `get(j)` waits for chunk j (its error raised there) and starts chunk j + 1."""

    def __init__(self, owner: ReadAhead, key: str, dtype: torch.dtype, chunks: list, shape: tuple) -> None:
        self.owner, self.key, self.chunks = owner, key, chunks
        most = max(b - a for a, b in chunks)
        self.bufs = [torch.empty((most, *shape[1:]), dtype=dtype) for _ in range(min(2, len(chunks)))]
        self.cancel = threading.Event()
        self.futures: dict[int, object] = {}
        self._submit(0)

    def _submit(self, j: int) -> None:
        if j < len(self.chunks):
            a, b = self.chunks[j]
            out = self.bufs[j % 2][:b - a]
            self.futures[j] = self.owner._executor.submit(self._read, a, b, out)

    def _read(self, a: int, b: int, out: Tensor) -> None:
        if not self.cancel.is_set():
            self.owner.reader.get_as(self.key, out.dtype, out=out, rows=(a, b))  # straight into `out`: no cast

    def get(self, j: int) -> Tensor:
        self.futures.pop(j).result()
        self._submit(j + 1)  # into the other buffer, used by chunk j - 1, which is done
        a, b = self.chunks[j]
        return self.bufs[j % 2][:b - a]

    def close(self) -> None:
        self.cancel.set()
        for f in self.futures.values():
            try:
                f.result()
            except Exception:  # noqa: BLE001 - a chunk nobody uses
                pass
        self.futures.clear()
        self.bufs = []
