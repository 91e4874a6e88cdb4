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

# Hypothesis profiles (tests/properties/, tests/algebra/test_properties.py). "ci", the default, is
# small and derandomized so a CI run is repeatable; `pytest --hypothesis-profile=deep` searches more.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("deep", max_examples=200, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile(os.environ.get("NORMFOLD_HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a test extra; without it the property tests skip
    pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="session")
def transformers():
    return pytest.importorskip("transformers")
