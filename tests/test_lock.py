"""requirements/lock.txt is what CI installs: it must pin every dependency that pyproject.toml declares, each
inside its declared range, and nothing may float (scripts/lock.sh regenerates it; docs/testing.md)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
LOCKED_EXTRAS = ("hf", "dev", "realmodel", "triton", "onnx", "ctranslate2", "bench")  # scripts/lock.sh's --extra


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if not line or line[0] in "# ":
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._\-]*)==(\S+)", line.strip())
        assert m, f"requirements/lock.txt: not an exact pin: {line!r}"
        pins[canonicalize_name(m[1])] = m[2]
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_every_declared_dependency_is_pinned_inside_its_range():
    pins = _lock()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared in pyproject.toml but not in the lock: run scripts/lock.sh"
        version = Version(pins[name]).public  # torch's "+cpu" local build satisfies "torch>=2.13"
        assert req.specifier.contains(version, prereleases=True), \
            f"the lock's {req.name}=={pins[name]} is outside pyproject.toml's {req}: run scripts/lock.sh"


def test_build_tools_and_the_torch_pin_are_locked():
    pins = _lock()
    assert {"pip", "setuptools", "wheel"} <= set(pins)  # a new pip/setuptools release must not change CI's build
    torch_pin = next(line for line in (ROOT / "constraints.txt").read_text().splitlines()
                     if line.startswith("torch=="))
    assert Version(pins["torch"]).public == Version(torch_pin.split("==")[1]).public


def test_lock_records_the_command_that_made_it():
    head = LOCK.read_text()[:1000]
    script = (ROOT / "scripts" / "lock.sh").read_text()
    assert "pip-compile" in head and "pip-compile" in script
    for extra in LOCKED_EXTRAS:
        assert extra in head.split("--extra=")[1].split()[0].split(",")


def test_ci_runs_the_readme_test_command():
    """.ci/run installs and tests exactly as README's set-up command 2 says."""
    readme = (ROOT / "README.md").read_text().splitlines()
    command = next(readme[i + 1] for i, line in enumerate(readme) if line.startswith("# 2."))
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [s.strip() for s in command.split("&&")]
    assert any("requirements/lock.txt" in s for s in steps)
    for step in steps:
        if step.startswith(("pip install", "python -m pytest")):
            assert step.replace("pip install", "pip install -q", 1).replace("pytest -q", "pytest -q") in ci \
                or step in ci, f".ci/run does not run README's {step!r}"
