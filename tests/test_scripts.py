"""The developer scripts (scripts/*.py and *.sh) at least parse: most of them run only on the lent GPU machine, where
a syntax error costs a call (session 20's gdn_sweep.py lost its loop header in an edit and nothing here noticed)."""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_python_script_parses(path):
    ast.parse(path.read_text(), filename=str(path))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.sh")), ids=lambda p: p.name)
def test_shell_script_parses(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_broken_script_is_caught(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("for x in y:\n\n        z = 1\n    w = 2\n")
    with pytest.raises(SyntaxError):
        ast.parse(bad.read_text())
    sh = tmp_path / "bad.sh"
    sh.write_text("if true; then\n  echo\n")
    assert subprocess.run(["bash", "-n", str(sh)], capture_output=True).returncode != 0
