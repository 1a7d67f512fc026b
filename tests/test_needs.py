"""Skips in CI: one that tests/intended_skips.py lists passes, any other fails the run
under CI=true (and only there). Run as a pytest of its own on two tiny test files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

INTENDED = '''import pytest
def test_gpu():
    pytest.skip("needs a CUDA GPU")
'''
BROKEN = '''import pytest
def test_server():
    pytest.skip("cannot import lmcache: ImportError")
'''


@pytest.mark.parametrize("body,ci,code", [
    (INTENDED, "true", 0), (BROKEN, "true", 1), (BROKEN, "", 0), (INTENDED, "", 0)])
def test_only_intended_skips_pass_ci(tmp_path, body, ci, code):
    for name in ("conftest.py", "needs.py", "intended_skips.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_one.py").write_text(body)
    env = {**os.environ, "CI": ci}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == code, run.stdout[-2000:]
    assert "skips by reason" in run.stdout
