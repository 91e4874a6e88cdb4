"""safetensors_io.SequentialFile (the streamed writer's output file, written past the page cache with O_DIRECT
where the filesystem takes it): the bytes on disk are exactly those written, whatever the write sizes, the
order, or a filesystem refusing O_DIRECT at open or at a write."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from normfold.stream import safetensors_io as st


def _pieces(seed: int = 0) -> list[bytes | torch.Tensor]:
    """Writes of many sizes: a header, tensors below, at and across the 16 MB staging buffer, odd lengths."""
    g = torch.Generator().manual_seed(seed)
    sizes = [8 + 5, 1, 4095, 4096, 4097, st.STAGE_BYTES - 3, 7, st.STAGE_BYTES + 4099, 123_457, 2]
    out: list = []
    for i, n in enumerate(sizes):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        out.append(bytes(data.numpy()) if i % 3 == 0 else data)
    return out


def _write(path, pieces, *, direct=True, order=None) -> st.SequentialFile:
    size = sum(len(p) if isinstance(p, bytes) else p.numel() for p in pieces)
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p) if isinstance(p, bytes) else p.numel()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        f = st.SequentialFile(fd, path, size, direct=direct)
        for i in order if order is not None else range(len(pieces)):
            p = pieces[i]
            if isinstance(p, bytes):
                st.write_bytes(f, p, offsets[i])
            else:
                st.write_tensor(f, p, offsets[i])
        was_direct = f.direct
        f.close()
        assert os.fstat(fd).st_size == size
    finally:
        os.close(fd)
    f.was_direct = was_direct
    return f


@pytest.mark.parametrize("check", [1, 4096 * 5])  # given up at the first full staging buffer, mid-write or not
def test_a_disk_slower_than_the_page_cache_gets_the_rest_written_plainly(tmp_path, monkeypatch, check):
    monkeypatch.setattr(st, "CHECK_BYTES", check)
    monkeypatch.setattr(st, "MIN_DIRECT_RATE", float("inf"))  # every disk is slow
    pieces = _pieces(6)
    pieces.insert(1, torch.arange(3 * st.STAGE_BYTES + 11, dtype=torch.int64).to(torch.uint8))  # spans 3 buffers
    f = _write(tmp_path / "g.bin", pieces)
    if f.was_direct or f.fell_back:  # direct writing was tried (the filesystem took O_DIRECT)
        assert f.slow and f.fell_back
    assert (tmp_path / "g.bin").read_bytes() == _expected(pieces)


def _expected(pieces) -> bytes:
    return b"".join(p if isinstance(p, bytes) else bytes(p.numpy()) for p in pieces)


@pytest.mark.parametrize("direct", [True, False])
def test_bytes_are_exactly_those_written(tmp_path, direct):
    pieces = _pieces()
    _write(tmp_path / "a.bin", pieces, direct=direct)
    assert (tmp_path / "a.bin").read_bytes() == _expected(pieces)


def test_a_write_out_of_order_falls_back_to_plain_writes(tmp_path):
    pieces = _pieces(1)
    order = [0, 1, 2, 3, 5, 4, 6, 7, 8, 9]  # the 4097-byte write after the one behind it
    _write(tmp_path / "b.bin", pieces, order=order)
    assert (tmp_path / "b.bin").read_bytes() == _expected(pieces)


def test_a_filesystem_refusing_o_direct_at_open_gets_plain_writes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    pieces = _pieces(2)
    f = _write(tmp_path / "c.bin", pieces)
    assert not f.was_direct
    assert (tmp_path / "c.bin").read_bytes() == _expected(pieces)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("refused", [1, 2])  # full buffers are written by the flusher thread: its first or second
def test_a_filesystem_refusing_a_direct_write_gets_the_rest_written_plainly(tmp_path, monkeypatch, refused):
    real_pwrite = os.pwrite
    calls = {"direct": 0}

    def refuse_a_direct_write(fd, data, offset):
        if fcntl_flags(fd) & os.O_DIRECT:
            calls["direct"] += 1
            if calls["direct"] == refused:
                raise OSError(errno.EINVAL, "refused")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_a_direct_write)
    pieces = _pieces(3)
    pieces.insert(2, torch.arange(2 * st.STAGE_BYTES + 5, dtype=torch.int64).to(torch.uint8))  # a buffer behind
    _write(tmp_path / "d.bin", pieces)
    assert (tmp_path / "d.bin").read_bytes() == _expected(pieces)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_a_failed_direct_write_in_the_flusher_thread_is_raised(tmp_path, monkeypatch):
    real_pwrite = os.pwrite

    def disk_full(fd, data, offset):
        if fcntl_flags(fd) & os.O_DIRECT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", disk_full)
    fd = os.open(tmp_path / "e.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        f = st.SequentialFile(fd, tmp_path / "e.bin", 3 * st.STAGE_BYTES, direct=True)
        if not f.direct:
            pytest.skip("this filesystem refuses O_DIRECT")
        with pytest.raises(OSError) as info:
            st.write_tensor(f, torch.zeros(3 * st.STAGE_BYTES, dtype=torch.uint8), 0)
            f.close()
        assert info.value.errno == errno.ENOSPC
        with pytest.raises(OSError):  # closing writes what is staged: the disk is still full, and it says so
            f.close()
        assert f.dfd is None and f.flusher is None and f.stage is None  # but everything is released
    finally:
        os.close(fd)


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


@pytest.mark.parametrize("start,length", [(0, 100), (8, 3 * 4096 + 5), (12345, st.STAGE_BYTES + 77), (4096, 4096),
                                          (5, st.STAGE_BYTES - 5), (5, st.STAGE_BYTES - 4), (-1000, 1000)])
def test_direct_reads_return_the_plain_reads_bytes(tmp_path, start, length):
    pieces = _pieces(4)
    _write(tmp_path / "e.bin", pieces)
    data = _expected(pieces)
    start = start % len(data)
    out = torch.empty(length, dtype=torch.uint8)
    st.read_into(tmp_path / "e.bin", start, out, direct=True)
    assert bytes(out.numpy()) == data[start:start + length]


def test_a_direct_read_past_the_end_is_a_checkpoint_error(tmp_path):
    from normfold.errors import CheckpointError

    pieces = _pieces(5)
    _write(tmp_path / "f.bin", pieces)
    size = len(_expected(pieces))
    for start in (size - 10, size + 5000):
        with pytest.raises(CheckpointError, match="unexpected end of file"):
            st.read_into(tmp_path / "f.bin", start, torch.empty(20, dtype=torch.uint8), direct=True)
