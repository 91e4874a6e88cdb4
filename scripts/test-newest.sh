#!/usr/bin/env bash
# Install the NEWEST releases inside pyproject.toml's declared ranges (not the lock) into a separate
# virtual environment and run the tests there, so a breaking dependency release is seen the day it
# appears instead of on a user's machine.
#
#   bash scripts/test-newest.sh            # the whole suite
#   bash scripts/test-newest.sh --quick    # the tests that follow transformers most closely (a few minutes)
#   bash scripts/test-newest.sh -- tests/adapters -x   # any pytest arguments after --
#
# torch stays at the lock's version (constraints.txt): the newest torch wheel on the package index is a
# several-GB CUDA build, and CPU builds are published on PyTorch's own index. Everything else floats.
# Prints the versions that differ from requirements/lock.txt, then pytest's result; exits with pytest's code.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${NORMFOLD_NEWEST_VENV:-.venv-newest}
extras=${NORMFOLD_NEWEST_EXTRAS:-dev,realmodel,onnx}
args=()
if [ "${1:-}" = "--quick" ]; then
    shift
    args=(tests/fastpath tests/analysis/test_analysis_families.py tests/test_fastpath.py)
fi
[ "${1:-}" = "--" ] && shift
args+=("$@")

python3 -m venv "$venv" || exit 2
. "$venv/bin/activate"
python -m pip install -q -c requirements/lock.txt pip >/dev/null 2>&1  # --upgrade-strategy eager below moves it too
torch_pin=$(mktemp)
grep -E '^torch==' constraints.txt > "$torch_pin"
if ! pip install -q --upgrade --upgrade-strategy eager -c "$torch_pin" -e ".[$extras]" >"$venv/install.log" 2>&1; then
    echo "newest releases: install failed (see $venv/install.log):"
    grep -vi "^WARNING: Location" "$venv/install.log" | tail -5
    exit 2
fi
rm -f "$torch_pin"
python - <<'PY'
import re
from importlib.metadata import distributions
lock = dict(re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", l).groups() for l in open("requirements/lock.txt")
            if re.match(r"[A-Za-z0-9]", l))
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
lock = {norm(k): v for k, v in lock.items()}
newer = sorted((norm(d.metadata["Name"]), lock[norm(d.metadata["Name"])], d.version) for d in distributions()
               if norm(d.metadata["Name"]) in lock and lock[norm(d.metadata["Name"])] != d.version)
print("newest releases: " + (", ".join(f"{n} {a} -> {b}" for n, a, b in newer) if newer
                             else "every locked package is already the newest in range"))
PY
python -m pytest -q -p no:cacheprovider "${args[@]}"
