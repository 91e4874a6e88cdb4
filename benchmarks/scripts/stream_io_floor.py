"""The I/O floor of any streamed conversion that writes a new checkpoint and digests it: read every shard's bytes
into one reused buffer (os.preadv, as stream/safetensors_io reads), write them to a new file (os.pwrite), and
SHA-256 them (as the writer's digest thread does), on two threads as the converter overlaps them. No arithmetic.

    python benchmarks/scripts/stream_io_floor.py CHECKPOINT_DIR WORK_DIR [--rounds 3]

Prints JSON: seconds and GB/s for read alone, write alone, hash alone and the overlapped read → write+hash pipe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from pathlib import Path

CHUNK = 64 << 20


def _read(files, buf):
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            off = 0
            while n := os.preadv(fd, [buf], off):
                off += n
                yield memoryview(buf)[:n]
        finally:
            os.close(fd)


def read_only(files):
    buf = bytearray(CHUNK)
    return sum(len(m) for m in _read(files, buf))


def pipe(files, out_dir: Path, do_write=True, do_hash=True):
    """Reader on this thread; writer+hash on another, two buffers handed over (double buffering)."""
    bufs = [bytearray(CHUNK), bytearray(CHUNK)]
    ready, free = [threading.Semaphore(0)], threading.Semaphore(2)
    slots: list = []
    lock = threading.Lock()

    def consumer():
        fd = os.open(out_dir / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        h, off = hashlib.sha256(), 0
        while True:
            ready[0].acquire()
            with lock:
                m = slots.pop(0)
            if m is None:
                break
            if do_write:
                os.pwrite(fd, m, off)
            if do_hash:
                h.update(m)
            off += len(m)
            free.release()
        os.close(fd)

    t = threading.Thread(target=consumer)
    t.start()
    k = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        off = 0
        while True:
            free.acquire()
            b = bufs[k % 2]
            n = os.preadv(fd, [b], off)
            if not n:
                free.release()
                break
            off += n
            with lock:
                slots.append(memoryview(b)[:n])
            ready[0].release()
            k += 1
        os.close(fd)
    with lock:
        slots.append(None)
    ready[0].release()
    t.join()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("checkpoint")
    p.add_argument("work")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    files = sorted(Path(a.checkpoint).glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    res = {}
    for name, fn in (("read", lambda: read_only(files)), ("read+write", lambda: pipe(files, work, True, False)),
                     ("read+hash", lambda: pipe(files, work, False, True)),
                     ("read+write+hash", lambda: pipe(files, work, True, True))):
        best = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            fn()
            best.append(time.perf_counter() - t0)
            (work / "out.bin").unlink(missing_ok=True)
        s = min(best)
        res[name] = {"min_s": round(s, 3), "gb_per_s": round(total / s / 1e9, 3)}
    print(json.dumps({"bytes": total, **res, "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
