"""The output of a streamed conversion: every file laid out header first, tensors written at their offsets by a
writer thread while the next component is read ahead and computed (`write_checkpoint`), untouched tensors
copied file to file, each file's SHA-256 computed as it is written; then config, index and tokenizer files."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from .. import checkpoint, io
from ..errors import NonFiniteWeightsError, NormfoldError
from . import safetensors_io as st
from .compute import Computer
from .plan import pending_verification
from .source import INDEX, Source

METADATA = {"format": "pt"}  # as io.save writes it



def _finite_check(dtype: torch.dtype, name: str):
    if not dtype.is_floating_point:
        return None

    def check(view) -> None:
        if not st.all_finite(torch.frombuffer(view, dtype=dtype)):
            raise NonFiniteWeightsError(f"tensor {name} has NaN/inf values; no conversion of it can be exact. "
                                        "Fix or re-download the checkpoint.")
    return check



# output files written with O_DIRECT (safetensors_io.SequentialFile; NORMFOLD_STREAM_DIRECT=0 turns it off)
DIRECT = os.environ.get("NORMFOLD_STREAM_DIRECT", "1") != "0"

PREFETCH = 1  # components read ahead of the one being computed
# computed tensors waiting for the writer, at most (then the compute waits): 64 MB keeps the writer busy (a
# block's largest tensor is written in tens of ms) without holding a quarter of a shard of finished tensors
WRITE_QUEUE_BYTES = 64 * 1024 * 1024



class _Writer:
    """Reading, computing and writing overlapped: a reader thread reads the next component's tensors and a
    writer thread writes finished ones (in order: each file is written front to back, so its SHA-256 is
    computed as it goes) while the main thread computes; torch, os.pread/pwrite and hashlib release the GIL.
    Queued writes hold at most WRITE_QUEUE_BYTES of tensors."""

    def __init__(self) -> None:
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normfold-read")
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normfold-write")
        # SHA-256 of each file in its own thread, in write order: hashing (~1 GB/s) and pwrite into the page cache
        # otherwise take turns on the writer thread, the bottleneck of a float32 conversion
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normfold-hash")
        self.queue, self.queued = deque(), 0

    def submit(self, fn, *args):
        return self.reader.submit(fn, *args)

    def write(self, fn, *args, nbytes: int = 0, hash_job: tuple | None = None) -> None:
        """Queue `fn(*args)` on the writer thread and `hash_job` (fn, *args) on the hasher thread (both in
        submission order); queued jobs hold at most WRITE_QUEUE_BYTES."""
        while self.queue and self.queued + nbytes > WRITE_QUEUE_BYTES:
            self._pop()
        futures = [self.writer.submit(fn, *args)]
        if hash_job is not None:
            futures.append(self.hasher.submit(*hash_job))
        self.queue.append((futures, nbytes))
        self.queued += nbytes

    def _pop(self) -> None:
        futures, n = self.queue.popleft()
        self.queued -= n
        for future in futures:
            future.result()  # a write's error (disk full, NaN in a copied tensor) surfaces here

    def drain(self) -> None:
        while self.queue:
            self._pop()

    def close(self, ok: bool) -> None:
        for pool in (self.reader, self.writer, self.hasher):
            pool.shutdown(wait=True, cancel_futures=not ok)



class _Progress:
    """One line per output file: bytes done, rate and time left from the average rate since the start (it
    does not jump with one slow or fast tensor). With `work` (the command's `progress.Work`), the time left is
    the whole command's, the verification still to come included."""

    STEPS = 10  # and a line each time another tenth of the bytes is done (integers: 0.1 * 3 < 0.3 skipped one),
    GAP = 1.0  # but not within a second of the last line (a small checkpoint gets its header line only)

    def __init__(self, total: int, say, work=None) -> None:
        self.total, self.say, self.t0, self.done = max(total, 1), say, time.perf_counter(), 0
        self.work = work
        self.fname, self.next, self.last = "", 1, self.t0

    def _line(self, head: str) -> None:
        dt = time.perf_counter() - self.t0
        line = f"{head}: {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB"
        if self.done and dt > 0.5:
            rate = self.done / dt
            line += f", {rate / 1e9:.2f} GB/s"
            line += self.work.suffix() if self.work is not None else f", ~{(self.total - self.done) / rate:.0f} s left"
        self.last = time.perf_counter()
        self.say(line)

    def file(self, fname: str, n: int) -> None:
        self.fname = fname
        self._line(f"writing {fname} ({n} tensors)")

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.work is not None:
            self.work.update("convert", self.done / self.total)
        if self.done * self.STEPS >= self.next * self.total and self.done < self.total:
            self.next = self.done * self.STEPS // self.total + 1
            if time.perf_counter() - self.last >= self.GAP:
                self._line(f"  {self.fname}")



def write_checkpoint(out: Path, files, outputs, owner, comps, computer: Computer, names, source: Source, say) -> dict:
    """Write each output file: header first, then every tensor at its offset. Components are computed in the
    order their first output comes up (their other outputs wait in `pending`: same file, see assign_files),
    the next one's tensors read ahead by a thread; tensors go to a writer thread."""
    layouts, order, seen = [], [], set()
    for fname, tensors in files.items():
        header, placed = st.layout({o.name: (st.ST_DTYPES[o.dtype], o.shape) for o in tensors}, METADATA)
        layouts.append((fname, {o.name: o for o in tensors}, header, placed))
        for name, _, _ in placed:
            i = owner.get(name)
            if i is not None and i not in seen:
                seen.add(i)
                order.append(i)
    progress = _Progress(sum(n for *_, placed in layouts for _, _, n in placed), say, getattr(say, "work", None))
    weight_map: dict[str, str] = {}
    digests: dict[str, dict] = {}
    pending: dict[str, torch.Tensor] = {}
    reads: dict[int, object] = {}
    done = {"next": 0}  # position in `order` of the next component to compute
    total = 0
    raw_fds: list[int] = []
    sinks: list[st.SequentialFile] = []
    finished: list[tuple] = []  # (file name, its HashingSink, its descriptor), digested after the last write
    io_ = _Writer()
    ok = False

    def inputs(i: int) -> dict[str, torch.Tensor]:
        k = done["next"]
        for j in order[k:k + 1 + PREFETCH]:
            if j not in reads:
                reads[j] = io_.submit(computer.read, comps[j])
        done["next"] = k + 1
        return reads.pop(i).result()

    def digest(fname: str, sink, raw_fd: int) -> None:  # once the file's writes and hash jobs are done
        digests[fname] = {"sha256": sink.hexdigest(), "bytes": os.fstat(raw_fd).st_size}

    try:
        for fname, by_name, header, placed in layouts:
            progress.file(fname, len(placed))
            raw_fd = os.open(out / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            raw_fds.append(raw_fd)
            fd = checkpoint.HashingSink(raw_fd, out / fname)  # SHA-256 while writing (tamper evidence)
            base = len(header)
            size = base + sum(n for _, _, n in placed)
            _preallocate(raw_fd, size)
            # written front to back past the page cache (O_DIRECT, where the filesystem takes it)
            # (not after a file found the disk slower than the page cache: see SequentialFile.slow)
            sink = st.SequentialFile(raw_fd, out / fname, size, direct=DIRECT and not any(s.slow for s in sinks))
            sinks.append(sink)
            io_.write(st.write_bytes, sink, header, 0, hash_job=(fd.seen, header, 0))

            def put(t: torch.Tensor, at: int, nbytes: int) -> None:  # written and hashed in their own threads
                t = t.detach().contiguous()
                io_.write(st.write_tensor, sink, t, at, nbytes=nbytes, hash_job=(_hash_tensor, fd, t, at))

            for name, offset, nbytes in placed:
                o = by_name[name]
                if o.fill is not None:
                    put(torch.full(o.shape, o.fill, dtype=o.dtype), base + offset, nbytes)
                elif name in computer.head_means:
                    put(computer.derived(name), base + offset, nbytes)
                elif name in owner:
                    if name not in pending:
                        i = owner[name]
                        keys = [k for k, v in owner.items() if v == i]
                        pending.update(computer.run(comps[i], keys, inputs(i)))
                    t = pending.pop(name)
                    if t.dtype != o.dtype or tuple(t.shape) != o.shape:
                        raise NormfoldError(f"internal: {name} computed as {t.dtype}{list(t.shape)}, "
                                            f"planned {o.dtype}{list(o.shape)}")
                    put(t, base + offset, nbytes)
                    del t
                else:
                    info = source.tensors[names[name]]
                    # the hasher reads the same bytes from the source (page cache) as the writer copies them
                    io_.write(st.copy_range, info.file, info.start, nbytes, sink, base + offset,
                              _finite_check(o.dtype, names[name]), nbytes=min(nbytes, st.CHUNK),
                              hash_job=(_hash_range, fd, info.file, info.start, nbytes, base + offset))
                    # a copy holds one 8 MB chunk, not the tensor: it counts as that in the write queue, so the
                    # next components are computed while a large one (the embedding table) is copied and hashed
                weight_map[name] = fname
                total += nbytes
                progress.add(nbytes)
            # the file's last block written by the writer thread after its other writes (no drain here: the
            # next file's first components are computed while this one's last bytes are written and hashed);
            # its digest once everything is written
            io_.write(st.SequentialFile.close, sink)
            finished.append((fname, fd, raw_fd))
        io_.drain()
        for fname, fd, raw_fd in finished:
            digest(fname, fd, raw_fd)
        ok = True
    finally:
        io_.close(ok)  # waits for running jobs (and drops queued ones on failure) before the files close
        for sink in sinks:
            sink.close()
        for raw_fd in raw_fds:
            os.close(raw_fd)
    if pending:
        raise NormfoldError(f"internal: computed tensors never written: {sorted(pending)[:5]}")
    return {"files": [f for f, *_ in layouts], "weight_map": weight_map, "total_size": total, "digests": digests}



def _hash_tensor(sink, t: torch.Tensor, offset: int) -> None:
    if t.numel():
        sink.seen(memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B"), offset)


def _hash_range(sink, src: Path, start: int, nbytes: int, offset: int) -> None:
    """Hash bytes [start, start + nbytes) of `src` as written at `offset` (a copied tensor), in 8 MB chunks."""
    fd = os.open(src, os.O_RDONLY)
    try:
        buf = bytearray(min(st.CHUNK, max(nbytes, 1)))
        done = 0
        while done < nbytes:
            view = memoryview(buf)[:min(len(buf), nbytes - done)]
            if os.preadv(fd, [view], start + done) != len(view):
                raise NormfoldError(f"{src}: unexpected end of file")
            sink.seen(view, offset + done)
            done += len(view)
    finally:
        os.close(fd)


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks at once (ext4 otherwise allocates page by page as writes extend the file):
    faster, and a full disk fails here, before the work."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            return  # a filesystem without fallocate: extend as we write
        raise



def write_aux(out: Path, model: nn.Module, source_dir: Path, report, written: dict) -> None:
    """config.json (architectures = this class, as normfold.save writes it), the index of a sharded output,
    and the tokenizer / generation files copied from the source."""
    if len(written["files"]) > 1:
        index = {"metadata": {"total_size": written["total_size"]},
                 "weight_map": dict(sorted(written["weight_map"].items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    for f in checkpoint.ModelDir(source_dir).auxiliary_files():  # checked: nothing from outside the source
        shutil.copy2(f, out / f.name)
    io.apply_umask(out)


def write_streamed(out: Path, files, outputs, owner, comps, values, names, source: Source, say, model: nn.Module,
                   report, t0: float):
    """Write a streamed conversion's weights (freed memory reused up to the largest source shard), its
    config / tokenizer files, and its report (digests, time, verification pending); returns the report."""
    largest = max(p.stat().st_size for p in source.shards)
    # the budget: the largest shard's worth of recycled tensors, plus the write queue and the staging buffers
    # beside them (with the largest shard alone, the heap was trimmed at 12-32 of 46 components and re-faulted)
    with st.reuse_freed_memory(budget=largest + WRITE_QUEUE_BYTES):
        written = write_checkpoint(out, files, outputs, owner, comps, values, names, source, say)
    write_aux(out, model, source.path, report, written)
    report.weight_files = written["digests"]
    report.seconds["convert"] = round(time.perf_counter() - t0, 3)
    report.verification = pending_verification(report.dtype)
    (out / io.REPORT_FILE).write_text(report.to_json() + "\n")
    return report
