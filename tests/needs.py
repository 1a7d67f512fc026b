"""What the tests need from their environment, and what happens when it is missing:
a skip on a developer's machine, a failure in CI (CI=true, as .ci/run runs): a broken
`import vllm` or a missing LMCache must not turn CI green by skipping everything that
uses them. (Tests marked `cuda` are skipped without a GPU everywhere, CI included:
tests/conftest.py.)"""

from __future__ import annotations

import importlib
import os

import pytest


def in_ci() -> bool:
    """True where the environment says CI (CI=true; any value but "", 0, false, no)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> None:
    """Skip (the whole module when called at import) outside CI; fail in CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI={os.environ.get('CI')}: a missing dependency is a "
                    "failure in CI, not a skip)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str):
    """`import module` and return it; if that raises ImportError, `skip_or_fail`. Use it
    instead of `pytest.importorskip`."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        skip_or_fail(f"cannot import {module}: {type(e).__name__}: {e}")
