#!/usr/bin/env bash
# Every check normfold runs on a CUDA machine, in one go (a lent device's minutes are few): the GPU
# tests, the fast paths on the GPU, then the GPU benchmark suites. Each step has its own time limit so
# one slow step cannot eat the rest. Results: $OUT (default /tmp/normfold-gpu): log.txt and the suites'
# markdown / CSV tables.
#
#     bash benchmarks/scripts/gpu/run_all.sh
set -u
OUT=${OUT:-/tmp/normfold-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
PY=${PY:-python3}
step() { echo; echo "== $(date +%T) $1"; }
{
step "machine"
nvidia-smi -L
$PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
step "GPU tests (pytest -m cuda, and the Triton kernels' file on the GPU)"
timeout "${T_TESTS:-200}" $PY -m pytest -q -p no:cacheprovider -m cuda tests
timeout "${T_TESTS:-200}" $PY -m pytest -q -p no:cacheprovider tests/ops/test_triton_kernels.py tests/test_fastpath.py
step "fast paths on the GPU"
timeout "${T_FAST:-120}" $PY benchmarks/scripts/gpu/fastpath_check.py
step "bench hf --device cuda"
timeout "${T_HF:-150}" $PY -m normfold bench hf --device cuda --quick --rounds "${ROUNDS:-21}" --out /tmp/nf-b/hf -q
step "bench ops --device cuda --quick"
timeout "${T_OPS:-120}" $PY -m normfold bench ops --device cuda --quick --out /tmp/nf-b/ops -q
step "bench e2e --device cuda --quick"
timeout "${T_E2E:-120}" $PY -m normfold bench e2e --device cuda --quick --out /tmp/nf-b/e2e -q
step "done"
} 2>&1 | tee "$OUT/log.txt"
for s in hf ops e2e; do
    cp /tmp/nf-b/$s/$s*.md "$OUT/" 2>/dev/null
done
cp /tmp/nf-b/hf/hf.csv "$OUT/" 2>/dev/null
ls -la "$OUT"
