#!/usr/bin/env bash
# Regenerate requirements/lock.txt: every direct and indirect dependency of every extra, pinned, resolved by
# pip-tools' pip-compile from pyproject.toml's ranges and constraints.txt's pins (torch's CPU build), and the
# build and install tools themselves (requirements/build.in: pip, setuptools, wheel).
# Run it after changing a dependency range in pyproject.toml, or to move the lock to newer releases once
# `bash scripts/test-newest.sh` passes with them. Resolved for this Python (3.11) on Linux x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${NORMFOLD_TOOLS_VENV:-.venv-tools}
[ -x "$tools/bin/pip-compile" ] || { python3 -m venv "$tools" && "$tools/bin/pip" install -q "pip-tools==7.7.0"; }
"$tools/bin/pip-compile" -q --upgrade --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
    --extra hf,dev,realmodel,triton,onnx,ctranslate2,bench -c constraints.txt -o requirements/lock.txt \
    pyproject.toml requirements/build.in
echo "requirements/lock.txt: $(grep -c '==' requirements/lock.txt) packages pinned"
