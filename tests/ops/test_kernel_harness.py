"""The C harness tests/ops/harness/nf_check.c (float64-reference checks of every kernel entry point,
no Python in the loop) built for each ISA path: natively for the paths this CPU runs, and for NEON
with an aarch64 cross compiler under qemu user-mode emulation (correctness only; timing under
emulation means nothing). CI installs gcc-aarch64-linux-gnu and qemu-user (.ci/run); where they are
missing the NEON test is skipped with the reason."""

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from normfold.ops import cpu

HARNESS = Path(__file__).with_name("harness") / "nf_check.c"
CSRC = Path(cpu.__file__).with_name("csrc")
NATIVE = {"avx512": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"], "portable": ["-DNF_FORCE_GENERIC"],
          "neon": []}


def _build_and_run(cc, flags, tmp_path, runner=()):
    exe = tmp_path / "nf_check"
    subprocess.run([cc, "-O2", *flags, f"-I{CSRC}", str(HARNESS), "-o", str(exe), "-lm"], check=True,
                   capture_output=True, text=True, timeout=300)
    out = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_native_paths(isa, tmp_path):
    cc = cpu._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    runnable = cpu._chain(cpu.detect_isa())
    if isa not in runnable:
        pytest.skip(f"this CPU runs {', '.join(runnable)}; {isa} needs another CPU")
    rc, out = _build_and_run(cc, NATIVE[isa], tmp_path)
    assert rc == 0 and f"isa={isa} " in out and "failures=0" in out, out[-3000:]


def test_neon_path(tmp_path):
    if platform.machine().lower() in ("aarch64", "arm64"):
        cc, runner = cpu._compiler(), ()
        if cc is None:
            pytest.skip("no C compiler")
    else:
        cc = shutil.which("aarch64-linux-gnu-gcc")
        qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
        if cc is None or qemu is None:
            pytest.skip("NEON needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu "
                        "qemu-user); not installed")
        runner = (qemu,)
    rc, out = _build_and_run(cc, ["-static"] if runner else [], tmp_path, runner)
    assert rc == 0 and "isa=neon " in out and "failures=0" in out, out[-3000:]
