"""Every ISA path this CPU can run (csrc/nf_simd.h), forced with NORMFOLD_CPU_ISA and checked against
the float64 reference: every dtype, odd widths, non-contiguous input, 0-row input, NaN / Inf rows.
Paths the CPU cannot run are skipped with the reason (AVX-512 on an AVX2 machine; NEON on x86 is
tested under qemu by tests/ops/test_neon_qemu.py)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from norm_cases import DTYPES, KERNEL_ACTIVE, TOL, check_backward, check_forward, d64, ref_fn, rel
from normfold import ops
from normfold.ops import cpu, reference

ALL_ISAS = ["avx512", "avx2", "neon", "portable"]
RUNNABLE = cpu._chain(cpu.detect_isa())


@pytest.fixture(params=ALL_ISAS)
def isa(request, monkeypatch):
    name = request.param
    if not KERNEL_ACTIVE:
        pytest.skip("CPU kernel unavailable or not selected")
    if name not in RUNNABLE:
        pytest.skip(f"this CPU runs {', '.join(RUNNABLE)}; {name} needs another CPU")
    monkeypatch.setenv("NORMFOLD_CPU_ISA", name)
    ops.reload_environment()
    assert cpu.status()["isa"] == name, cpu.status()
    yield name
    monkeypatch.undo()
    ops.reload_environment()


@pytest.mark.parametrize("compressed", [False, True])
def test_forward_and_backward(isa, compressed):
    for dtype in DTYPES:
        for shape in [(1, 1), (3, 5), (7, 768), (4, 767), (3, 4095), (2, 3, 129), (5, 4097)]:
            check_forward(compressed, dtype, shape, "both")
        check_forward(compressed, dtype, (4, 767), "none")
        check_backward(compressed, dtype, (9, 767), "both")
        check_backward(compressed, dtype, (40, 4095), "weight")


def test_fused_add(isa):
    for dtype in DTYPES:
        for n in (5, 767, 4095):
            x, r = torch.randn(6, n).to(dtype), torch.randn(6, n).to(dtype)
            s, y = ops.add_rms_norm(x, r)
            assert torch.equal(s, x + r) and rel(y, reference.rms_norm(s.double())) <= TOL[dtype]


def test_non_contiguous_and_empty(isa):
    for dtype in DTYPES:
        base = torch.randn(6, 2 * 767).to(dtype)
        for x in (base[:, ::2], base[:, :767], base.t()[:767].t(), base[::2, 5:5 + 767]):
            assert rel(ops.rms_norm(x), reference.rms_norm(x.double())) <= TOL[dtype]
        empty = torch.empty(0, 767, dtype=dtype)
        assert ops.rms_norm(empty).shape == (0, 767)


def test_non_finite_rows_like_layernorm(isa):
    x = torch.randn(4, 767)
    x[0, 5] = float("nan")
    x[1, 700] = float("inf")
    x[2, 3] = float("-inf")
    for dtype in DTYPES:
        xd = x.to(dtype)
        y = ops.rms_norm(xd, torch.ones(767, dtype=dtype))
        ln = F.layer_norm(xd.float(), (767,))
        assert torch.equal(y.isnan(), ln.isnan()), dtype  # rows 0-2 all NaN, row 3 finite
        assert y[3].isfinite().all()


def test_float16_uses_hardware_conversion(isa):
    # The ISA paths convert float16 with F16C / AVX-512 / NEON instructions; check the library
    # holds them (the portable build may not: it is not an ISA path).
    if isa == "portable":
        pytest.skip("the portable build is compiler-vectorized, no fixed instruction")
    import shutil
    import subprocess
    if not shutil.which("objdump"):
        pytest.skip("objdump not installed")
    dis = subprocess.run(["objdump", "-d", cpu.status()["library"]], capture_output=True, text=True).stdout
    wide = [line for line in dis.splitlines() if ("vcvtph2ps" in line or "vcvtps2ph" in line)
            and ("%ymm" in line or "%zmm" in line)]
    assert any("vcvtph2ps" in line for line in wide) and any("vcvtps2ph" in line for line in wide)


def test_forcing_a_path_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(cpu, "detect_isa", lambda: "portable")
    monkeypatch.setenv("NORMFOLD_CPU_ISA", "avx512")
    try:
        want, note = cpu._requested_isa()
        assert want == "portable" and "cannot run" in note
        monkeypatch.setenv("NORMFOLD_CPU_ISA", "sse9")
        want, note = cpu._requested_isa()
        assert want == "portable" and "not one of" in note
    finally:
        monkeypatch.undo()
        ops.reload_environment()


def test_info_names_the_path():
    info = ops.info()
    assert info["cpu"]["cpu_isa"] in ALL_ISAS
    if KERNEL_ACTIVE:
        assert info["cpu"]["isa"] in RUNNABLE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert "isa" in ops.info()["cpu"]


@pytest.mark.parametrize("n", [16, 33, 767, 1024, 4095])
@pytest.mark.parametrize("compressed", [False, True])
def test_bf16_fast_rounding_equals_the_nan_safe_kernel(isa, n, compressed):
    # bf16 outputs take a rounding without the NaN fix-up (and, on avx2, the pair layout) unless a
    # float32 weight or bias holds a NaN with low bits set: such a NaN would round to -0 or Inf
    # there. Rows of ±1, ±2, ±0.5 have an exact Σx² in any summation order, so both kernels compute
    # the same rstd and must agree bit for bit outside the NaN column; 40 rows take the pair
    # layout's prepared-parameter path, 3 rows the plain one.
    g = torch.Generator().manual_seed(n)
    values = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, -0.5])
    for rows in (3, 40):
        x = values[torch.randint(0, 6, (rows, n), generator=g)].bfloat16()
        w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        fast, _ = cpu.forward(x, w, b, 1e-5, compressed, False)
        w_nan = w.clone()
        w_nan.view(torch.int32)[n // 2] = 0x7FFFFFFF  # a NaN whose low 16 bits are set
        safe, _ = cpu.forward(x, w_nan, b, 1e-5, compressed, False)
        assert safe[:, n // 2].isnan().all(), isa
        keep = torch.arange(n) != n // 2
        assert torch.equal(fast[:, keep].view(torch.int16), safe[:, keep].view(torch.int16)), (isa, rows)
        ref = reference.crms_norm(x.double(), w.double(), b.double()) if compressed else \
            reference.rms_norm(x.double(), w.double(), b.double())
        assert rel(fast, ref) <= TOL[torch.bfloat16]
        s, y, _ = cpu.add_forward(x, x.flip(0), w, b, 1e-5, compressed, False)
        assert torch.equal(s, x + x.flip(0))
        assert torch.equal(y, cpu.forward(s, w, b, 1e-5, compressed, False)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_row_head_and_tail_length(isa, dtype):
    """Widths 1..40 at every start offset in a vector: every partial head and tail length the masked
    loads and stores handle (nf_ld16n / nf_st16n on avx2), against float64, with sentinels either
    side of the output (and of the residual sum) that must survive."""
    lib = cpu.library()
    code = cpu.DTYPE_CODES[dtype]
    sentinel = torch.tensor(-1234.0).to(dtype)
    for n in list(range(1, 41)) + [383, 767]:
        rows = 3
        for off in range(8):
            xbuf, rbuf = torch.randn(off + rows * n + 8).to(dtype), torch.randn(off + rows * n + 8).to(dtype)
            x, r = xbuf[off:off + rows * n].view(rows, n), rbuf[off:off + rows * n].view(rows, n)
            w = (1 + 0.5 * torch.randn(n)).to(dtype)
            ybuf, sbuf = torch.full((off + rows * n + 8,), -1234.0).to(dtype), torch.full((off + rows * n + 8,), -1234.0).to(dtype)
            y, s = ybuf[off:off + rows * n], sbuf[off:off + rows * n]
            assert lib.nf_forward(code, x.data_ptr(), n, r.data_ptr(), n, w.data_ptr(), code, None, 0, y.data_ptr(),
                                  s.data_ptr(), None, rows, n, 1e-5, 0, 1) == 0
            for buf in (ybuf, sbuf):
                assert (buf[:off] == sentinel).all() and (buf[off + rows * n:] == sentinel).all(), (n, off)
            assert torch.equal(s.view(rows, n), x + r), (n, off)
            ref = reference.rms_norm(s.view(rows, n).double(), w.double())
            assert rel(y.view(rows, n), ref) <= TOL[dtype], (n, off)


@pytest.mark.parametrize("compressed", [False, True])
def test_wide_float32_backward_with_streaming_stores(isa, compressed):
    """One thread, float32 rows of 2048+ values, dy + x + dx past 20 MiB: dx goes out by streaming
    stores (nf_backward_streams), on aligned rows (2048) and on rows whose alignment changes within a
    block (2049, 4095). Against float64, the same dx bits as three threads (ordinary stores below
    40 MiB; only dweight's summation order differs), and sentinels either side of dx that survive."""
    lib = cpu.library()
    code = cpu.DTYPE_CODES[torch.float32]
    for n in (2048, 2049, 4095):
        rows, off = (20 << 20) // (12 * n) + 5, 3
        check_backward(compressed, torch.float32, (rows, n), "weight")
        x, dy, w = torch.randn(rows, n), torch.randn(rows, n), 1 + 0.5 * torch.randn(n)
        _, rstd = cpu.forward(x, w, None, 1e-5, compressed, want_rstd=True)
        outs = []
        for threads in (1, 3):
            buf = torch.full((off + rows * n + 16,), -1234.0)
            dx, dw = buf[off:off + rows * n], torch.empty(threads, n)
            assert lib.nf_backward(code, dy.data_ptr(), None, x.data_ptr(), n, w.data_ptr(), code, rstd.data_ptr(),
                                   dx.data_ptr(), dw.data_ptr(), None, rows, n, int(compressed), threads) == 0
            assert (buf[:off] == -1234.0).all() and (buf[off + rows * n:] == -1234.0).all(), (n, threads)
            outs.append(dx.clone())
        assert torch.equal(outs[0], outs[1]), n


@pytest.mark.parametrize("compressed", [False, True])
def test_large_float32_fused_add_with_streaming_stores(isa, compressed):
    """One thread, float32 fused add with x, r, s, y past 30 MiB: s and y go out by streaming stores
    and the normalize pass recomputes x + r (nf_add_streams). Every affine combination, an odd width
    (row heads) and a wide one: s bit for bit x + r, y bit for bit the three-thread result (ordinary
    stores below 40 MiB) and against float64, sentinels either side of s and y."""
    lib = cpu.library()
    code = cpu.DTYPE_CODES[torch.float32]
    for n, affine in ((1023, "both"), (1023, "none"), (4096, "weight"), (4096, "bias")):
        rows, off = (30 << 20) // (16 * n) + 7, 5
        x, r = torch.randn(rows, n), torch.randn(rows, n)
        w = 1 + 0.5 * torch.randn(n) if affine in ("weight", "both") else None
        b = 0.5 * torch.randn(n) if affine in ("bias", "both") else None
        outs = []
        for threads in (1, 3):
            ybuf, sbuf = torch.full((off + rows * n + 16,), -1234.0), torch.full((off + rows * n + 16,), -1234.0)
            y, s = ybuf[off:off + rows * n], sbuf[off:off + rows * n]
            assert lib.nf_forward(code, x.data_ptr(), n, r.data_ptr(), n, None if w is None else w.data_ptr(), code,
                                  None if b is None else b.data_ptr(), code, y.data_ptr(), s.data_ptr(), None, rows,
                                  n, 1e-5, int(compressed), threads) == 0
            for buf in (ybuf, sbuf):
                assert (buf[:off] == -1234.0).all() and (buf[off + rows * n:] == -1234.0).all(), (n, affine, threads)
            outs.append((y.view(rows, n).clone(), s.view(rows, n).clone()))
        (y1, s1), (y3, s3) = outs
        assert torch.equal(s1, x + r) and torch.equal(s3, x + r), (n, affine)
        assert torch.equal(y1, y3), (n, affine)
        ref = ref_fn(compressed)(s1.double(), d64(w), d64(b), 1e-5)
        assert rel(y1, ref) <= TOL[torch.float32], (n, affine)
