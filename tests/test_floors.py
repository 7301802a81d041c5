"""The floors of doc/architecture.md hold: import-linter's layers contract in pyproject.toml passes."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_is_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is a test dependency: pip install -e '.[test]'")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "floors KEPT" in out.stdout
