"""Shared fixtures. Tests never touch the network: models are built from tiny configs in code."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels are tested in Triton's interpreter, which has to be chosen
# before anything imports triton (transformers' model modules do). tests/ops/test_triton_kernels.py
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import perturb_norms  # noqa: E402,F401  (re-exported for tests)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="session")
def transformers():
    return pytest.importorskip("transformers")
